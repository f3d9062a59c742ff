"""Precision, applied the same way when tracing, probing and training.

fp32 runs as is; ``bf16-mixed`` runs the forward pass (and loss) under autocast with fp32
weights and no scaler; ``fp16-mixed`` does the same in float16 and scales the loss with a
``GradScaler`` so that small gradients survive the fp16 range.

``bf16-true`` and ``fp16-true`` (Lightning's names; torchtune fine-tunes in ``bf16-true``) hold
the weights, and so the gradients and optimizer state, in the low precision: 8 bytes a
parameter under Adam instead of 16, and no fp32 master copy. :func:`cast_model` casts the
built model's floating-point parameters and buffers, :func:`convert_input` the batch's
floating-point tensors, and :func:`forward_context` makes the low precision the default dtype
for tensors the forward creates (as Lightning's ``HalfPrecision`` does); no autocast runs.
Batch-norm layers keep fp32 weights and running statistics, as apex's O2
(``keep_batchnorm_fp32``) does: bf16's 8-bit mantissa cannot hold a momentum-0.1 running
average (a change below ~4% of the running value rounds away), the layers are a few
thousand elements, and CPU and cuDNN batch norm take bf16/fp16 inputs with fp32 weights.

Neither needs a GradScaler: bf16 has fp32's exponent range; for ``fp16-true`` torch's
``GradScaler`` refuses fp16 gradients ("Attempting to unscale FP16 gradients", since the
unscaled values would overflow in fp16 anyway) and Lightning's ``16-true`` runs without one.
``fp16-true`` is therefore fragile (gradients below 6e-8 vanish, Adam's default ``eps=1e-8``
rounds to 0 in fp16) and is never searched unless asked for.

:class:`StepPrecision` is a precision chosen once, as Lightning Fabric's precision plugin is:
built from the name, the device type, whether FSDP shards the scaler and the scaler's
settings, it holds the GradScaler and does what the step asks of the precision (the forward's
context, the batch's conversion, the backward, the unscale before clipping, the optimizer
step), so that the trace, the probes and the trainer hand the step one object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypedDict

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .._config import Precision, normalize_precision
from .._types import Batch

__all__ = [
    "autocast_dtype",
    "weight_dtype",
    "keeps_fp32",
    "cast_model",
    "convert_input",
    "forward_context",
    "make_grad_scaler",
    "ScalerSettings",
    "backward",
    "optimizer_step",
    "StepPrecision",
]


def autocast_dtype(precision: Precision | str) -> torch.dtype | None:
    """The autocast dtype of a precision, or ``None`` for fp32."""
    p = normalize_precision(precision)
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(p)


def weight_dtype(precision: Precision | str) -> torch.dtype | None:
    """The dtype the weights are cast to (``bf16-true``/``fp16-true``), or ``None``: as built.

    >>> weight_dtype("bf16-true"), weight_dtype("bf16-mixed")
    (torch.bfloat16, None)
    """
    p = normalize_precision(precision)
    return {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}.get(p)


def keeps_fp32(module: nn.Module) -> bool:
    """Modules whose parameters and buffers a true low precision leaves in fp32 (batch norm)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def cast_model(model: nn.Module, precision: Precision | str) -> nn.Module:
    """Cast ``model``'s floating-point parameters and buffers in place to the precision's
    weight dtype (a no-op for fp32 and mixed precision); batch-norm layers stay fp32.

    In place (``Parameter.data`` is replaced, as ``Module.to`` does), so tied weights stay
    tied and the parameters stay the objects an optimizer or a hook may already hold. Runs on
    fake tensors too (the trace's model).

    >>> m = cast_model(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), "bf16-true")
    >>> m[0].weight.dtype, m[1].weight.dtype, m[1].running_mean.dtype
    (torch.bfloat16, torch.float32, torch.float32)
    """
    dtype = weight_dtype(precision)
    if dtype is None:
        return model
    cast_buffers: dict[int, torch.Tensor] = {}  # a buffer held by two modules stays one tensor
    for module in model.modules():
        if keeps_fp32(module):
            continue
        for p in module._parameters.values():
            # ``.data``, not ``Module._apply``: on fake tensors ``_apply`` swaps tensors, which
            # their fake mode's weak references forbid.
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                module._buffers[name] = cast_buffers.setdefault(id(b), b.to(dtype))
    return model


def convert_input(batch: Batch, precision: Precision | str) -> Batch:
    """The batch with its floating-point tensors in the weight dtype under a true low
    precision (integer tensors, token ids and labels, are left alone); else ``batch`` itself."""
    dtype = weight_dtype(precision)
    if dtype is None:
        return batch
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch)


@contextlib.contextmanager
def forward_context(precision: Precision | str, device_type: str) -> Iterator[None]:
    """Around the forward pass and the loss (not around backward): autocast under mixed
    precision; under a true low precision, that dtype as the default for new tensors."""
    low = weight_dtype(precision)
    if low is not None:
        default = torch.get_default_dtype()
        torch.set_default_dtype(low)
        try:
            yield
        finally:
            torch.set_default_dtype(default)
        return
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=dtype):
        yield


class ScalerSettings(TypedDict, total=False):
    """``torch.amp.GradScaler``'s settings, each left out for torch's default."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int


def make_grad_scaler(
    precision: Precision | str,
    device_type: str,
    *,
    sharded: bool = False,
    init_scale: float | None = None,
    growth_factor: float | None = None,
    backoff_factor: float | None = None,
    growth_interval: int | None = None,
) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16-mixed only: bf16 has fp32's exponent range and needs none, and
    ``fp16-true`` runs without one (torch's scaler refuses fp16 gradients; see the module's
    docstring).

    ``sharded`` (FSDP2): every rank sees only its gradient shards, so the sharded scaler
    all-reduces whether any rank found inf/NaN, and all of them skip (or take) the same step.

    The keyword arguments are ``torch.amp.GradScaler``'s (``None``: torch's default). They change
    no memory: the scale and its growth tracker are one-element tensors whatever their values.

    Example:
        >>> make_grad_scaler("fp16-mixed", "cpu", init_scale=1024.0).get_scale()
        1024.0
    """
    if normalize_precision(precision) != "fp16-mixed":
        return None
    kwargs: ScalerSettings = {}
    if init_scale is not None:
        kwargs["init_scale"] = init_scale
    if growth_factor is not None:
        kwargs["growth_factor"] = growth_factor
    if backoff_factor is not None:
        kwargs["backoff_factor"] = backoff_factor
    if growth_interval is not None:
        kwargs["growth_interval"] = growth_interval
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, **kwargs)
    return torch.amp.GradScaler(device_type, **kwargs)


def backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    """Backward of the (already accumulation-divided) loss, scaled under fp16."""
    (scaler.scale(loss) if scaler is not None else loss).backward()


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    *,
    tracing: bool = False,
) -> bool:
    """One optimizer step; returns False when the scaler skipped it (inf/NaN gradients).

    Callers that clip gradients call ``scaler.unscale_(optimizer)`` first; unscaling twice is
    guarded by the scaler itself. ``tracing=True`` is for fake tensors: ``GradScaler.step``
    reads ``found_inf`` with ``.item()``, which has no value under fake tensors, so the trace
    does the same tensor work (unscale, step, update) without the data-dependent branch.
    """
    if scaler is None:
        optimizer.step()
        return True
    if tracing:
        if scaler._per_optimizer_states[id(optimizer)]["stage"].name != "UNSCALED":
            scaler.unscale_(optimizer)
        optimizer.step()
        _update_scaler_for_trace(scaler, optimizer)
        return True
    scale_before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() >= scale_before


def _update_scaler_for_trace(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    # Same kernels GradScaler.update() launches: sum the found_inf flags, then the in-place
    # scale update. Skipping the Python-level bookkeeping keeps it free of .item().
    state = scaler._per_optimizer_states[id(optimizer)]
    found = list(state["found_inf_per_device"].values())
    found_inf = found[0]
    for extra in found[1:]:
        found_inf = found_inf + extra
    # Set by the scaler's first scale(), which every traced backward ran.
    assert scaler._scale is not None and scaler._growth_tracker is not None
    torch._amp_update_scale_(
        scaler._scale,
        scaler._growth_tracker,
        found_inf,
        scaler._growth_factor,
        scaler._backoff_factor,
        scaler._growth_interval,
    )
    scaler._per_optimizer_states.clear()


class StepPrecision:
    """One precision, chosen once: ``name`` (a ``TrainConfig.precision``) on ``device_type``, and
    its ``scaler`` (fp16-mixed's GradScaler, FSDP2's sharded one when ``sharded``; None otherwise),
    made with ``scaler_settings`` (torch's defaults for those left out).

    Its methods are the step's uses of the precision; each runs the module's function of the
    same name with this precision's name and scaler (no work of its own, so a step through the
    object runs the ops a step through the functions ran).

    Example:
        >>> p = StepPrecision("fp16-mixed", "cpu", scaler_settings={"init_scale": 8.0})
        >>> p.scaler.get_scale(), StepPrecision("bf16-true", "cpu").weight_dtype
        (8.0, torch.bfloat16)
    """

    def __init__(self, name: Precision | str, device_type: str, *, sharded: bool = False,
                 scaler_settings: ScalerSettings | None = None) -> None:
        self.device_type, self.sharded = device_type, sharded
        self.scaler_settings: ScalerSettings = scaler_settings.copy() if scaler_settings else {}
        self.name: str = name
        self.weight_dtype: torch.dtype | None = weight_dtype(name)
        """The true low precision's weight dtype (the batch is converted to it), or None."""
        self.scaler: torch.amp.GradScaler | None = make_grad_scaler(
            name, device_type, sharded=sharded, **self.scaler_settings
        )

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        """Around the forward pass and the loss: :func:`forward_context`."""
        return forward_context(self.name, self.device_type)

    def convert_input(self, batch: Batch) -> Batch:
        """bf16-true/fp16-true: the batch's floating-point tensors in the weights' dtype
        (:func:`convert_input`); else ``batch`` itself."""
        return convert_input(batch, self.name)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the loss, scaled under fp16-mixed (:func:`backward`)."""
        backward(loss, self.scaler)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: the true gradients, not the scaled ones (a no-op without a scaler)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *, tracing: bool = False) -> bool:
        """One optimizer step; False when the scaler skipped it (:func:`optimizer_step`)."""
        return optimizer_step(optimizer, self.scaler, tracing=tracing)

    def state_dict(self) -> dict[str, Any] | None:
        """The scaler's state (None without a scaler): a checkpoint's ``scaler`` entry."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore the scaler's state (nothing to restore without a scaler or a state)."""
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)
