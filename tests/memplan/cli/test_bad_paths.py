"""Bad places to write and bad storage URLs are one line and exit code 2, found before the
search estimates anything (each of these was a traceback, some only after the search)."""

from __future__ import annotations

from pathlib import Path

import pytest

from estimators import Estimator
from memplan import Plan
from memplan.cli import main

MODEL = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
"""


@pytest.fixture
def no_estimates(monkeypatch):
    def refuse(self, config, **kwargs):
        raise AssertionError("the bad input should have been refused before any estimate")
    monkeypatch.setattr(Estimator, "estimate", refuse)


def _one_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("memplan: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("case, expected", [
    ("plan --vram 1", "leaves nothing once the 10% margin is kept"),
    ("plan --storage bogus://x", "is not a database URL"),
    ("plan --storage notaurl", "is not a database URL"),
    ("plan --storage sqlite:///{tmp}/missing/dir/x.db", "does not exist; create it"),
    ("plan --out {tmp}", "is a folder; give a file name"),
    ("plan --out {tmp}/afile/plan.json", "is a file, not a folder"),
    ("plan --plot {tmp}/afile/plan.png", "is a file, not a folder"),
    ("plan --config {tmp}", "is a folder; give the TOML file"),
    ("plan --config {tmp}/latin1.toml", "is not UTF-8 text"),
    ("fit --out {tmp}/afile", "is a file; give a folder"),
    ("fit --out {tmp}/afile/run", "is a file, not a folder"),
    ("fit --out /proc/memplan-run", "cannot write in /proc"),
    ("train --plan {tmp}/plan.json --out {tmp}/afile", "is a file; give a folder"),
    ("estimate -b 2 --snapshot {tmp}", "is a folder; give a file name"),
])
def test_refused_in_one_line_before_any_estimate(write_model, tmp_path, capsys, no_estimates, case, expected):
    path = write_model(MODEL)
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "latin1.toml").write_bytes("trials = 4 # caf\xe9\n".encode("latin-1"))
    command, *rest = case.format(tmp=tmp_path).split()
    if command != "train":
        rest = ["--vram", "1GB", *rest] if command != "estimate" and "--vram" not in rest else rest
    err = _one_line(capsys, [command, path, *rest])
    assert expected in err, err


def test_a_plan_saved_to_a_folder_is_refused_and_leaves_no_temporary_file(tmp_path):
    from estimators import ConfigError, Estimate, TrainConfig
    from memplan import PlanEntry

    c = TrainConfig(micro_batch_size=8)
    est = Estimate(config=c, device="cpu", gpu=None, peak_allocated_bytes=10**6, peak_reserved_bytes=None,
                   breakdown={}, peak_phase="backward", context_bytes=0, workspace_bytes=0, method="static",
                   modelled=False, params=0, trainable_params=0, samples_per_s=1.0)
    plan = Plan(entries=(PlanEntry(config=c, predicted=est),), budget_bytes=10**9, margin=0.1, device="cpu",
                gpu=None, global_batch=8, trials=1)
    with pytest.raises(ConfigError, match="is a folder"):
        plan.save(tmp_path)
    assert list(Path(tmp_path.parent).glob(f"{tmp_path.name}.tmp")) == []
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_under_the_log_is_one_line(write_model, tmp_path, capsys):
    # /dev/full: every write fails as on a full disk (ENOSPC, from the kernel).
    path = write_model(MODEL)
    err = _one_line(capsys, ["fit", path, "--vram", "1GB", "--global-batch", "8", "--trials", "2", "--probe-top", "0",
                             "--compile-top", "0", "--max-steps", "2", "--no-progress", "--out", str(tmp_path / "run"),
                             "--metrics-path", "/dev/full"])
    assert "could not write /dev/full: no space left on its disk" in err and "--resume" in err


def test_a_checkpoint_that_does_not_fit_is_one_line_and_leaves_no_partial_file(write_model, tmp_path):
    # A real failed write of checkpoint.pt: the process may write files of 10 kB at most (the
    # kernel refuses the rest with EFBIG, as a full disk refuses with ENOSPC).
    import subprocess
    import sys

    path = write_model(MODEL.replace("nn.Linear(16, 3)", "nn.Linear(16, 3), nn.Linear(3, 3)"))
    out = tmp_path / "run"
    script = (
        "import resource, signal, sys\n"
        "from memplan.cli import main\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))\n"
        f"sys.exit(main(['train', {path!r}, '--plan', {str(tmp_path / 'plan.json')!r}, '--out', {str(out)!r},"
        " '--max-steps', '2', '--no-progress']))\n"
    )
    # A space of two (an enumerated space's plan lists every feasible configuration: a larger
    # one's plan.json alone would pass the 10 kB limit before the checkpoint is written).
    assert main(["plan", path, "--vram", "1GB", "--global-batch", "8", "--trials", "2", "--probe-top", "0",
                 "--compile-top", "0", "--precision", "fp32", "--checkpoint", "0", "--micro-batch", "4,8",
                 "--out", str(tmp_path / "plan.json")]) == 0
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("memplan: could not write ") and "checkpoint.pt" in last, done.stderr
    assert "larger than this process may write" in last and "Traceback" not in done.stderr
    assert not list(out.glob(".checkpoint.pt.*.tmp"))  # no half-written file left behind
