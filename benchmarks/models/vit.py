"""Benchmark family: small Vision Transformer (ViT) on 32x32 RGB images.

Architecture: patch embedding as a strided ``nn.Conv2d(3, 192, kernel 4,
stride 4)`` (64 patches), a learnable class token and position embedding
(``nn.Parameter``), 4 ``nn.TransformerEncoderLayer`` (pre-LN
``norm_first=True``, GELU, ``batch_first=True``, dropout 0) held explicitly
in an ``nn.ModuleList`` named ``blocks`` (no ``nn.TransformerEncoder``
deep-copy), final LayerNorm, linear head on the class token to 10 classes.
About 1.8M parameters.

Quirks exercised: conv -> token reshape (flatten + transpose), bare
``nn.Parameter`` tensors outside any layer (cls token, position
embedding), torch's built-in ``nn.TransformerEncoderLayer`` /
``nn.MultiheadAttention`` (which take a fused fast path in eval mode
without grad, but not in training), 65-token sequences (not a power of 2).

Data (synthetic, deterministic): 2048 images x ~ N(0, 1) of shape
(3, 32, 32) float32; label (int64, 10 classes) = argmax of a fixed random
projection of the 8x8-average-pooled image.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

IMAGE = 32
PATCH = 4
D_MODEL = 192
N_HEAD = 6
N_LAYERS = 4
NUM_CLASSES = 10
N_SAMPLES = 2048
_SEED = 0
_CACHE = {}

settings = {"global_batch": 32, "epochs": 1, "lr": 1e-3, "weight_decay": 0.05}


class ViT(nn.Module):
    def __init__(self):
        super().__init__()
        n_patches = (IMAGE // PATCH) ** 2
        self.patch_embed = nn.Conv2d(3, D_MODEL, kernel_size=PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D_MODEL))
        self.pos_embed = nn.Parameter(torch.randn(1, n_patches + 1, D_MODEL) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                D_MODEL,
                N_HEAD,
                dim_feedforward=4 * D_MODEL,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(N_LAYERS)
        )
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, NUM_CLASSES)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, 64, D)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def model():
    return ViT()


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(_SEED)
        x = torch.randn(N_SAMPLES, 3, IMAGE, IMAGE, generator=g)
        w = torch.randn(3 * 4 * 4, NUM_CLASSES, generator=g)
        y = (F.avg_pool2d(x, 8).flatten(1) @ w).argmax(dim=1)
        _CACHE["train"] = TensorDataset(x, y)
    return _CACHE["train"]
