"""Optimizer steps on the batches a task plans for a configuration: the trace records them,
the probe and the race time them, the CPU measurement profiles them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .._config import TrainConfig
from .._step_options import StepOptions
from .._types import Batch
from ._build import BuiltModel
from ._step import StepHooks, StepParts, StepResult, make_step_parts, train_step

if TYPE_CHECKING:
    from ..task._task import Task

__all__ = ["PlannedSteps"]


class PlannedSteps:
    """``steps(i)`` runs optimizer step ``i`` of ``config`` with :func:`train_step`.

    Batches are those the task plans for (``Task.real_batch``/``fake_batch`` with ``like`` the
    configuration's micro-batch size: the longest items together when items vary in shape);
    step ``i``'s micro-batch ``k`` starts at item ``batch_offset + (i * micro_steps + k) * batch_size``,
    so that steps see different items. ``micro_steps`` defaults to the configuration's
    accumulation; the trace runs at most two (the rest repeat the second), each weighted
    ``1 / grad_accum_steps`` as the trainer weights full micro-batches.

    The optimizer, scaler and EMA are made here, between ``hooks.making_batch(True)`` and
    ``(False)``: setup, not the step's ops; the EMA's copy is reported with ``hooks.held``.
    """

    def __init__(self, task: Task, config: TrainConfig, built: BuiltModel, *, device: torch.device | str = "cpu",
                 options: StepOptions | None = None, real: bool = True, batch_size: int | None = None,
                 micro_steps: int | None = None, batch_offset: int = 0, foreach: bool = False,
                 hooks: StepHooks | None = None) -> None:
        self.task, self.config, self.real = task, config, real
        self.batch_size = batch_size or config.micro_batch_size
        self.micro_steps = micro_steps or config.micro_batches
        self.batch_offset = batch_offset
        self.hooks = hooks
        self.device = torch.device(device)
        setup = hooks or StepHooks()
        setup.making_batch(True)
        self.parts: StepParts = make_step_parts(task, config, built.model, built.wrapped, device=self.device,
                                                options=options if options is not None else task.step,
                                                forward_model=built.forward_model, foreach=foreach)
        setup.making_batch(False)
        if self.parts.ema is not None:
            setup.held(self.parts.ema.tensors(), "ema")

    def batches(self, step: int) -> Iterator[Batch]:
        b, n, cfg = self.batch_size, self.micro_steps, self.config
        for micro in range(1, n + 1):
            if self.real:
                yield self.task.real_batch(b, offset=self.batch_offset + (step * n + micro) * b,
                                           like=cfg.micro_batch_size)
            else:
                yield self.task.fake_batch(b, like=cfg.micro_batch_size)

    def __call__(self, step: int, hooks: StepHooks | None = None) -> StepResult:
        weights = [1.0 / self.config.micro_batches] * self.micro_steps
        return train_step(self.parts, self.batches(step), weights, step=step, hooks=hooks or self.hooks,
                          tracing=not self.real)
