"""Benchmark family: a CNN on images of several sizes, padded per batch.

Architecture: 3 -> 16 -> 32 channels of 3x3 convolutions (ReLU, the second strided) -> global
average pooling -> Linear to 10 classes. About 5.4K parameters.

Quirk exercised: images are 3 x H x W with H and W each one of 24, 40, 64 (drawn apart, so
that some images are tall and some wide), the first ones 24 x 24; ``collate`` zero-pads a batch
to its tallest height and widest width. The worst batch is not the batch of the largest
single image: it holds a tall and a wide one, padded to 64 x 64 together.

Data (synthetic, deterministic): 600 images ~ N(0, 1) (seed 0), none 64 x 64; label = the
(H, W) combination's index mod 10 plus the sign of the mean.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES = (24, 40, 64)
N_ITEMS = 600
_CACHE = {}

settings = {"global_batch": 16, "epochs": 1, "lr": 1e-3}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, padding=1, stride=2)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.c1(x))
        x = F.relu(self.c2(x))
        return self.head(x.mean(dim=(2, 3)))


def model():
    return Net()


class Images(torch.utils.data.Dataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(0)
        images, labels = [], []
        for i in range(N_ITEMS):
            hi, wi = torch.randint(0, len(SIZES), (2,), generator=g).tolist()
            if i < 32 or (hi == wi == len(SIZES) - 1):
                hi = wi = 0 if i < 32 else 1
            x = torch.randn(3, SIZES[hi], SIZES[wi], generator=g)
            images.append(x)
            labels.append(int((hi * 3 + wi) % 10 + (x.mean() > 0)) % 10)
        _CACHE["train"] = Images(images, torch.tensor(labels))
    return _CACHE["train"]


def collate(items):
    """Zero-pads a batch to its tallest height and widest width."""
    H = max(x.shape[1] for x, _ in items)
    W = max(x.shape[2] for x, _ in items)
    out = torch.zeros(len(items), 3, H, W)
    for i, (x, _) in enumerate(items):
        out[i, :, : x.shape[1], : x.shape[2]] = x
    return out, torch.stack([y for _, y in items])
