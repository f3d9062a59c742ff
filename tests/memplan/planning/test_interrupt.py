"""Ctrl-C during a search stops the command: no plan is made, saved or trained from a part of
the study, the study keeps its trials, and running the command again continues it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from estimators import Estimator
from memplan import SearchInterrupted, fit
from memplan.cli import main

MODEL = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
"""


@pytest.fixture
def interrupt_at_the_fifth_estimate(monkeypatch):
    """Ctrl-C as it lands in the main thread during the fifth estimate: a KeyboardInterrupt."""
    real = Estimator.estimate
    calls: list[object] = []

    def estimate(self, config, **kwargs):
        calls.append(config)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(self, config, **kwargs)

    monkeypatch.setattr(Estimator, "estimate", estimate)
    return calls


def test_fit_interrupted_in_its_search_exits_130_and_trains_nothing(write_model, tmp_path, capsys,
                                                                     interrupt_at_the_fifth_estimate):
    path = write_model(MODEL)
    out = tmp_path / "run"
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    code = main(["fit", path, "--vram", "1GB", "--global-batch", "16", "--probe-top", "0", "--compile-top", "0",
                 "--storage", storage, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 130
    assert err.count("\n") == 1 and "search interrupted after 4 trials" in err and "run the same command again" in err
    # Nothing trained, and no plan for --resume to pick up.
    assert not (out / "plan.json").exists() and not (out / "model.pt").exists()
    assert not (out / "checkpoint.pt").exists()
    assert optuna.get_all_study_summaries(storage)[0].n_trials == 4


def test_fit_from_python_raises_it_before_training(write_model, tmp_path, interrupt_at_the_fifth_estimate):
    path = write_model(MODEL)
    with pytest.raises(SearchInterrupted) as exc:
        fit(path, vram="1GB", device="cpu", global_batch=16, probe_top=0, compile_top=0,
            storage=f"sqlite:///{tmp_path / 'study.db'}", out_dir=tmp_path / "run", progress=False)
    assert exc.value.trials == 4 and isinstance(exc.value, KeyboardInterrupt)
    assert not (tmp_path / "run" / "model.pt").exists()


def test_a_real_sigint_during_the_search_stops_the_command(write_model, tmp_path):
    # The real signal, in a real process, while the study runs (every estimate sleeps, so that
    # the search is still going when the signal comes).
    path = write_model(MODEL)
    slow = tmp_path / "slow_search.py"
    slow.write_text(
        "import sys, time\n"
        "from estimators import Estimator\n"
        "real = Estimator.estimate\n"
        "def estimate(self, config, **kwargs):\n"
        "    print('estimating', flush=True)\n"
        "    time.sleep(0.5)\n"
        "    return real(self, config, **kwargs)\n"
        "Estimator.estimate = estimate\n"
        "from memplan.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "run"
    env = {**os.environ, "MEMPLAN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = subprocess.Popen(
        [sys.executable, str(slow), "fit", path, "--vram", "1GB", "--global-batch", "16", "--probe-top", "0",
         "--compile-top", "0", "--out", str(out), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        seen = 0
        deadline = time.monotonic() + 120
        while seen < 2 and time.monotonic() < deadline:
            if proc.stdout.readline().startswith("estimating"):
                seen += 1
        assert seen == 2, "the search never started"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "search interrupted after" in err and "run the same command again" in err
    assert not (out / "plan.json").exists() and not (out / "model.pt").exists()
