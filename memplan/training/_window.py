"""The trainer's part of the step: the shared :func:`estimators.train_step` (forward, loss,
backward per micro-batch, clipping, the optimizer step, EMA, zero_grad: what the estimate
traced) with the trainer's decisions in its hooks.

The hooks decide and never allocate on the device inside the step, so the trainer's step
makes the allocations the trace recorded (``tests/estimators/runtime/test_step.py``): a window whose loss (all
ranks' mean) or, without a GradScaler, whose gradient norm is not finite is skipped before
anything is applied; the first steps of a run with OOM recovery keep an undo copy of the
optimizer in host memory; the monitor takes its per-layer gradient norms when due.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from estimators import StepHooks, StepParts, TrainConfig, train_step

from ._data import _Window
from ._recovery import snapshot_optimizer

if TYPE_CHECKING:
    from estimators import EMA
    from estimators.runtime._step import LossFn

    from ._distributed import RankAgreement
    from ._memory import Phase
    from ._monitor import TrainingMonitor
    from ._options import TrainOptions
    from ._precision import TrainPrecision
    from ._recovery import _Snapshot

__all__: list[str] = []

Batch = Any


_UNDO_STEPS = 2
"""Optimizer steps guarded by an undo copy (see ``_WindowHooks.losses_done``)."""


@dataclass
class _WindowOutcome:
    loss: float
    """Mean training loss over the window's samples (NaN/inf when non-finite)."""
    applied: bool
    """The optimizer step changed the weights."""
    nonfinite: bool = False
    """Skipped: NaN/inf loss (or gradient norm without a GradScaler)."""
    scaler_skipped: bool = False
    """fp16: the GradScaler found inf/NaN gradients and skipped the step (normal early on)."""
    grad_norm: float | None = None
    seconds: float = 0.0
    largest_batch: tuple[int, list[list[int]]] | None = None
    """(tensor elements, tensor shapes) of the window's largest micro-batch."""


class _WindowHooks(StepHooks):
    """What the trainer decides inside the shared step (of optimizer step ``step``)."""

    def __init__(self, window_step: WindowStep, step: int) -> None:
        self.t, self.step = window_step, step
        self.largest: tuple[int, list[list[int]]] | None = None
        self.loss_value = math.nan
        self.grad_norm: float | None = None
        self.nonfinite = False

    def phase(self, label: str, kind: str) -> None:
        if kind in ("forward", "backward", "optimizer"):  # zero_grad stays in the optimizer phase
            self.t.phase.set(kind)

    def making_batch(self, on: bool) -> None:
        # Loading and collating the next micro-batch: named apart from the forward it precedes.
        self.t.phase.set("data" if on else "forward")

    def batch(self, batch: Batch) -> None:
        size = _batch_size_of(batch)
        if self.largest is None or size[0] > self.largest[0]:
            self.largest = size

    def losses_done(self, loss_sum: torch.Tensor) -> bool:
        t = self.t
        if t.ranks.distributed:
            # The window's mean loss over all ranks: what is logged, and one skip decision for all.
            loss_sum = loss_sum.clone()  # reduced in place: not the step's own tensor
            dist.all_reduce(loss_sum)
            loss_sum /= t.ranks.world_size
        self.loss_value = float(loss_sum)  # waits for the device once per step; the log needs it anyway
        if not math.isfinite(self.loss_value):
            self.nonfinite = True  # skip: weights, optimizer state, scaler and schedule untouched
            return False
        if t.keep_undo and self.step <= _UNDO_STEPS and not t.sharded:
            # An OOM inside the optimizer step may leave it half applied (AdamW updates its
            # moments in place before it allocates its temporaries): keep an undo copy in host
            # memory so that the window can be replayed from its start. Only the first steps
            # pay for it: the first creates the optimizer state, and from the second on the
            # step's memory is the same every time (the estimator traces exactly this). Not under
            # FSDP: a rank's shards alone cannot make a window-start checkpoint anyway.
            t.optimizer_undo = snapshot_optimizer(t.model, t.optimizer, t.precision.scaler)
        return True

    def gradients_ready(self, grad_norm: torch.Tensor | None) -> bool:
        t = self.t
        if grad_norm is not None:
            full = getattr(grad_norm, "full_tensor", None)  # FSDP2: the norm over all shards, replicated
            self.grad_norm = float(full() if full is not None else grad_norm)
            if t.precision.scaler is None and not math.isfinite(self.grad_norm):
                # Without a scaler nobody else would stop inf gradients from reaching the weights.
                self.nonfinite = True
                return False
        t.monitor.capture(t.model, self.step, grad_norm=self.grad_norm, clip=t.options.grad_clip)
        return True

    def after_optimizer(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        self.t.optimizer_undo = None


class WindowStep:
    """The trainer's step: one window's micro-batches and one optimizer step, through the shared
    :func:`estimators.train_step` with the trainer's hooks.

    ``forward_model`` is what the step calls (OOM recovery may checkpoint more of it);
    ``keep_undo``: the first steps keep an undo copy of the optimizer, ``optimizer_undo``, for
    OOM recovery to restore after a failed optimizer step.
    """

    def __init__(self, *, model: nn.Module, forward_model: nn.Module, wrapped: nn.Module,
                 optimizer: torch.optim.Optimizer, precision: TrainPrecision, ema: EMA | None, loss_fn: LossFn,
                 device: torch.device, options: TrainOptions, sharded: bool, ranks: RankAgreement,
                 monitor: TrainingMonitor, phase: Phase, keep_undo: bool) -> None:
        self.model, self.forward_model, self.wrapped = model, forward_model, wrapped
        self.optimizer, self.precision, self.ema, self.loss_fn = optimizer, precision, ema, loss_fn
        self.device, self.options, self.sharded, self.ranks = device, options, sharded, ranks
        self.monitor, self.phase, self.keep_undo = monitor, phase, keep_undo
        self.optimizer_undo: _Snapshot | None = None

    def _parts(self, config: TrainConfig) -> StepParts:
        return StepParts(model=self.model, forward_model=self.forward_model, wrapped=self.wrapped,
                         optimizer=self.optimizer, ema=self.ema, loss_fn=self.loss_fn,
                         precision=self.precision, device=self.device, options=self.options.step_options(),
                         offload_activations=config.offload_activations)

    def run(self, window: _Window, batches: Iterator[Batch], config: TrainConfig, *, step: int) -> _WindowOutcome:
        """Every micro-batch of ``window``, then optimizer step number ``step``
        (:func:`estimators.train_step`).

        Nothing of the window is applied before the optimizer step, and gradients start from
        ``None``: if this raises before the step (an OOM, say), the window can be run again
        from its start with another ``config`` of the same global batch::

            window = window.recut(new_config.micro_batch_size)
            window_step.run(window, data.collate_window(window), new_config, step=step)
        """
        t0 = time.perf_counter()
        self.optimizer_undo = None
        self.optimizer.zero_grad(set_to_none=True)  # a no-op normally; makes a replay start clean
        # Each micro-batch weighted by its share of the window's samples (this rank's), so that
        # the summed gradients are those of the mean loss over the whole window -- the large
        # batch's gradient exactly, also for a short last window or a short last micro-batch.
        # With full micro-batches this is the usual 1 / grad_accum_steps. Every rank has as
        # many samples, so DDP's and FSDP's mean over ranks is the mean over the window.
        weights = [len(indices) / window.n_items for indices in window.micro_indices]
        hooks = _WindowHooks(self, step)
        result = train_step(self._parts(config), iter(batches), weights, step=step, hooks=hooks)
        seconds = time.perf_counter() - t0
        if hooks.nonfinite:
            return _WindowOutcome(hooks.loss_value, applied=False, nonfinite=True, grad_norm=hooks.grad_norm,
                                  seconds=seconds)
        return _WindowOutcome(hooks.loss_value, applied=result.applied, scaler_skipped=not result.applied,
                              grad_norm=hooks.grad_norm, seconds=seconds, largest_batch=hooks.largest)


def _batch_size_of(batch: Batch) -> tuple[int, list[list[int]]]:
    """(tensor elements, tensor shapes) of a batch."""
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    return sum(t.numel() for t in tensors), [list(t.shape) for t in tensors]
