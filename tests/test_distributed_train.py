"""Distributed training on CPU: 2 gloo processes launched in-process, as ``memplan train --nproc 2``
does. DDP and FSDP2 runs match a single-process run with the same global batch step by step;
FSDP2 checkpoints resume at another world size; an OOM on one rank only is recovered by every
rank; any other failure on one rank stops the run with a one-line error, no hang."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from estimators import TrainConfig, TrainingError, load_task
from memplan._checkpoint_io import SHARDED_DIR, load_checkpoint
from memplan._launch import LaunchSpec, launch_training
from memplan._trainer import TrainOptions, Trainer, epoch_items, epoch_permutation, train

pytestmark = pytest.mark.distributed

# A model with a block stack (FSDP2 shards each block), no dropout (so that runs can match
# exactly), validation data that does not split evenly over 2 ranks (9 items: 5 and 4), and
# failures on cue from environment variables the ranks inherit:
#   OOM_RANK/OOM_ABOVE: that rank runs out of memory inside the second block's forward (after
#     FSDP2 has all-gathered the first: the other rank is left mid-collective) whenever the
#     micro-batch is larger than OOM_ABOVE;
#   FAIL_RANK/FAIL_AT_CALL: that rank's forward raises ValueError at that call.
MODEL = '''
import os
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

settings = {"lr": 0.05}

_calls = [0]

class Block(nn.Module):
    def __init__(self, width, index):
        super().__init__()
        self.index = index
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        limit = os.environ.get("OOM_ABOVE")
        if (self.index == 1 and limit and os.environ.get("RANK") == os.environ.get("OOM_RANK")
                and x.shape[0] > int(limit)):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        return torch.tanh(self.fc(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList([Block(16, i) for i in range(3)])
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        _calls[0] += 1
        if os.environ.get("RANK") == os.environ.get("FAIL_RANK") and _calls[0] == int(os.environ.get("FAIL_AT_CALL", "0")):
            raise ValueError("the model fell over (injected by the test)")
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)

def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] - x[:, 2] > 0).long())

def model():
    return Net()

def train_data():
    return _data(48, 1)

def val_data():
    return _data(9, 2)

'''

FAST = LaunchSpec(nproc_per_node=2, start_method="fork")
"""``fork``: the ranks inherit this process's imports (seconds each on a shared 2-core machine);
one test launches with ``spawn``, the default, to cover the path ``memplan train`` takes."""


@pytest.fixture(autouse=True, scope="module")
def warm_imports() -> Any:
    # Imported once here, inherited by the forked ranks (DDP and FSDP2 import torch._dynamo).
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP pool in this process: forking it stays safe
    yield
    torch.set_num_threads(threads)


def opts(out: Path, **kw: Any) -> TrainOptions:
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 0)
    kw.setdefault("schedule", "constant")
    kw.setdefault("eval_every", 3)
    return TrainOptions(out_dir=out, **kw)


def records(out_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == kind]


def losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in records(out_dir, "step")]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=k)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, micro-batch 8: global batch 8, 6 steps (one epoch)."""
    root = tmp_path_factory.mktemp("reference")
    path = root / "model.py"
    path.write_text(MODEL)
    out = root / "single"
    train(load_task(path), TrainConfig(micro_batch_size=8), opts(out, epochs=1))
    return {"losses": losses(out), "evals": records(out, "eval"), "weights": load_checkpoint(out / "model.pt"),
            "out": out}


def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return path


def test_rank_shares_are_distributed_sampler_order() -> None:
    from torch.utils.data import DistributedSampler

    n, seed, world, epoch = 23, 5, 2, 3
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        perm = epoch_permutation(n, seed, epoch)[:epoch_items(n, world)].tolist()
        assert list(sampler) == perm[rank::world]


@pytest.mark.timeout(90)
def test_ddp_matches_single_process_with_the_same_global_batch(reference: dict[str, Any], tmp_path: Path) -> None:
    path = model_file(tmp_path)
    out = tmp_path / "ddp"
    t0 = time.perf_counter()
    # micro 2 x accumulation 2 x 2 ranks = 8: accumulation skips the sync of the first micro-batch.
    config = TrainConfig(micro_batch_size=2, grad_accum_steps=2, strategy="ddp", world_size=2)
    result = launch_training(path, config, opts(out, epochs=1), spec=LaunchSpec(nproc_per_node=2))  # spawn
    seconds = time.perf_counter() - t0
    assert result is not None and result.steps == 6
    got, want = losses(out), reference["losses"]
    print(f"ddp x2 in {seconds:.1f} s; losses {got}; single {want}")
    assert len(got) == 6 and got == pytest.approx(want, rel=1e-5, abs=1e-6)
    evals = records(out, "eval")
    assert [e["val_loss"] for e in evals] == pytest.approx([e["val_loss"] for e in reference["evals"]], rel=1e-5)
    assert [e["val_accuracy"] for e in evals] == [e["val_accuracy"] for e in reference["evals"]]
    assert_same_weights(load_checkpoint(out / "model.pt"), reference["weights"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["samples_seen"] == 48
