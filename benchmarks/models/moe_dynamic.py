"""Benchmark family: mixture-of-experts with data-dependent shapes.

Architecture: inputs (B, 32, 64) float features -> Linear to width 128 ->
2 pre-LN residual MoE layers, each a router (Linear 128 -> 4) with top-1
routing over 4 expert MLPs (128 -> 512 -> 128, GELU) -> LayerNorm -> mean
pool over time -> Linear to 10 classes. About 1.1M parameters.

Quirk exercised: tokens are dispatched with boolean masks and
``torch.nonzero``: for expert e, ``idx = (choice == e).nonzero()``, the
expert runs on ``tokens[idx]`` (a tensor whose first dimension depends on
the data), and the output is scattered back with ``index_add``. So the
activation sizes per expert are unknown until the router has run, and a
fake-tensor / meta trace meets data-dependent (unbacked) sizes. In
expectation each expert sees B*32/4 tokens; the total over experts is
always B*32. The gate probability multiplies the expert output so the
router gets a gradient.

Data (synthetic, deterministic): 2048 sequences x ~ N(0, 1) of shape
(32, 64) float32; label (int64, 10 classes) = argmax of a fixed random
projection of the time-averaged features.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

IN_FEATURES = 64
SEQ_LEN = 32
D_MODEL = 128
N_EXPERTS = 4
N_LAYERS = 2
NUM_CLASSES = 10
N_SAMPLES = 2048
_SEED = 0
_CACHE = {}

settings = {"global_batch": 32, "epochs": 1, "lr": 1e-3}


class Top1MoE(nn.Module):
    def __init__(self, d, n_experts):
        super().__init__()
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            for _ in range(n_experts)
        )

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, d)
        probs = F.softmax(self.router(tokens), dim=-1)  # (N, E)
        gate, choice = probs.max(dim=-1)  # top-1
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            idx = torch.nonzero(choice == e, as_tuple=True)[0]  # data-dependent length
            y = expert(tokens[idx]) * gate[idx].unsqueeze(1)
            out = out.index_add(0, idx, y)
        return out.reshape(shape)


class MoEClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, D_MODEL)
        self.norms = nn.ModuleList(nn.LayerNorm(D_MODEL) for _ in range(N_LAYERS))
        self.moes = nn.ModuleList(Top1MoE(D_MODEL, N_EXPERTS) for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, NUM_CLASSES)

    def forward(self, x):
        h = self.inp(x)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(self.ln_f(h).mean(dim=1))


def model():
    return MoEClassifier()


def train_data():
    if "train" not in _CACHE:
        g = torch.Generator().manual_seed(_SEED)
        x = torch.randn(N_SAMPLES, SEQ_LEN, IN_FEATURES, generator=g)
        w = torch.randn(IN_FEATURES, NUM_CLASSES, generator=g)
        y = (x.mean(dim=1) @ w).argmax(dim=1)
        _CACHE["train"] = TensorDataset(x, y)
    return _CACHE["train"]
