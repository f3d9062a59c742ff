"""A run's output folder is one run's: a second run into it while the first lives is refused, a
fresh run never replaces another run's results unless told to (``--overwrite``), and
``--resume`` needs something to resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from estimators import ConfigError, Task, TrainConfig
from memplan.cli import main
from memplan.training import TrainOptions, train
from memplan.training._out_dir import LOCK_NAME, claim_out_dir

MODEL = """
import time
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

settings = {"global_batch": 8, "lr": 0.01}

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))

def loss(model, batch):
    x, y = batch
    if {slow} and not isinstance(x, torch._subclasses.FakeTensor):
        time.sleep(0.03)  # a real step takes a while: the run is still going when the other starts
    return torch.nn.functional.cross_entropy(model(x), y)
"""

FIT = ["--vram", "1GB", "--trials", "4", "--probe-top", "0", "--compile-top", "0", "--no-progress"]


def _task() -> Task:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    return Task(name="tiny", build_model=lambda: torch.nn.Linear(4, 2), train_data=lambda: TensorDataset(x, y),
                settings={"lr": 0.05})


def _options(out: Path, **kw: object) -> TrainOptions:
    return TrainOptions(**{"out_dir": out, "max_steps": 3, "progress": False, **kw})  # type: ignore[arg-type]


def test_a_fresh_run_refuses_another_runs_results_and_overwrite_replaces_them(tmp_path):
    out = tmp_path / "run"
    config = TrainConfig(micro_batch_size=8)
    train(_task(), config, _options(out))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK_NAME}
    assert {"model.pt", "checkpoint.pt", "metrics.jsonl", "summary.json"} <= set(before)

    with pytest.raises(ConfigError, match=r"holds another run's results \(checkpoint\.pt.*resume=True.*overwrite=True"):
        train(_task(), config, _options(out))
    # Nothing of the first run was touched by the refused one.
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK_NAME} == before

    train(_task(), config, _options(out, max_steps=2, overwrite=True))
    # The new run's alone: no previous checkpoint of the other run, a log of its own steps.
    assert not (out / "checkpoint.previous.pt").exists()
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["type"] == "step"] == [1, 2]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2

    with pytest.raises(ConfigError, match="contradict each other; give one of them"):
        _options(out, resume=True, overwrite=True)


def test_the_cli_refuses_a_finished_runs_folder_in_one_line(write_model, tmp_path, capsys, caplog):
    path = write_model(MODEL.replace("{slow}", "False"))
    out = tmp_path / "run"
    assert main(["fit", path, *FIT, "--max-steps", "2", "--out", str(out)]) == 0
    model_bytes = (out / "model.pt").read_bytes()
    capsys.readouterr()

    assert main(["fit", path, *FIT, "--max-steps", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds another run's results" in err and "--overwrite" in err
    assert (out / "model.pt").read_bytes() == model_bytes

    # memplan train into it too; and --resume with nothing to resume is refused, not a fresh start.
    assert main(["train", path, "--plan", str(out / "plan.json"), "--max-steps", "2", "--out", str(out),
                 "--no-progress"]) == 2
    assert "holds another run's results" in capsys.readouterr().err
    empty = tmp_path / "empty"
    assert main(["fit", path, *FIT, "--max-steps", "2", "--out", str(empty), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "holds no checkpoint.pt or plan.json to resume" in err and err.count("\n") == 1
    assert not (empty / "model.pt").exists()

    assert main(["fit", path, *FIT, "--max-steps", "3", "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert not (out / "checkpoint.previous.pt").exists()
    assert any("deleted the earlier run's checkpoint.pt" in r.getMessage() for r in caplog.records)

    # A resumed fit trains the saved plan: the search flags it does not use are named.
    caplog.clear()
    assert main(["fit", path, *FIT, "--global-batch", "4", "--max-steps", "4", "--out", str(out), "--resume"]) == 0
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "--vram, --global-batch not used: --resume trains the plan saved in" in said
    assert "max_steps 3 -> 4" in said


def test_two_real_runs_into_one_folder_the_second_is_refused(write_model, tmp_path):
    path = write_model(MODEL.replace("{slow}", "True"))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "memplan.cli", "fit", path, *FIT, "--max-steps", "40", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        lock = out / LOCK_NAME
        while not (lock.exists() and f'"pid": {first.pid}' in lock.read_text()):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run never claimed its folder"
            time.sleep(0.1)
        second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        still_running = first.poll() is None
        out_first, err_first = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert still_running, "the first run ended before the second was refused: the test proves nothing"
    assert second.returncode == 2, second.stderr
    assert second.stderr.count("\n") == 1 and "is in use by another memplan run" in second.stderr
    assert f"pid {first.pid}" in second.stderr
    assert first.returncode == 0, err_first
    # The first run's log is whole: every line parses, every step once.
    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if json.loads(line)["type"] == "step"]
    assert steps == list(range(1, 41))


def test_a_killed_run_leaves_no_lock_behind(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from memplan.training._out_dir import claim_out_dir\n"
         f"with claim_out_dir({str(out)!r}):\n    print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"in use by another memplan run \(pid {holder.pid} "):
            with claim_out_dir(out):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    with claim_out_dir(out):  # the kernel let go of the dead process's lock
        with claim_out_dir(out):  # and a process may claim what it holds
            pass


def test_a_resume_with_other_options_says_which(tmp_path, caplog):
    out = tmp_path / "run"
    config = TrainConfig(micro_batch_size=8)
    train(_task(), config, _options(out, max_steps=2, lr=0.05))
    with caplog.at_level("WARNING", logger="memplan"):
        result = train(_task(), config, _options(out, max_steps=4, lr=0.1, resume=True))
    said = [r.getMessage() for r in caplog.records if "did not start with" in r.getMessage()]
    assert len(said) == 1 and "max_steps 2 -> 4" in said[0] and "lr 0.05 -> 0.1" in said[0]
    assert result.steps == 4
    caplog.clear()
    with caplog.at_level("WARNING", logger="memplan"):
        train(_task(), config, _options(out, max_steps=6, lr=0.1, resume=True))
    assert [r.getMessage() for r in caplog.records if "did not start with" in r.getMessage()] == [
        f"resuming {out / 'checkpoint.pt'} with options the run did not start with: max_steps 4 -> 6"]


def test_a_plan_larger_than_the_data_is_refused_before_training(tmp_path):
    # 32 items; a plan of 64 a step would train every item each step, in smaller batches than planned.
    with pytest.raises(ConfigError, match=r"global batch of 64 .* larger than tiny's 32 training items"):
        train(_task(), TrainConfig(micro_batch_size=64), _options(tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_a_forked_child_does_not_keep_the_folder(tmp_path):
    # DataLoader workers are forked and may outlive a run (persistent_workers): the next run of
    # the same process (a resume) must be able to claim the folder while they live.
    out = tmp_path / "run"
    with claim_out_dir(out):
        pid = os.fork()
        if pid == 0:  # the child: outlive the claim
            time.sleep(3)
            os._exit(0)
    try:
        with claim_out_dir(out):
            pass
    finally:
        os.waitpid(pid, 0)
