"""lr-find: the range test's suggestion lands near a learning rate known to be good."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from estimators import ConfigError, load_task
from memplan.diagnostics._lr_find import _smooth, lr_find, suggest
from memplan.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

MLP = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

settings = {"global_batch": 32}

def train_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    return TensorDataset(x, x[:, :4].argmax(dim=1))

def model():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
"""

SGD = MLP + """
def optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)
"""


def _best_constant_lr(task, steps: int = 150, b: int = 32) -> float:
    """The known good learning rate: the grid's lowest final training loss."""
    data = task.dataset()
    n = len(data)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    final = {}
    for k in range(-16, 1):
        lr = 10 ** (k / 4)
        torch.manual_seed(0)
        net = task.build_model()
        opt = task.make_optimizer(net)
        for g in opt.param_groups:
            g["lr"] = lr
        losses = []
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = task.compute_loss(net, task.collate([data[order[(s * b + i) % n]] for i in range(b)]))
            if not torch.isfinite(loss):
                losses = [math.inf]
                break
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        final[lr] = float(np.mean(losses[-20:]))
    return min(final, key=final.get)


@pytest.mark.parametrize("source", [MLP, SGD], ids=["adamw", "sgd-momentum"])
def test_suggestion_within_a_factor_of_3_of_the_best_constant_lr(write_model, source):
    task = load_task(write_model(source))
    best = _best_constant_lr(task)
    result = lr_find(task, batch_size=32)
    assert best / 3 <= result.suggestion <= best * 3, (best, result.suggestion)
    assert result.rule.startswith("min/10")
    assert result.diverged  # the sweep ran until the loss blew up, and stopped there
    assert len(result.lrs) < 100 and result.lrs[-1] < 10


def test_smoothing_is_bias_corrected_and_rules_read_the_curve():
    assert _smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    lrs = list(np.logspace(-5, 0, 51))
    # A loss that falls fastest at 1e-3 and is lowest at 1e-1.
    x = np.log10(lrs)
    curve = list(2 - np.tanh((x + 3) * 2) + np.where(x > -1, (x + 1) * 10, 0))
    lowest = lrs[int(np.argmin(curve))]
    lr, why = suggest(lrs, curve, "min/10")
    assert lr == pytest.approx(lowest / 10) and "min/10" in why
    lr, why = suggest(lrs, curve, "steepest")
    assert lr == pytest.approx(1e-3, rel=0.3) and "steepest" in why
    with pytest.raises(ConfigError):
        suggest(lrs[:3], curve[:3])


def test_cli_json_and_plot(write_model, tmp_path, capsys):
    path = write_model(MLP)
    plot = tmp_path / "lr.png"
    code = main(["lr-find", path, "--plot", str(plot), "--json", "--steps", "60"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["suggestion"] > 0 and len(data["lrs"]) == len(data["losses"]) == len(data["smoothed"])
    with open(plot, "rb") as f:
        assert f.read(4) == b"\x89PNG"
    assert main(["lr-find", path, "--start-lr", "1", "--end-lr", "0.1"]) == 2


def test_fit_lr_auto_trains_with_the_suggestion(write_model, tmp_path, capsys):
    path = write_model(MLP)
    out = tmp_path / "run"
    code = main(["fit", path, "--vram", "1GB", "--probe-top", "0", "--max-steps", "3", "--lr", "auto",
                 "--out", str(out), "--no-progress", "--storage", f"sqlite:///{tmp_path}/s.db"])
    text = capsys.readouterr().out
    assert code == 0, text
    line = next(ln for ln in text.splitlines() if ln.startswith("--lr auto:"))
    suggested = float(line.split()[2])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["options"]["lr"] == pytest.approx(suggested, rel=1e-2)
