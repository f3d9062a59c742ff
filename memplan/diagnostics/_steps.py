"""The training step the diagnostics run: the trainer's own (:func:`estimators.train_step`) on a
plain configuration -- one device, one micro-batch a step, no clipping -- so that what lr-find
and doctor measure is what training does (precision, the optimizer, the zero_grad), not a loop
of their own."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from estimators import StepHooks, StepOptions, Task, TrainConfig, build_for_training, normalize_precision, train_step
from estimators._types import Batch
from estimators.runtime._step import make_step_parts

__all__ = ["PlainSteps", "fresh_model"]


def fresh_model(task: Task, device: str, seed: int, precision: str = "fp32") -> nn.Module:
    """The task's model as the trainer builds it (a copy of a prebuilt module: the user's own is
    never trained here), seeded, on ``device``, in train mode."""
    torch.manual_seed(seed)
    return build_for_training(task, TrainConfig(micro_batch_size=1, precision=normalize_precision(precision)), device).model


class _Judged(StepHooks):
    """A non-finite loss skips the optimizer step; ``on_gradients(model)`` sees each backward's."""

    def __init__(self, on_gradients: Callable[[nn.Module], None] | None) -> None:
        self.on_gradients = on_gradients

    def after_backward(self, model: nn.Module) -> None:
        if self.on_gradients is not None:
            self.on_gradients(model)

    def losses_done(self, loss_sum: torch.Tensor) -> bool:
        return math.isfinite(float(loss_sum))


class PlainSteps:
    """Optimizer steps of ``model`` (built by :func:`fresh_model`), one batch each."""

    def __init__(self, task: Task, model: nn.Module, device: str, precision: str = "fp32") -> None:
        config = TrainConfig(micro_batch_size=1, precision=normalize_precision(precision))
        self.parts = make_step_parts(task, config, model, model, device=torch.device(device),
                                     options=StepOptions(clip="off"))
        self.optimizer = self.parts.optimizer
        self._steps = 0

    def step(self, batch: Batch, on_gradients: Callable[[nn.Module], None] | None = None) -> float:
        """One step on ``batch``; its loss (NaN/inf: the weights were left as they were)."""
        self._steps += 1
        result = train_step(self.parts, iter([batch]), [1.0], step=self._steps, hooks=_Judged(on_gradients))
        return float(result.loss_sum) if result.loss_sum is not None else float("nan")
