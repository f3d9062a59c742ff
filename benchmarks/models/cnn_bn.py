"""Benchmark family: ResNet-ish CNN with BatchNorm2d and residual blocks.

Architecture: conv3x3(3->32)+BN+ReLU stem on 32x32 RGB input, then three
basic residual blocks (conv-BN-ReLU-conv-BN + shortcut, ReLU):
32->32 at 32x32, 32->64 stride 2 (1x1 conv+BN projection shortcut) at 16x16,
64->128 stride 2 (projection) at 8x8, global average pool, linear to 10
classes. About 0.31M parameters. Exercises conv activations (large spatial
maps at low channel counts), BatchNorm running-stat buffers
(running_mean/var, num_batches_tracked) and in-place ReLUs.

Data (synthetic, deterministic): 2048 images x ~ N(0, 1) of shape
(3, 32, 32) float32; label (int64, 10 classes) = argmax of a fixed random
projection of the 4x4-average-pooled image, so the task is learnable.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

NUM_CLASSES = 10
N_SAMPLES = 2048
_SEED = 0
_CACHE = {}

settings = {"global_batch": 32, "epochs": 1, "lr": 1e-3}


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x), inplace=True)


class SmallResNet(nn.Module):
    def __init__(self, num_classes=NUM_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True)
        )
        self.layers = nn.Sequential(
            BasicBlock(32, 32), BasicBlock(32, 64, stride=2), BasicBlock(64, 128, stride=2)
        )
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def model():
    return SmallResNet()


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(_SEED)
        x = torch.randn(N_SAMPLES, 3, 32, 32, generator=g)
        w = torch.randn(3 * 8 * 8, NUM_CLASSES, generator=g)
        y = (F.avg_pool2d(x, 4).flatten(1) @ w).argmax(dim=1)
        _CACHE["train"] = TensorDataset(x, y)
    return _CACHE["train"]
