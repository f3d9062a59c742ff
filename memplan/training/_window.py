"""THE STEP: one window -- ``grad_accum_steps`` micro-batches' forward and backward, clipping,
the optimizer step -- and the techniques only the step uses (EMA, the GradScaler, the loss).

Everything the estimator models is applied through the helpers it traces with (precision,
gradient sync), so that the memory that was predicted is the memory that is used:

* forward and loss under ``forward_context`` (autocast for bf16/fp16), backward through
  ``precision.backward`` (scaled under fp16), ``precision.optimizer_step`` (GradScaler step
  and update under fp16), ``zero_grad(set_to_none=True)`` after the step;
* each micro-batch's batch and loss are dropped right after its backward.

What runs beyond the predicted step: the EMA copy of the weights (``ema_decay``) and gradient
clipping's temporaries (one 0-d tensor per gradient, freed before the optimizer step: no change
of the measured peak in ``benchmarks/results/technique_memory.md``).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from estimators import TrainConfig, default_logits_and_targets
from estimators import parallel as _parallel
from estimators import precision as _precision

from ._data import _Window
from ._recovery import snapshot_optimizer

__all__: list[str] = []

Batch = Any


_UNDO_STEPS = 2
"""Optimizer steps guarded by an undo copy (see ``_run_window``)."""


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


class _EMA:
    """Exponential moving average of the floating-point state (parameters and float buffers
    such as BatchNorm statistics); integer buffers are taken from the live model."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        state = model.state_dict()
        for name, avg in self.shadow.items():
            avg.lerp_(state[name].detach(), 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[None]:
        """The EMA weights in the model for the duration (evaluation, saving)."""
        backup = {k: v.detach().clone() for k, v in model.state_dict().items() if k in self.shadow}
        model.load_state_dict(self.shadow, strict=False)
        try:
            yield
        finally:
            model.load_state_dict(backup, strict=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for name, value in state.items():
            self.shadow[name].copy_(value)


class _Step:
    """The trainer's step (a part of :class:`~memplan.training.Trainer`: it reads the model, the
    optimizer, the scaler, the options and the phase hooks of the others)."""

    # Over 60 lines on purpose: the step is kept whole, its logic as it was, until the shared
    # runtime train_step (estimators.runtime) replaces this module's contents (issue 19).
    def _run_window(self, window: _Window, batches: Iterator[Batch], config: TrainConfig) -> _WindowOutcome:
        """Forward/backward every micro-batch of ``window``, then one optimizer step.

        Nothing of the window is applied before ``optimizer_step``, and gradients start from
        ``None``: if this raises before the step (an OOM, say), the window can be run again
        from its start with another ``config`` of the same global batch::

            window = window.recut(new_config.micro_batch_size)
            self._run_window(window, self._collate_window(window), new_config)
        """
        t0 = time.perf_counter()
        self._optimizer_undo = None
        self.optimizer.zero_grad(set_to_none=True)  # a no-op normally; makes a replay start clean
        window_loss: torch.Tensor | None = None
        last = len(window.micro_indices) - 1
        largest: tuple[int, list[list[int]]] | None = None
        for k, (indices, batch) in enumerate(zip(window.micro_indices, batches)):
            batch = self._to_device(batch)
            size = _batch_size_of(batch)
            if largest is None or size[0] > largest[0]:
                largest = size
            # Weight each micro-batch by its share of the window's samples (this rank's), so that
            # the summed gradients are those of the mean loss over the whole window -- the large
            # batch's gradient exactly, also for a short last window or a short last micro-batch.
            # With full micro-batches this is the usual loss / grad_accum_steps. Every rank has
            # as many samples, so DDP's and FSDP's mean over ranks is the mean over the window.
            weight = len(indices) / window.n_items
            # DDP reduces gradients across ranks in the last micro-batch's backward only; FSDP2
            # reduce-scatters every micro-batch (its gradients stay sharded); _parallel decides.
            with _parallel.gradient_sync(self._wrapped, k == last):
                self._set_phase("forward")
                with _precision.forward_context(config.precision, self.device.type):
                    loss = self._loss_fn(self.forward_model, batch)
                    if weight != 1.0:  # one micro-batch per window: x * 1.0 is x, skip the op and its backward
                        loss = loss * weight
                self._set_phase("backward")
                _precision.backward(loss, self.scaler)
            part = loss.detach().float()
            window_loss = part if window_loss is None else window_loss + part
            del batch, loss, part  # free the batch and the graph now, as the estimate assumes
        self._set_phase("optimizer")
        if window_loss is None:  # no micro-batch (cannot happen with the sampler's windows)
            window_loss = torch.zeros((), device=self.device)

        if self.distributed:
            # The window's mean loss over all ranks: what is logged, and one skip decision for all.
            window_loss = window_loss.clone()  # reduced in place: not the loss tensor's own storage
            dist.all_reduce(window_loss)
            window_loss /= self.world_size
        loss_value = float(window_loss)  # waits for the device once per step; the log needs it anyway
        if not math.isfinite(loss_value):
            # Skip: nothing applied (weights, optimizer state, scaler and schedule untouched).
            self.optimizer.zero_grad(set_to_none=True)
            return _WindowOutcome(loss_value, applied=False, nonfinite=True, seconds=time.perf_counter() - t0)

        grad_norm = None
        if self._recovering and self.step < _UNDO_STEPS and self.config.strategy != "fsdp":
            # An OOM inside the optimizer step may leave it half applied (AdamW updates its
            # moments in place before it allocates its temporaries): keep an undo copy in host
            # memory so that the window can be replayed from its start. Only the first steps
            # pay for it: the first creates the optimizer state, and from the second on the
            # step's memory is the same every time (the estimator traces exactly this). Not under
            # FSDP: a rank's shards alone cannot make a window-start checkpoint anyway.
            self._optimizer_undo = snapshot_optimizer(self.model, self.optimizer, self.scaler)
        clip = self.options.clip_mode
        if clip != "off":
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            norm = _clip_gradients(self.model, clip, float(self.options.grad_clip))  # type: ignore[arg-type]
            full = getattr(norm, "full_tensor", None)  # FSDP2: the norm over all shards, replicated
            grad_norm = float(full() if full is not None else norm)
            if self.scaler is None and not math.isfinite(grad_norm):
                # Without a scaler nobody else would stop inf gradients from reaching the weights.
                self.optimizer.zero_grad(set_to_none=True)
                return _WindowOutcome(loss_value, applied=False, nonfinite=True, grad_norm=grad_norm,
                                      seconds=time.perf_counter() - t0)
        self._monitor.capture(self.model, self.step + 1, grad_norm=grad_norm, clip=self.options.grad_clip)
        applied = _precision.optimizer_step(self.optimizer, self.scaler)
        self._optimizer_undo = None
        self.optimizer.zero_grad(set_to_none=True)  # gradients are dead weight until the next backward
        return _WindowOutcome(loss_value, applied=applied, scaler_skipped=not applied,
                              grad_norm=grad_norm, seconds=time.perf_counter() - t0, largest_batch=largest)

    def _make_scaler(self, precision: str) -> Any:
        kwargs = self.options.scaler_kwargs()
        scaler = _precision.make_grad_scaler(precision, self.device.type, **kwargs)
        if scaler is not None and self.config.strategy == "fsdp":
            # Every rank sees only its gradient shards: the sharded scaler all-reduces whether
            # any rank found inf/NaN, so that all of them skip (or take) the same step.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(self.device.type, **kwargs)
        return scaler

    def _training_loss(self) -> Callable[[nn.Module, Batch], torch.Tensor]:
        smoothing = self.options.label_smoothing
        if not smoothing:
            return self.task.compute_loss

        def smoothed(model: nn.Module, batch: Batch) -> torch.Tensor:
            logits, targets = _logits_and_targets(model, batch)
            return F.cross_entropy(logits, targets, label_smoothing=smoothing)
        return smoothed


def _clip_gradients(model: nn.Module, mode: Literal["norm", "value"], threshold: float) -> torch.Tensor:
    """Clip in place; returns the global gradient norm before clipping (logged either way)."""
    if mode == "norm":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), threshold)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    torch.nn.utils.clip_grad_value_(model.parameters(), threshold)
    return norm


def _logits_and_targets(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The default loss's view of a batch (one definition, shared with the estimator)."""
    return default_logits_and_targets(model, batch)


def _batch_size_of(batch: Batch) -> tuple[int, list[list[int]]]:
    """(tensor elements, tensor shapes) of a batch."""
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    return sum(t.numel() for t in tensors), [list(t.shape) for t in tensors]

