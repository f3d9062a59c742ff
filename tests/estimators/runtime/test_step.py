"""One training step, written once: the trace records, the probe times and the trainer runs
:func:`estimators.runtime._step.train_step`, so that the estimate covers what the trainer does
(accumulation, clipping, EMA) and the traced step allocates what the trainer's step allocates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from estimators import ConfigError, Estimator, Task, TrainConfig
from estimators._step_options import StepOptions
from estimators.runtime._guard import MemoryGuard
from estimators.tracing._recorder import Category, Recorder
from estimators.tracing._trace import trace_step
from memplan import TrainOptions, train


def _task(step: StepOptions | None = None) -> Task:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g))
    task = Task.from_module(model, train_data=data, name="mlp")
    return task.with_step(step) if step is not None else task


ACCUM_CLIP_EMA = StepOptions(clip="norm", clip_threshold=0.5, ema_decay=0.99)
CONFIG = TrainConfig(micro_batch_size=16, grad_accum_steps=4)


def _options(tmp_path: Path, step: StepOptions, **more: Any) -> TrainOptions:
    kwargs: dict[str, Any] = dict(max_steps=3, out_dir=tmp_path, progress=False, num_workers=0, schedule="constant",
                                  grad_clip=step.clip_threshold, grad_clip_mode=step.clip, ema_decay=step.ema_decay)
    return TrainOptions(**{**kwargs, **more})


def test_the_estimate_of_accumulation_clipping_and_ema_is_within_1_percent_of_the_trainer(tmp_path: Path) -> None:
    task = _task(ACCUM_CLIP_EMA)
    est = Estimator(task).estimate(CONFIG)
    # The guard counts live tensor storage, not kernel scratch: compare the estimate's tensors.
    predicted = est.peak_allocated_bytes - est.breakdown.get("workspace", 0)
    guard = MemoryGuard(10**12)
    result = train(task, CONFIG, _options(tmp_path, ACCUM_CLIP_EMA), memory_guard=guard)
    measured = int(result.summary["peak_memory_bytes"])
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured, dict(est.breakdown))
    # The EMA's copy of the weights is held by the estimate, and only with EMA on.
    params = sum(p.numel() * p.element_size() for p in task.build_model().parameters())
    assert est.breakdown["ema"] >= params
    plain = Estimator(_task(StepOptions(clip="norm"))).estimate(CONFIG)
    assert plain.breakdown.get("ema", 0) == 0
    assert est.peak_allocated_bytes - plain.peak_allocated_bytes >= params


class _Sequence(Recorder):
    """The trace's own recorder as the trainer's memory guard: the trainer names its phases
    through the guard's ``phase`` attribute (forward, backward, optimizer, data, ...)."""

    def __init__(self) -> None:
        self.labels: list[str] = ["setup"]
        super().__init__()

    @property  # type: ignore[override]
    def phase(self) -> int:
        return len(self.labels) - 1

    @phase.setter
    def phase(self, value: int | str) -> None:
        if isinstance(value, str):
            self.labels.append(value)

    def step_allocations(self, step: int) -> list[int]:
        """Bytes of the storages created in optimizer step ``step`` (1-based), batches excluded."""
        steps, current, last = [], 0, ""
        for label in self.labels:
            if label == "forward" and last not in ("forward", "data", "backward"):  # not the next micro-batch
                current += 1
            steps.append(current)
            last = label
        return [int(self.alloc_bytes[a]) for a, sign, ph in zip(self.event_alloc, self.event_sign, self.event_phase)
                if sign > 0 and steps[ph] == step and self.labels[ph] in ("forward", "backward", "optimizer")]


def test_the_traced_step_makes_the_same_allocations_as_the_trainers_step(tmp_path: Path) -> None:
    task = _task(ACCUM_CLIP_EMA)
    config = TrainConfig(micro_batch_size=16, grad_accum_steps=2)
    recorder = _Sequence()
    # Step 2: step 1 creates the optimizer state and runs the monitor's per-layer norms.
    train(task, config, _options(tmp_path, ACCUM_CLIP_EMA, max_steps=2), memory_guard=recorder)
    trainer_step = recorder.step_allocations(2)

    trace = trace_step(task, config, real=True, steps=2, synthesize=False)
    labels = trace.phase_labels
    traced = [int(trace.alloc_bytes[i]) for i, sign, ph in zip(trace.event_alloc, trace.event_sign, trace.event_phase)
              if sign > 0 and labels[ph].startswith("step 2 ") and trace.alloc_category[i] != Category.BATCH]
    assert trainer_step, "the recorder saw no step"
    assert traced == trainer_step


def test_step_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="ema_decay"):
        StepOptions(ema_decay=1.5)
    with pytest.raises(ConfigError, match="clip"):
        StepOptions(clip="sometimes")  # type: ignore[arg-type]
