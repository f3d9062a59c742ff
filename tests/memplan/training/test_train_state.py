"""TrainState: the run's progress counters, saved in the checkpoint's layout and read back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from estimators import Task, TrainConfig
from memplan.training import TrainOptions, TrainState, train
from memplan.training._checkpoint_io import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

_TASKS: list[Task] = []  # estimators caches datasets by id(task): keep every task alive


def _task() -> Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 4, generator=g)
    y = (x[:, 0] > 0).long()
    task = Task(name="tiny", build_model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
                train_data=lambda: TensorDataset(x, y), val_data=lambda: TensorDataset(x[:8], y[:8]))
    _TASKS.append(task)
    return task


def _state() -> TrainState:
    return TrainState(step=7, epoch=2, epoch_offset=8, samples_seen=56, skipped_steps=1, scaler_skipped_steps=2,
                      consecutive_nonfinite=0, best_metric=0.25, best_step=6, best_metrics={"val_loss": 0.25},
                      bad_evaluations=1, stop_reference=0.3, stopped_early=False, last_metrics={"val_loss": 0.4},
                      last_eval_step=7, last_train_loss=0.5)


def test_state_dict_round_trip_keeps_every_counter() -> None:
    state = _state()
    loaded = TrainState()
    loaded.load_state_dict(state.state_dict())
    assert loaded == state
    assert loaded != TrainState()


def test_state_dict_has_the_checkpoint_layout() -> None:
    d = _state().state_dict()
    assert (d["step"], d["epoch"], d["epoch_sample_offset"]) == (7, 2, 8)
    assert d["best"]["metric"] == 0.25 and d["best"]["stop_reference"] == 0.3
    assert d["counters"]["skipped_steps"] == 1 and d["counters"]["last_metrics"] == {"val_loss": 0.4}


def test_a_checkpoint_without_stop_reference_falls_back_on_the_best_metric() -> None:
    d = _state().state_dict()
    del d["best"]["stop_reference"]  # checkpoints written before early stopping had min_delta
    loaded = TrainState()
    loaded.load_state_dict(d)
    assert loaded.stop_reference == 0.25


def test_the_trainer_writes_its_state_into_the_checkpoint(tmp_path: Path) -> None:
    result = train(_task(), TrainConfig(micro_batch_size=4, grad_accum_steps=2),
                   TrainOptions(max_steps=4, out_dir=tmp_path / "run", progress=False, eval_every=2))
    ckpt = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    state = TrainState()
    state.load_state_dict(ckpt)
    assert state.step == result.steps == 4
    assert state.samples_seen == 4 * 8 and state.epoch == 1 and state.epoch_offset == 8
    assert state.best_metric == result.best_metric and state.last_eval_step == 4
    assert ckpt["best"]["path"] == str(tmp_path / "run" / "best_model.pt")
