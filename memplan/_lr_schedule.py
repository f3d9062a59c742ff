"""The interface of a learning-rate schedule, as the trainer steps it, and a model file's own.

:class:`LRSchedule` sets every parameter group's lr from its base lr and the optimizer steps
taken so far; the built-in shapes (``_schedule_shapes``) define its factor. An
:class:`ExternalSchedule` wraps the ``torch.optim.lr_scheduler`` a model file's
``scheduler(optimizer, total_steps)`` returns behind the same methods.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from estimators import ModelFileError

__all__ = ["LRSchedule", "ExternalSchedule"]


class LRSchedule:
    """Sets every group's lr from its base lr and ``t``, once per optimizer step.

    ``last_epoch`` is the number of optimizer steps taken (torch's name for it, so code written
    for ``torch.optim.lr_scheduler`` reads it). Subclasses define :meth:`factor` (or
    :meth:`lr_at` when the lr is not a multiple of the base lr); the trainer calls :meth:`step`
    after each optimizer step that was applied and :meth:`observe` after each evaluation.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int = 0,
                 total_steps: int | None = None) -> None:
        self.optimizer = optimizer
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.warmup_steps = int(warmup_steps)
        self.total_steps = total_steps
        self.last_epoch = 0
        self._apply()

    def factor(self, t: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def lr_at(self, base: float, t: int) -> float:
        """The lr of a group with base lr ``base`` after ``t`` optimizer steps."""
        return base * self.factor(t)

    def warmup_factor(self, t: int) -> float:
        """Linear warm-up: ``(t + 1) / (warmup + 1)`` before ``warmup_steps``, else 1."""
        if t < self.warmup_steps:
            return (t + 1) / (self.warmup_steps + 1)
        return 1.0

    def step(self) -> None:
        """Advance by one optimizer step and set the lr for the next one."""
        self.last_epoch += 1
        self._apply()

    def observe(self, metric: float) -> None:
        """An evaluation result of the monitored metric (only ``plateau`` uses it)."""

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._apply()

    def _apply(self) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = self.lr_at(base, self.last_epoch)


class ExternalSchedule(LRSchedule):
    """A model file's ``scheduler(optimizer, total_steps)``, stepped as the built-in schedules
    are: once per optimizer step, or -- a ``ReduceLROnPlateau`` -- once per evaluation with the
    monitored metric. It owns the lr entirely (no warm-up is added to it)."""

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer, *, name: str = "the model file") -> None:
        for attr in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(scheduler, attr, None)):
                raise ModelFileError(
                    f"{name}: scheduler(optimizer, total_steps) returned {type(scheduler).__name__}, not a "
                    "torch.optim.lr_scheduler.LRScheduler; return e.g. "
                    "torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)"
                )
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ModelFileError(f"{name}: scheduler() must schedule the optimizer it is given")
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self.warmup_steps, self.total_steps = 0, None
        self.on_metric = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.last_epoch = 0

    def step(self) -> None:
        self.last_epoch += 1
        if self.on_metric:
            return
        with warnings.catch_warnings():
            # A step the GradScaler skipped has no optimizer.step(): torch warns about the order.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self.scheduler.step()

    def observe(self, metric: float) -> None:
        if self.on_metric and math.isfinite(metric):
            self.scheduler.step(metric)

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # The optimizer's own state (loaded first) brings each group's lr back.
        self.last_epoch = int(state["last_epoch"])
        self.scheduler.load_state_dict(state["scheduler"])
