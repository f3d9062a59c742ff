"""Large transformer tasks for planning benchmarks: built on the meta device, never allocated.

``llama_task(size)`` gives a Llama-style decoder (RMSNorm, rotary-free attention through
``scaled_dot_product_attention``, SwiGLU MLP, untied head) of about 1B or 7B parameters; the
training data is a handful of real token sequences (tracing needs real batches' shapes only).

``llama3_task(name, seq)`` gives a decoder with the dimensions of a released Llama 3 model
(``LLAMA3``: 3.2-1B, 3.2-3B, 3-8B): rotary positions, grouped-query attention, SwiGLU MLP,
and the embeddings tied to the head where the real model ties them, so that its parameter
count is the real model's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from estimators import Task

__all__ = ["LLAMA3", "SIZES", "llama3_task", "llama_task"]

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


# -- Llama 3 dimensions (from each model's published config.json) ---------------------------

# name: (layers, width, heads, kv heads, mlp hidden, vocab, tied embeddings, rope theta, parameters)
LLAMA3 = {
    "1b": (16, 2048, 32, 8, 8192, 128256, True, 500000.0, "1.24B"),   # Llama 3.2-1B
    "3b": (28, 3072, 24, 8, 8192, 128256, True, 500000.0, "3.21B"),   # Llama 3.2-3B
    "8b": (32, 4096, 32, 8, 14336, 128256, False, 500000.0, "8.03B"),  # Llama 3-8B
    "70b": (80, 8192, 64, 8, 28672, 128256, False, 500000.0, "70.6B"),  # Llama 3.1-70B
    "405b": (126, 16384, 128, 8, 53248, 128256, False, 500000.0, "406B"),  # Llama 3.1-405B
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: int) -> torch.Tensor:
    """Rotary positions on q and k, k and v repeated for each group of query heads, causal
    attention: ``(b, heads, t, head_dim)``."""
    t = q.shape[2]
    cos, sin = cos[:t], sin[:t]
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class GQABlock(nn.Module):
    """One Llama 3 decoder layer: rotary positions on q and k, ``kv_heads`` key/value heads
    shared by groups of query heads (repeated before attention, as Hugging Face's and
    torchtitan's Llama do), SwiGLU MLP."""

    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.q = nn.Linear(width, heads * self.head_dim, bias=False)
        self.k = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, width, bias=False)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        y = _rotary_gqa(q, k, v, cos, sin, self.heads // self.kv_heads)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Attention(nn.Module):
    """torchtitan's Llama 3 attention (``wq``/``wk``/``wv``/``wo``), the same math as GQABlock's."""

    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.wq = nn.Linear(width, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = _rotary_gqa(q, k, v, cos, sin, self.n_heads // self.n_kv_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    """torchtitan's ``TransformerBlock``: attention and feed-forward as modules of their own,
    which tensor and sequence parallelism split at (GQABlock holds its linears itself)."""

    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(width), RMSNorm(width)
        self.attention = Attention(width, heads, kv_heads)
        self.feed_forward = FeedForward(width, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama3(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, kv_heads: int, hidden: int, vocab: int,
                 tied: bool, theta: float, context: int, block: type[nn.Module] = GQABlock) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(block(width, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        head_dim = width // heads
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(context, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        # Not saved with the weights (recomputed from the dimensions), as in the real models.
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))


def llama3_task(name: str = "1b", seq: int = 2048, *, samples: int = 64, torchtitan: bool = False) -> Task:
    """A Llama 3 model of ``LLAMA3[name]``'s dimensions trained on ``samples`` sequences of
    ``seq`` tokens (the rotary tables cover ``seq``); ``torchtitan``: its blocks laid out as
    torchtitan's (attention and feed-forward modules)."""
    block = TitanBlock if torchtitan else GQABlock
    layers, width, heads, kv_heads, hidden, vocab, tied, theta, _ = LLAMA3[name]

    def train_data() -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (samples, seq + 1), generator=g)
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    return Task(name=f"llama3_{name}_s{seq}",
                build_model=lambda: Llama3(layers, width, heads, kv_heads, hidden, vocab, tied, theta, seq, block),
                train_data=train_data, checkpoint_blocks=lambda m: list(m.layers))
