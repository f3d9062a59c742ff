"""Gradient clipping, as the trainer does it and the trace records it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn as nn

__all__ = ["clip_gradients"]


def clip_gradients(model: nn.Module, mode: Literal["norm", "value"], threshold: float, *,
                   group: object | None = None) -> torch.Tensor:
    """Clip in place; returns the global gradient norm before clipping (logged either way).

    Runs on fake tensors too (no ``.item()``): the norms, the total and the clip coefficient are
    the temporaries an estimate must hold. Under FSDP2 the norm is a DTensor over the shards.
    ``group``: a pipeline's process group, whose stages hold the other parameters: the norm is
    summed over it (torchtitan's ``clip_grad_norm_`` with its ``pp_mesh``).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if group is not None:
        return _clip_over_stages(params, mode, threshold, group)
    # Left to itself, clipping takes its multi-tensor kernels for real tensors only (it checks
    # ``type(t) is Tensor``) and a per-tensor loop for fake ones: other ops, other
    # temporaries. Asking for them by device runs the same kernels in the trace as in training.
    foreach = True if params and params[0].device.type in _FOREACH_DEVICES else None
    groups = _by_mesh(params)
    if mode == "norm" and len(groups) > 1:
        return _clip_norm_over_meshes(groups, threshold, foreach)
    if mode == "norm":
        return torch.nn.utils.clip_grad_norm_(params, threshold, foreach=foreach)
    grads = [p.grad for p in params if p.grad is not None]  # every one (``params`` has gradients)
    norm = torch.nn.utils.get_total_norm(grads, foreach=foreach) if grads else torch.zeros(())
    torch.nn.utils.clip_grad_value_(params, threshold, foreach=foreach)
    return norm


_FOREACH_DEVICES = ("cpu", "cuda")


def _clip_over_stages(params: Sequence[torch.Tensor], mode: str, threshold: float, group: object) -> torch.Tensor:
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    foreach = True if params and params[0].device.type in _FOREACH_DEVICES else None
    local = torch.nn.utils.get_total_norm(grads, foreach=foreach) if grads else torch.zeros(())
    squared = local.float() ** 2
    dist.all_reduce(squared, group=group)
    total = squared.sqrt()
    if mode == "norm":
        torch.nn.utils.clip_grads_with_norm_(params, threshold, total, foreach=foreach)
    else:
        torch.nn.utils.clip_grad_value_(params, threshold, foreach=foreach)
    return total


def _by_mesh(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters grouped by the device mesh of their (DTensor) gradients, in order; plain
    gradients are one group. FSDP2 x TP shards the split linears over a 2-D mesh and the rest
    over its ``dp`` axis: DTensor ops refuse operands of two meshes."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return list(groups.values())


def _clip_norm_over_meshes(groups: list[list[torch.Tensor]], threshold: float, foreach: bool | None) -> torch.Tensor:
    # Each mesh's norm in full (a DTensor's is reduced over its mesh), then the norm of those.
    from torch.distributed.tensor import DTensor, Replicate

    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups:
        grad = group[0].grad
        mesh = getattr(grad, "device_mesh", None)
        local = (DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim) if mesh is not None else total)
        torch.nn.utils.clip_grads_with_norm_(group, threshold, local, foreach=foreach)
    return total
