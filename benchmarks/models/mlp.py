"""Benchmark family: plain MLP classifier.

Architecture: ``nn.Sequential`` of Linear/GELU with 4 hidden layers
(256 -> 1024 -> 1024 -> 1024 -> 1024 -> 10), about 3.4M parameters. The
simplest case: every activation is a (B, 1024) matrix, no buffers, no
attention, no data-dependent shapes; default cross-entropy loss and the
default optimizer.

Data (synthetic, deterministic): 2048 samples of x ~ N(0, 1) in R^256 (float32),
label = argmax of a fixed random linear projection of x (int64, 10 classes),
so the task is learnable.
"""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

IN_FEATURES = 256
HIDDEN = 1024
N_HIDDEN_LAYERS = 4
NUM_CLASSES = 10
N_SAMPLES = 2048
_SEED = 0
_CACHE = {}

settings = {"global_batch": 32, "epochs": 1, "lr": 1e-3}


def model():
    layers = []
    width = IN_FEATURES
    for _ in range(N_HIDDEN_LAYERS):
        layers += [nn.Linear(width, HIDDEN), nn.GELU()]
        width = HIDDEN
    layers.append(nn.Linear(width, NUM_CLASSES))
    return nn.Sequential(*layers)


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(_SEED)
        x = torch.randn(N_SAMPLES, IN_FEATURES, generator=g)
        w = torch.randn(IN_FEATURES, NUM_CLASSES, generator=g)
        y = (x @ w).argmax(dim=1)
        _CACHE["train"] = TensorDataset(x, y)
    return _CACHE["train"]
