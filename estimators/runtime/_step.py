"""The training step, written once: what the trace records, the probe times and the trainer runs.

One optimizer step over a window of micro-batches::

    for each micro-batch:  forward (autocast) -> loss * weight -> backward (scaled under fp16)
    clip (unscaling first under fp16) -> optimizer step (the scaler's, under fp16) -> EMA -> zero_grad

With ``TrainConfig.optimizer_in_backward`` the parameters are stepped inside backward, one at a
time (:mod:`._optim_bwd`), and the step after backward runs only the EMA.

Callers differ only in their :class:`StepHooks`: the trace marks what each allocation holds and
names the phases, the probe opens a profiler range per phase, the trainer decides to skip a
window whose loss or gradient norm is not finite and keeps an undo copy for OOM recovery. The
hooks never allocate on the device inside the step, so the three run the same allocations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .._config import TrainConfig
from .._step_options import StepOptions
from .._types import Batch
from ..task._task import Task, default_logits_and_targets, default_loss
from . import _activation_offload, _parallel
from ._clip import clip_gradients
from ._ema import EMA
from ._loss_parallel import has_split_head, local_loss, sharded_loss
from ._optim_bwd import OptimizerInBackward, check_compatible
from ._pipeline import PipelinedModel
from ._precision import ScalerSettings, StepPrecision

__all__ = [
    "make_optimizer",
    "StepOptions",
    "StepHooks",
    "StepParts",
    "StepResult",
    "make_step_parts",
    "train_step",
    "to_device",
]

LossFn = Callable[[nn.Module, Batch], torch.Tensor]


class StepHooks:
    """Callbacks of :func:`train_step`; the default does nothing (a plain run)."""

    def phase(self, label: str, kind: str) -> None:
        """A part of the step begins: ``kind`` is forward, backward, optimizer, zero_grad or end;
        ``label`` names it with the step and micro-batch (``step 2 micro 1 forward``)."""

    def making_batch(self, on: bool) -> None:
        """The next micro-batch is being made (loaded, collated, moved): not the step's own ops."""

    def batch(self, batch: Batch) -> None: ...
    def after_forward(self) -> None: ...
    def after_backward(self, model: nn.Module) -> None: ...

    def losses_done(self, loss_sum: torch.Tensor) -> bool:
        """Every micro-batch is through backward; False skips the optimizer step."""
        return True

    def gradients_ready(self, grad_norm: torch.Tensor | None) -> bool:
        """Gradients are final (clipped, when clipping is on); False skips the optimizer step."""
        return True

    def after_optimizer(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None: ...

    def gradient_ready(self, param: torch.Tensor) -> None:
        """With the optimizer step in backward: ``param.grad`` is final and about to be stepped
        and freed (in backward, before the next parameter's)."""

    def held(self, tensors: Sequence[torch.Tensor], kind: str) -> None:
        """Tensors made at setup that live through every step (``kind``: ``ema``)."""

    def copying(self, on: bool) -> None:
        """An offloaded activation is being copied between host and device memory (a trace for a
        CUDA target, :mod:`._activation_offload`): a transfer, not one of the step's kernels."""

    def offloaded(self, tensor: torch.Tensor, where: str) -> None:
        """An offloaded activation's copy: ``where`` is ``host`` (made in forward) or ``device``
        (brought back in backward)."""


@dataclass
class StepParts:
    """What one step runs with."""

    model: nn.Module
    """The module holding the parameters: clipping and EMA use it."""
    forward_model: nn.Module
    """What the forward calls: the strategy's wrapper, compiled or not."""
    wrapped: nn.Module
    """The strategy's wrapper (DDP) or the sharded module (FSDP2): gradient sync goes through it."""
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    loss_fn: LossFn
    precision: StepPrecision
    """The precision, chosen once, with fp16-mixed's loss scaler (FSDP2's sharded one under ``fsdp``)."""
    device: torch.device
    options: StepOptions
    offload_activations: bool = False
    """Saved activations wait in host memory between forward and backward (:mod:`._activation_offload`)."""
    sharded_loss: bool = False
    """The head is split over the vocabulary and the default loss runs on its shards
    (:mod:`._loss_parallel`): forward, loss and backward within ``sharded_loss``."""


@dataclass
class StepResult:
    loss_sum: torch.Tensor | None
    """The micro-batches' weighted losses summed (detached, fp32): the window's mean loss."""
    applied: bool
    """The optimizer step changed the weights (False: skipped by a hook or by the scaler)."""
    stepped: bool
    """The optimizer step ran (the scaler may still have skipped it: ``stepped and not applied``)."""
    grad_norm: torch.Tensor | None = None


def make_step_parts(
    task: Task,
    config: TrainConfig,
    model: nn.Module,
    wrapped: nn.Module,
    *,
    device: torch.device,
    options: StepOptions,
    forward_model: nn.Module | None = None,
    scaler_kwargs: ScalerSettings | None = None,
    foreach: bool = False,
) -> StepParts:
    """The optimizer, precision (with its scaler), EMA and loss a step of ``config`` runs with, for a built model.

    ``foreach`` makes optimizers left to their default run the multi-tensor implementation, as
    PyTorch's optimizers do on CUDA (a trace for a CUDA target runs on CPU tensors).
    """
    optimizer = make_optimizer(task, config, model, options, foreach=foreach)
    precision = StepPrecision(config.precision, device.type, sharded=config.strategy == "fsdp",
                              scaler_settings=scaler_kwargs)
    ema = None
    if options.ema_decay is not None:
        ema = EMA(model, options.ema_decay)
    if isinstance(wrapped, PipelinedModel):
        wrapped.label_smoothing = options.label_smoothing  # the last stage's loss is the step's
    loss_fn = training_loss(task, options.label_smoothing)
    # loss_parallel computes the plain cross entropy only; another loss gets gathered logits.
    sharded = has_split_head(model) and task.loss_fn is default_loss and not options.label_smoothing
    if sharded:
        plain = loss_fn

        def loss_fn(module: nn.Module, batch: Batch) -> torch.Tensor:
            return local_loss(plain(module, batch))

    return StepParts(
        model=model,
        forward_model=forward_model if forward_model is not None else wrapped,
        wrapped=wrapped,
        optimizer=optimizer,
        ema=ema,
        loss_fn=loss_fn,
        precision=precision,
        device=device,
        options=options,
        offload_activations=config.offload_activations,
        sharded_loss=sharded,
    )


def make_optimizer(
    task: Task, config: TrainConfig, model: nn.Module, options: StepOptions, *, foreach: bool = False
) -> torch.optim.Optimizer:
    """The task's optimizer for ``model``; stepped in backward, one parameter at a time, when
    ``config.optimizer_in_backward`` (its wrapper stands for it as one optimizer)."""
    optimizer = task.make_optimizer(model)
    if foreach:
        _use_foreach(optimizer)
    if config.optimizer_in_backward:
        check_compatible(config, options)
        optimizer = OptimizerInBackward(
            optimizer, model, clip_value=options.clip_threshold if options.clip == "value" else None
        )
    return optimizer


def training_loss(task: Task, label_smoothing: float) -> LossFn:
    """The task's loss, or the default cross entropy with label smoothing."""
    if not label_smoothing:
        return task.compute_loss

    def smoothed(model: nn.Module, batch: Batch) -> torch.Tensor:
        logits, targets = default_logits_and_targets(model, batch)
        return torch.nn.functional.cross_entropy(logits, targets, label_smoothing=label_smoothing)

    return smoothed


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A batch on the training device (as is on CPU; non-blocking from pinned memory on CUDA)."""
    if device.type == "cpu":
        return batch
    non_blocking = device.type == "cuda"
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, batch)


def train_step(
    parts: StepParts,
    batches: Iterator[Batch],
    weights: Sequence[float],
    *,
    step: int = 1,
    hooks: StepHooks | None = None,
    tracing: bool = False,
) -> StepResult:
    """One optimizer step over ``len(weights)`` micro-batches drawn one at a time from ``batches``.

    Micro-batch ``k``'s loss is multiplied by ``weights[k]`` (its share of the window's samples;
    ``1 / grad_accum_steps`` for full micro-batches), so that the summed gradients are those of
    the window's mean loss. Gradients must start from None (every step ends with
    ``zero_grad(set_to_none=True)``, a replay after an OOM starts with one), and nothing is
    applied before the optimizer step: a step that raises can be run again from its start.
    ``tracing=True`` runs on fake tensors (no value is read back).
    """
    hooks = hooks or StepHooks()
    if isinstance(parts.optimizer, OptimizerInBackward):
        with parts.optimizer.observed(hooks):
            loss_sum = _forward_backward(parts, batches, weights, step, hooks)
        return _stepped_in_backward(parts, hooks, step, loss_sum)
    loss_sum = _forward_backward(parts, batches, weights, step, hooks)
    hooks.phase(f"step {step} optimizer", "optimizer")
    # No loss without a micro-batch (no weights): nothing for the hook to judge, as below.
    if loss_sum is not None and not hooks.losses_done(loss_sum):
        return _skipped(parts, hooks, step, loss_sum, None)
    grad_norm = None
    if parts.options.clip != "off":
        parts.precision.unscale(parts.optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = clip_gradients(parts.model, parts.options.clip, parts.options.clip_threshold,
                                   group=parts.wrapped.group if isinstance(parts.wrapped, PipelinedModel) else None)
    if not hooks.gradients_ready(grad_norm):
        return _skipped(parts, hooks, step, loss_sum, grad_norm)
    applied = parts.precision.optimizer_step(parts.optimizer, tracing=tracing)
    hooks.after_optimizer(parts.optimizer, parts.precision.scaler)
    if applied and parts.ema is not None:
        parts.ema.update(parts.model)
    hooks.phase(f"step {step} zero_grad", "zero_grad")
    parts.optimizer.zero_grad(set_to_none=True)  # gradients are dead weight until the next backward
    return StepResult(loss_sum, applied=applied, stepped=True, grad_norm=grad_norm)


def _forward_backward(
    parts: StepParts, batches: Iterator[Batch], weights: Sequence[float], step: int, hooks: StepHooks
) -> torch.Tensor | None:
    if isinstance(parts.wrapped, PipelinedModel):
        return _pipeline_forward_backward(parts, parts.wrapped, batches, weights, step, hooks)
    loss_sum: torch.Tensor | None = None
    last = len(weights) - 1
    for k, weight in enumerate(weights):
        tag = f"step {step}" + (f" micro {k + 1}" if len(weights) > 1 else "")
        hooks.phase(f"{tag} forward", "forward")
        hooks.making_batch(True)
        batch = next(batches, None)
        if batch is None:
            raise ValueError(f"train_step: {len(weights)} micro-batch weights but only {k} batches")
        batch = to_device(batch, parts.device)
        hooks.making_batch(False)
        hooks.batch(batch)
        if parts.precision.weight_dtype is not None:
            # bf16-true: the float inputs in bf16 (no second name: the fp32 batch dies here).
            batch = parts.precision.convert_input(batch)
            hooks.batch(batch)
        if loss_sum is None:
            # The window's loss, summed in place from the first forward on: a later micro-batch
            # allocates nothing that outlives it, which lets the trace derive a step of one
            # micro-batch from the first of two.
            loss_sum = torch.zeros((), dtype=torch.float32, device=parts.device)
        # DDP reduces gradients across ranks in the last micro-batch's backward only; FSDP2
        # reduce-scatters every micro-batch (its gradients stay sharded); _parallel decides.
        with _parallel.gradient_sync(parts.wrapped, k == last), sharded_loss(parts.sharded_loss):
            with (
                parts.precision.forward_context(),
                _activation_offload.offloading(parts.offload_activations, parts.device, hooks, parts.model, batch),
            ):
                # Also by 1.0: every step runs the same ops whatever its accumulation, so that
                # a step of one micro-batch is the first micro-batch of an accumulating one.
                loss = parts.loss_fn(parts.forward_model, batch) * weight
            hooks.after_forward()
            hooks.phase(f"{tag} backward", "backward")
            parts.precision.backward(loss)
        loss_sum.add_(loss.detach())
        del batch, loss  # free the batch and the graph now, as the estimate assumes
        hooks.after_backward(parts.model)
    return loss_sum


def _pipeline_forward_backward(
    parts: StepParts, piped: PipelinedModel, batches: Iterator[Batch], weights: Sequence[float], step: int,
    hooks: StepHooks
) -> torch.Tensor:
    """The window's micro-batches through the pipeline's schedule: every process loads them
    (the first stage takes the inputs, the last the targets), concatenated into the step's
    batch, which the schedule splits again; it accumulates the gradients averaged over the
    micro-batches, so the window's must be alike."""
    if len(weights) != piped.schedule._n_microbatches or len(set(weights)) > 1:
        raise ValueError(f"a pipeline step runs {piped.schedule._n_microbatches} micro-batches of one size, got "
                         f"weights {list(weights)}")
    hooks.phase(f"step {step} micro 1 forward", "forward")
    hooks.making_batch(True)
    window = []
    for k in range(len(weights)):
        batch = next(batches, None)
        if batch is None:
            raise ValueError(f"train_step: {len(weights)} micro-batch weights but only {k} batches")
        window.append(to_device(batch, parts.device))
    inputs = tree_map(lambda *t: torch.cat(t) if isinstance(t[0], torch.Tensor) else t[0], *window)
    del window
    hooks.making_batch(False)
    hooks.batch(inputs)
    if parts.precision.weight_dtype is not None:
        inputs = parts.precision.convert_input(inputs)
        hooks.batch(inputs)
    loss_sum = torch.zeros((), dtype=torch.float32, device=parts.device)
    x, targets = inputs
    del inputs
    with parts.precision.forward_context(), piped.phases(hooks, step):
        losses = piped.run(x, targets)
    for loss in losses:
        loss_sum.add_(loss.detach(), alpha=weights[0])
    del x, targets, losses
    piped.share_loss(loss_sum)
    hooks.after_backward(parts.model)
    return loss_sum


def _stepped_in_backward(parts: StepParts, hooks: StepHooks, step: int, loss_sum: torch.Tensor | None) -> StepResult:
    """The rest of a step whose parameters were stepped in backward (clipping by value too):
    no optimizer step, no gradients left to clear. A hook cannot skip it: the weights have
    changed already, so ``losses_done`` is told the loss, and its answer changes nothing."""
    hooks.phase(f"step {step} optimizer", "optimizer")
    if loss_sum is not None:
        hooks.losses_done(loss_sum)
    parts.optimizer.step()  # a no-op; a schedule checks that the optimizer stepped before it
    hooks.after_optimizer(parts.optimizer, None)
    if parts.ema is not None:
        parts.ema.update(parts.model)
    hooks.phase(f"step {step} zero_grad", "zero_grad")
    parts.optimizer.zero_grad(set_to_none=True)  # nothing left: each gradient was freed at its step
    return StepResult(loss_sum, applied=True, stepped=True, grad_norm=None)


def _skipped(
    parts: StepParts, hooks: StepHooks, step: int, loss_sum: torch.Tensor | None, grad_norm: torch.Tensor | None
) -> StepResult:
    hooks.phase(f"step {step} zero_grad", "zero_grad")
    parts.optimizer.zero_grad(set_to_none=True)  # nothing applied: weights, state and scaler untouched
    return StepResult(loss_sum, applied=False, stepped=False, grad_norm=grad_norm)


def _use_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Make an optimizer left to its default run its multi-tensor implementation.

    On CUDA, PyTorch's optimizers default to foreach kernels, which hold a temporary for every
    parameter of a group at once (Adam's ``sqrt(exp_avg_sq)`` list: the whole model's fp32
    size) where the per-tensor loop used for CPU tensors holds one parameter's; a trace for a
    CUDA target on CPU fake tensors must run what CUDA runs. A choice the model file made
    (``foreach=False``, ``fused=True``) is kept.
    """
    if "foreach" not in optimizer.defaults:
        return
    for group in optimizer.param_groups:
        if group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True
