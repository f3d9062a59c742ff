"""Benchmark family: frozen backbone + trainable head (fine-tuning / linear probe).

Architecture: a CNN backbone (4 conv3x3+BatchNorm2d+ReLU stages, 32x32 RGB ->
256 channels at 4x4, global average pool; about 0.96M parameters) whose
parameters all have ``requires_grad=False``, followed by a trainable
2-layer MLP head (256 -> 256 -> 10; about 68k parameters).

Quirks exercised: most parameters get no gradient and no optimizer state;
since the input does not require grad either, autograd saves nothing inside
the backbone (its activations are freed as the forward pass goes), so the
activation memory is that of the head only. The backbone's BatchNorm layers
are still in train mode (batch statistics, running stats updated) unless
the trainer calls eval() on them. The file defines ``optimizer(parameters)``
that keeps only ``p.requires_grad`` parameters instead of relying on the
caller to filter.

Data (synthetic, deterministic): 2048 images x ~ N(0, 1) of shape
(3, 32, 32) float32; label = argmax of a fixed random projection of the
8x8-average-pooled image (int64, 10 classes).
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


def _stage(c_in, c_out, pool):
    layers = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class FrozenBackboneClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(
            _stage(3, 64, pool=True),  # 16x16
            _stage(64, 128, pool=True),  # 8x8
            _stage(128, 256, pool=True),  # 4x4
            _stage(256, 256, pool=False),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, NUM_CLASSES))

    def forward(self, x):
        return self.head(self.backbone(x))


def model():
    return FrozenBackboneClassifier()


def optimizer(parameters):
    trainable = [p for p in parameters if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=settings["lr"], weight_decay=0.01)


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(_SEED)
        x = torch.randn(N_SAMPLES, 3, 32, 32, generator=g)
        w = torch.randn(3 * 4 * 4, NUM_CLASSES, generator=g)
        y = (F.avg_pool2d(x, 8).flatten(1) @ w).argmax(dim=1)
        _CACHE["train"] = TensorDataset(x, y)
    return _CACHE["train"]
