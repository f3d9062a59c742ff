"""Large transformer tasks for planning benchmarks: built on the meta device, never allocated.

``llama_task(size)`` gives a Llama-style decoder (RMSNorm, rotary-free attention through
``scaled_dot_product_attention``, SwiGLU MLP, untied head) of about 1B or 7B parameters; the
training data is a handful of real token sequences (tracing needs real batches' shapes only).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from estimators import Task

__all__ = ["SIZES", "llama_task"]

# name: (layers, width, heads, mlp hidden, vocab, context)
SIZES = {
    "1b": (16, 2048, 16, 5632, 32000, 2048),   # ~1.1B parameters
    "7b": (32, 4096, 32, 11008, 32000, 2048),  # ~6.7B parameters (Llama-2-7B's shapes)
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def llama_task(size: str = "7b") -> Task:
    layers, width, heads, hidden, vocab, context = SIZES[size]

    def train_data() -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(0, vocab, (64, context + 1), generator=g)
        return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())

    return Task(name=f"llama_{size}", build_model=lambda: Llama(layers, width, heads, hidden, vocab),
                train_data=train_data, checkpoint_blocks=lambda m: list(m.layers))
