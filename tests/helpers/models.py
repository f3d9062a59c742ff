"""Small models the tests share: a tiny GPT-shaped LM, a CNN with batch norm, a teacher MLP,
and a model file whose blocks sleep (a checkpointed configuration is then surely slower)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from estimators import Task

__all__ = ["Block", "TinyLM", "lm_task", "cnn_task", "rel_error", "SLEEPY", "teacher_task"]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """Tied embeddings and a ModuleList of blocks: the shape of a GPT."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def lm_task() -> Task:
    def sample(b: int):
        g = torch.Generator().manual_seed(b)
        x = torch.randint(0, 64, (b, 16), generator=g)
        return x, torch.roll(x, -1, dims=1)  # token ids < 64 fit any vocab >= 64
    return Task(name="tinylm", build_model=lambda: TinyLM(), sample_fn=sample)


def cnn_task() -> Task:
    def build() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
        )
    return Task(name="cnn", build_model=build,
                sample_fn=lambda b: (torch.randn(b, 3, 16, 16), torch.randint(0, 10, (b,))))


def rel_error(pred: int, ref: int) -> float:
    return abs(pred - ref) / ref

# Each block's forward sleeps: a checkpointed block runs it twice per step (forward, then
# again in the backward), so the checkpointed configuration is slower whatever the machine's
# load — sleeping does not compete for the cores. The sleeps are long (50 ms) so that a step's
# compute, which a loaded machine (a parallel test run) stretches, stays a small part of it.
SLEEPY = """
import time
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
    def forward(self, x):
        time.sleep(0.05)
        return x + self.fc(x)

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
"""


_TASKS: list[Task] = []  # estimators cache datasets by id(task): keep every task alive


def teacher_task() -> Task:
    """An MLP with batch norm learning a random linear teacher's argmax (1024 samples)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                             nn.Linear(64, 4))

    task = Task(name="teacher", build_model=build, train_data=lambda: TensorDataset(x, y),
                build_optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3))
    _TASKS.append(task)
    return task
