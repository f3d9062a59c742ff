"""A plan must not change what is learned: with no global batch and no training length given,
``fit``, ``memplan fit`` and ``search`` all use the global batch 32 and 3 epochs, and search only
how the batch is reached (micro-batch x accumulation x ranks)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import memplan
from estimators import ConfigError, Task
from estimators.task._task import default_optimizer
from memplan.cli import main
from memplan.planning import DEFAULT_GLOBAL_BATCH
from memplan.planning._space import build_space, default_global_batch
from memplan.training import TrainOptions
from memplan.training._options import DEFAULT_EPOCHS

SEED = 0
MEMORY = "sqlite:///:memory:"  # a study of each search's own
NOTE = "global batch 32 (the default; set --global-batch or settings['global_batch'] to change it)"


def test_the_defaults_are_the_conventional_ones():
    assert DEFAULT_GLOBAL_BATCH == 32 and DEFAULT_EPOCHS == 3
    assert TrainOptions().training_length({}) == (3, None)
    # What is set anywhere wins, and then no default is added.
    assert TrainOptions(max_steps=5).training_length({}) == (None, 5)
    assert TrainOptions().training_length({"epochs": 2}) == (2, None)
    assert TrainOptions().training_length({"max_steps": 7}) == (None, 7)
    assert TrainOptions(epochs=1).with_length({"epochs": 9}).epochs == 1


def test_the_default_global_batch_fits_the_data_and_the_ranks():
    assert default_global_batch(None) == (32, NOTE)
    assert default_global_batch(1400) == (32, NOTE)
    value, note = default_global_batch(20)
    assert value == 20 and "clipped to the training set's 20 items" in note
    # Each rank takes an equal share: 32 where it divides, else the nearest multiple, said so.
    assert default_global_batch(None, 4) == (32, NOTE)
    value, note = default_global_batch(None, 3)
    assert value == 33 and "rounded to a multiple of the 3 processes" in note
    assert default_global_batch(None, 64)[0] == 64
    assert default_global_batch(31, 2)[0] == 30


def test_the_space_always_has_a_fixed_global_batch():
    space = build_space(dataset_size=1400, global_batch=32, precisions=("fp32",), max_segments=0)
    assert space.micro_batch_sizes == (1, 2, 4, 8, 16, 32)
    assert {c.global_batch for c in space} == {32}
    with pytest.raises(ConfigError, match="--global-batch must be a whole number"):
        build_space(dataset_size=1400, global_batch=None, precisions=("fp32",), max_segments=0)  # type: ignore[arg-type]


def _mlp_task(n: int = 200, settings: dict | None = None) -> Task:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    return Task.from_module(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), None, train_data=data,
                            settings=settings or {})


SMALL = {"vram": "1GB", "device": "cpu", "trials": 4, "probe_top": 0, "compile_top": 0, "storage": MEMORY,
         "precisions": ["fp32"], "checkpoint_segments": [0]}


def test_search_uses_the_default_and_says_so():
    plan = memplan.search(_mlp_task(), **SMALL)
    assert plan.global_batch == 32 and all(e.config.global_batch == 32 for e in plan.entries)
    assert NOTE in plan.notes and f"note: {NOTE}" in plan.table()
    # What the user fixes is kept, and no default is named.
    fixed = memplan.search(_mlp_task(settings={"global_batch": 40}), **SMALL)
    assert {e.config.global_batch for e in fixed.entries} == {40}
    assert not any("the default" in n for n in fixed.notes)
    # Over 3 ranks, 33: a share of 11 each.
    three = memplan.search(_mlp_task(), gpus=3, **SMALL)
    assert {e.config.global_batch for e in three.entries} == {33}
    assert any("global batch 33 (the default 32, rounded to a multiple of the 3 processes" in n for n in three.notes)


CLI_MODEL = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(80, 8, generator=g), torch.randint(0, 3, (80,), generator=g))
"""


def test_the_command_line_uses_the_same_defaults(write_model, tmp_path, capsys):
    path = write_model(CLI_MODEL)
    out_dir = tmp_path / "run"
    code = main(["fit", path, "--vram", "1GB", "--device", "cpu", "--trials", "4", "--probe-top", "0",
                 "--precision", "fp32", "--checkpoint", "0",
                 "--compile-top", "0", "--out", str(out_dir), "--no-progress", "--storage", MEMORY])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"note: {NOTE}" in out
    plan = json.loads((out_dir / "plan.json").read_text())
    assert plan["global_batch"] == 32
    # 80 items in windows of 32: 3 optimizer steps an epoch, 3 epochs.
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["steps"] == 3 * math.ceil(80 / 32)


def _digits() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as load_digits returns them (64 pixels of 0..16), as tensors:
    1,400 items to train on, the other 397 to validate."""
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SEED))
    train, val = order[:1400], order[1400:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _plain_loop(train: TensorDataset, val: TensorDataset) -> float:
    """The same network in a plain PyTorch loop with memplan's defaults: memplan's default
    optimizer (AdamW, lr 1e-3, weight decay 0.01 on the matrices), batches of 32 shuffled
    every epoch, 3 epochs, the same seed; no schedule, no clipping."""
    torch.manual_seed(SEED)
    net = _net()
    optimizer = default_optimizer(net.parameters())
    x, y = train.tensors
    g = torch.Generator().manual_seed(SEED)
    for _ in range(3):
        for idx in torch.randperm(len(y), generator=g).split(32):
            loss = F.cross_entropy(net(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    vx, vy = val.tensors
    with torch.no_grad():
        return float((net(vx).argmax(1) == vy).float().mean())


def test_fit_with_no_settings_learns_what_a_plain_loop_learns(tmp_path):
    # Before: no global batch fixed, the search grew the batch to 1,024 of the 1,400 items,
    # trained 2 optimizer steps and ended at 13% validation accuracy.
    train, val = _digits()
    torch.manual_seed(SEED)
    plan, result = memplan.fit(_net(), vram="1GB", device="cpu", train_data=train, val_data=val,
                               sample=train[:2], trials=6, probe_top=0, compile_top=0, storage=MEMORY,
                               # A small search (fp32, no checkpointing): it chooses how the batch
                               # of 32 is reached, micro-batch x accumulation.
                               precisions=["fp32"], checkpoint_segments=[0],
                               out_dir=str(tmp_path / "run"), progress=False)
    assert result is not None
    assert plan.config.global_batch == 32 and NOTE in plan.notes
    assert result.steps == 3 * math.ceil(1400 / 32)  # 3 epochs of 44 optimizer steps
    accuracy = result.final_metrics["val_accuracy"]
    plain = _plain_loop(train, val)
    assert plain >= 0.9, plain
    assert accuracy >= 0.9, (accuracy, plan.config.describe())
    assert accuracy >= plain - 0.05, (accuracy, plain)


def test_a_given_global_batch_still_wins():
    plan = memplan.search(_mlp_task(), global_batch=8, **SMALL)
    assert plan.global_batch == 8 and {e.config.global_batch for e in plan.entries} == {8}
    assert not any("the default" in n for n in plan.notes)
