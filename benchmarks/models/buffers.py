"""Benchmark family: a model whose registered buffers outweigh its parameters.

Architecture: a small sequence classifier. Inputs (B, 64, 32) float features
-> Linear to width 128 + a fixed sinusoidal positional-encoding table, one
pre-LN self-attention block (attention masked by a stored causal mask) with
a GELU MLP, mean pool over time, feature normalisation by running statistics,
then a head that sees the pooled feature and its similarity to a memory bank
of past features (MoCo-style queue). About 0.14M parameters (0.53 MB)
against 5.5 MB of buffers.

Buffers (their values do not matter for memory, only shapes and dtypes):
  * ``pos_table``   (1024, 128) float32, persistent: sinusoidal table, sliced
                    to the sequence length in forward.
  * ``causal_mask`` (1024, 1024) bool, ``persistent=False`` (not in the
                    state_dict but still moved with the module), sliced to
                    (T, T) and OR-ed with the diagonal so no row is fully
                    masked even if the buffer holds garbage after
                    ``to_empty()``.
  * ``running_mean``/``running_var`` (128,) float32 and ``num_batches``
                    () int64: updated in forward under ``torch.no_grad()``
                    in training mode (in place, like BatchNorm).
  * ``bank`` (8192, 128) float32 and ``bank_ptr`` () int64: a FIFO queue
                    of detached pooled features, written in place with
                    ``index_copy_`` under ``torch.no_grad()`` every training
                    forward (no ``.item()``: the pointer stays a tensor).

Data (synthetic, deterministic): 2048 sequences x ~ N(0, 1) of shape
(64, 32) float32; label (int64, 10 classes) = argmax of a fixed random
projection of the time-averaged features.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

IN_FEATURES = 32
SEQ_LEN = 64
D_MODEL = 128
N_HEAD = 4
MAX_LEN = 1024
BANK_SIZE = 8192
NUM_CLASSES = 10
N_SAMPLES = 2048
_SEED = 0
_CACHE = {}

settings = {"global_batch": 32, "epochs": 1, "lr": 1e-3}


def _sinusoidal_table(max_len, d):
    pos = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    table = torch.zeros(max_len, d)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)
    return table


class BufferHeavyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_head = N_HEAD
        self.inp = nn.Linear(IN_FEATURES, D_MODEL)
        self.register_buffer("pos_table", _sinusoidal_table(MAX_LEN, D_MODEL))
        self.register_buffer(
            "causal_mask",
            torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool).tril(),  # True = may attend
            persistent=False,
        )
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(
            nn.Linear(D_MODEL, 2 * D_MODEL), nn.GELU(), nn.Linear(2 * D_MODEL, D_MODEL)
        )
        self.register_buffer("running_mean", torch.zeros(D_MODEL))
        self.register_buffer("running_var", torch.ones(D_MODEL))
        self.register_buffer("num_batches", torch.zeros((), dtype=torch.long))
        self.register_buffer("bank", torch.randn(BANK_SIZE, D_MODEL))
        self.register_buffer("bank_ptr", torch.zeros((), dtype=torch.long))
        self.momentum = 0.1
        self.head = nn.Linear(D_MODEL + 1, NUM_CLASSES)

    def _attention(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        shape = (B, T, self.n_head, C // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        eye = torch.eye(T, dtype=torch.bool, device=x.device)
        mask = self.causal_mask[:T, :T] | eye
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x):
        T = x.shape[1]
        h = self.inp(x) + self.pos_table[:T]
        h = h + self._attention(self.ln1(h))
        h = h + self.mlp(self.ln2(h))
        feat = h.mean(dim=1)  # (B, D)
        if self.training:
            with torch.no_grad():
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(feat.mean(0), alpha=m)
                self.running_var.mul_(1 - m).add_(feat.var(0, unbiased=False), alpha=m)
                self.num_batches.add_(1)
        feat = (feat - self.running_mean) * torch.rsqrt(self.running_var.abs() + 1e-5)
        unit = F.normalize(feat, dim=1)
        bank_sim = (unit @ F.normalize(self.bank, dim=1).t()).amax(dim=1, keepdim=True)
        if self.training:
            with torch.no_grad():
                B = unit.shape[0]
                idx = (self.bank_ptr + torch.arange(B, device=unit.device)) % BANK_SIZE
                self.bank.index_copy_(0, idx, unit.detach())
                self.bank_ptr.add_(B).remainder_(BANK_SIZE)
        return self.head(torch.cat([feat, bank_sim], dim=1))


def model():
    return BufferHeavyModel()


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(_SEED)
        x = torch.randn(N_SAMPLES, SEQ_LEN, IN_FEATURES, generator=g)
        w = torch.randn(IN_FEATURES, NUM_CLASSES, generator=g)
        y = (x.mean(dim=1) @ w).argmax(dim=1)
        _CACHE["train"] = TensorDataset(x, y)
    return _CACHE["train"]
