"""Gradient clipping, as the trainer does it and the trace records it."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn

__all__ = ["clip_gradients"]


def clip_gradients(model: nn.Module, mode: Literal["norm", "value"], threshold: float) -> torch.Tensor:
    """Clip in place; returns the global gradient norm before clipping (logged either way).

    Runs on fake tensors too (no ``.item()``): the norms, the total and the clip coefficient are
    the temporaries an estimate must hold. Under FSDP2 the norm is a DTensor over the shards.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    # Left to itself, clipping takes its multi-tensor kernels for real tensors only (it checks
    # ``type(t) is Tensor``) and a per-tensor loop for fake ones: other ops, other
    # temporaries. Asking for them by device runs the same kernels in the trace as in training.
    foreach = True if params and params[0].device.type in _FOREACH_DEVICES else None
    if mode == "norm":
        return torch.nn.utils.clip_grad_norm_(params, threshold, foreach=foreach)
    grads = [p.grad for p in params if p.grad is not None]  # every one (``params`` has gradients)
    norm = torch.nn.utils.get_total_norm(grads, foreach=foreach) if grads else torch.zeros(())
    torch.nn.utils.clip_grad_value_(params, threshold, foreach=foreach)
    return norm


_FOREACH_DEVICES = ("cpu", "cuda")
