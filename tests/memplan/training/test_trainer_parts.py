"""The trainer's parts work on their own, without a Trainer: the checkpoint manager saves and
restores a model and its optimizer, the metrics log writes its lines, the ladder keeps its
record, the ranks of one process agree, and a signal asks the loop to stop."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from estimators import TrainConfig
from memplan.training import TrainOptions, TrainState
from memplan.training._checkpoints import CheckpointManager
from memplan.training._distributed import RankAgreement
from memplan.training._memory import PeakMemory, Phase
from memplan.training._metrics import Metrics
from memplan.training._monitor import TrainingMonitor
from memplan.training._precision import TrainPrecision
from memplan.training._recovery import Ladder
from memplan.training._schedules import make_schedule
from memplan.training._signals import StopSignals

CPU = torch.device("cpu")
CONFIG = TrainConfig(micro_batch_size=4)


def metrics_for(path: Path) -> Metrics:
    return Metrics(path, is_main=True, progress=False, total_steps=4, peak=PeakMemory(CPU, None),
                   monitor=TrainingMonitor(CPU, enabled=False))


def manager(out: Path, model: torch.nn.Module, options: TrainOptions) -> tuple[CheckpointManager, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    task: Any = SimpleNamespace(name="tiny", source_hash="h")  # what a checkpoint records of the model file
    checkpoints = CheckpointManager(
        out, task=task, options=options, n_train=16, model=model, optimizer=optimizer,
        schedule=make_schedule("cosine", optimizer, warmup_steps=1, total_steps=4), ema=None,
        precision=TrainPrecision("fp32", CPU, sharded=False, scaler_kwargs=options.scaler_kwargs()),
        ladder=Ladder(CONFIG, None), ranks=RankAgreement(0, 1, strategy="single", device=CPU),
        metrics=metrics_for(out / "metrics.jsonl"), phase=Phase(None), best_path=out / "best_model.pt")
    return checkpoints, optimizer


def test_the_checkpoint_manager_saves_and_restores_a_model_and_its_optimizer(tmp_path: Path) -> None:
    options = TrainOptions(out_dir=tmp_path, seed=3)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    checkpoints, optimizer = manager(tmp_path, model, options)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    checkpoints.schedule.step()
    state = TrainState(step=1, epoch=0, epoch_offset=4, samples_seen=4, last_train_loss=0.5)
    checkpoints.save(state)
    assert (tmp_path / "checkpoint.pt").exists() and checkpoints.last_step == 1

    other = torch.nn.Linear(3, 2)  # other weights, a fresh optimizer and schedule
    restoring, other_optimizer = manager(tmp_path, other, options)
    ckpt = restoring.load(CPU)
    assert ckpt is not None and ckpt["config"] == CONFIG.to_dict()
    resumed = TrainState()
    assert restoring.restore(ckpt, resumed) == 1
    assert resumed == state and restoring.last_step == 1
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert other_optimizer.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert restoring.schedule.last_epoch == 1


def test_the_metrics_log_writes_its_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics = metrics_for(path)
    metrics.log({"type": "resume", "step": 0})  # before the log is open: queued, written at open
    metrics.open(resumed=False, step=0)
    metrics.log({"type": "eval", "step": 1, "val_loss": math.nan})  # not a step line: written at once
    assert [json.loads(line)["type"] for line in path.read_text().splitlines()] == ["resume", "eval"]
    metrics.log({"type": "step", "step": 2, "loss": math.inf})
    metrics.close()  # the step lines still queued are written at the end
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[1]["val_loss"] == "nan" and lines[2] == {"type": "step", "step": 2, "loss": "inf"}


def test_the_ladder_keeps_its_record_across_a_checkpoint() -> None:
    rungs = [TrainConfig(micro_batch_size=2, grad_accum_steps=2), TrainConfig(micro_batch_size=1, grad_accum_steps=4)]
    ladder = Ladder(CONFIG, rungs)
    new, skipped = ladder.step_down(None)
    assert new == rungs[0] and not skipped and ladder.rungs == rungs[1:]
    ladder.config = new
    ladder.recoveries.append({"step": 3})
    fresh = Ladder(CONFIG, rungs)
    assert fresh.resume(ladder.state_dict(), new) == new
    assert fresh.rungs == rungs[1:] and fresh.tried == [CONFIG, new] and fresh.recoveries == [{"step": 3}]


def test_one_process_agrees_with_itself_and_a_signal_asks_to_stop() -> None:
    ranks = RankAgreement(0, 1, strategy="single", device=CPU)
    assert not ranks.distributed and ranks.is_main and ranks.agree(True) and not ranks.agree(False)
    assert ranks.max_over_ranks(7) == 7 and not ranks.any_stop(False)
    signals = StopSignals()
    with signals.caught():
        os.kill(os.getpid(), signal.SIGTERM)
    assert signals.received == "SIGTERM" and ranks.any_stop(True)
