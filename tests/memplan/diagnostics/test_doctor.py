"""memplan doctor: flags the broken models the checks exist for, passes sound ones."""

from __future__ import annotations

import json

import pytest

from memplan.diagnostics._doctor import doctor, loader_finding
from memplan.diagnostics._problems import PROBLEMS
from memplan.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

settings = {"lr": 3e-3, "global_batch": 32}

def train_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = x[:, :4].argmax(dim=1)          # the label is a function of the input
    SHUFFLE
    return TensorDataset(x, y)
"""

MLP = """
def model():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
"""

DEAD_BRANCH = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.aux = nn.Linear(16, 4)      # built, never used in forward
    def forward(self, x):
        return self.body(x)

def model():
    return Net()
"""

EXPLODING = """
def model():
    layers = []
    for _ in range(6):
        lin = nn.Linear(16, 16)
        nn.init.normal_(lin.weight, std=3.0)
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 4))
"""

NAN_OUTPUT = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)
    def forward(self, x):
        return torch.log(self.lin(x) - 100.0)   # log of negative numbers

def model():
    return Net()
"""


def _file(write_model, body: str, shuffle: bool = False) -> str:
    shuffle_line = "y = y[torch.randperm(len(y), generator=g)]" if shuffle else "pass"
    return write_model(DATA.replace("SHUFFLE", shuffle_line) + body)


def _problems(report) -> set[str]:
    return {f.problem for f in report.findings if f.severity in ("error", "warning")}


def test_a_sound_model_is_healthy(write_model):
    report = doctor(_file(write_model, MLP), steps=60)
    assert report.healthy, report.text()
    assert report.stats["overfit_final_loss"] < 0.1 * report.stats["overfit_losses"][0]


def test_dead_branch(write_model):
    report = doctor(_file(write_model, DEAD_BRANCH), steps=60)
    assert not report.healthy
    dead = [f for f in report.findings if f.problem == "dead_params"]
    assert dead and "aux.weight" in dead[0].detail and "aux.bias" in dead[0].detail
    assert "body" not in dead[0].detail


def test_exploding_gradients(write_model):
    report = doctor(_file(write_model, EXPLODING), steps=20)
    assert "exploding_grad" in _problems(report), report.text()
    assert "init_scale" in _problems(report)


def test_nan_outputs_name_the_module(write_model):
    report = doctor(_file(write_model, NAN_OUTPUT), steps=20)
    nan = [f for f in report.findings if f.problem == "nan_output"]
    assert nan and nan[0].severity == "error", report.text()
    assert "''" in nan[0].detail or "Net" in nan[0].detail  # the root module, where log() runs


def test_shuffled_labels_have_no_signal(write_model):
    report = doctor(_file(write_model, MLP, shuffle=True), steps=60)
    assert "no_signal" in _problems(report), report.text()
    # One batch can still be memorised: the overfit check alone cannot see this bug.
    assert "no_overfit" not in _problems(report)


def test_loader_rule():
    assert loader_finding(0.02, 0.01).severity == "warning"
    assert loader_finding(0.001, 0.01) is None
    assert loader_finding(0.005, 0.001).severity == "info"  # a tiny model: the loader's fixed cost


def test_every_problem_has_cause_and_fix():
    for key, p in PROBLEMS.items():
        assert p.title and p.cause and p.fix, key


def test_cli_exit_codes_and_json(write_model, tmp_path, capsys):
    bad = _file(write_model, DEAD_BRANCH)
    code = main(["doctor", bad, "--steps", "40", "--json", "--out", str(tmp_path)])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and not data["healthy"]
    assert any(f["problem"] == "dead_params" and f["fix"] for f in data["findings"])
    assert json.loads((tmp_path / "doctor.json").read_text())["healthy"] is False
    code = main(["doctor", bad, "--checks", "init,data,outputs"])
    assert code == 0 and "healthy" in capsys.readouterr().out
    assert main(["doctor", bad, "--checks", "bogus"]) == 2


@pytest.mark.slow
def test_the_digits_example_is_healthy(capsys):
    assert main(["doctor", "examples/digits.py"]) == 0, capsys.readouterr().out
