"""Data parallelism, applied the same way when tracing, probing and training.

How a configuration's ``strategy`` maps onto ``torch.distributed``:

* ``ddp``: ``DistributedDataParallel`` with ``gradient_as_bucket_view=True`` (gradients live
  in the communication buckets, so DDP costs no second copy of them) and the default 25 MB
  buckets (``bucket_cap_mb``). Accumulation skips gradient sync with ``no_sync()`` until the
  last micro-batch of a window.
* ``fsdp``: FSDP2 (``fully_shard``) on a 1-D device mesh: every block of the model's block
  stack (the same stack activation checkpointing uses) is one unit, then the root module;
  parameters are resharded after forward (``reshard_after_forward=True``), as torchtitan does.
  Under ``bf16-mixed``/``fp16-mixed`` the unsharded parameters are gathered in the low
  precision and gradients are reduced in fp32 (``MixedPrecisionPolicy``); autocast stays on
  around the forward pass, as in single-device training. Batch-norm layers keep fp32
  parameters (each its own unit, its inputs not cast): their running statistics stay fp32,
  and CPU batch-norm kernels refuse low-precision weights with fp32 statistics on some input
  layouts (a batch of one is both contiguous and channels-last); FSDP1's
  ``MixedPrecision`` leaves ``_BatchNorm`` out for the same reason. Under ``bf16-true``/
  ``fp16-true`` the weights are already in the low precision: no policy (gathers and
  reductions in that dtype, as torchtune shards a bf16 model); the fp32 batch-norm layers are
  their own units still, since FSDP2 wants one parameter dtype per unit. Accumulation keeps
  gradient reduction on for every micro-batch: gradients stay sharded (see
  :func:`gradient_sync`).

* ``tp > 1``: the blocks' linears are split first (``_tensor_parallel.apply_tp``) over the
  ``tp`` axis of a ``(world_size, tp)`` device mesh (``dp``, ``tp``: the ``tp`` ranks of a
  replica are neighbours, so they share a node); FSDP2 then shards over the ``dp`` axis, as
  torchtitan composes them.

Both wrappers are applied after activation checkpointing, which patches block ``forward``
methods on the instances and so survives wrapping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.nn as nn

from .._config import Precision, TrainConfig
from ._checkpoint import BlockFinder, find_block_stack
from ._precision import autocast_dtype, keeps_fp32, weight_dtype
from ._tensor_parallel import TpPlanHook, apply_tp, resolve_tp_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["DDP_BUCKET_CAP_MB", "fsdp_mp_policy", "apply_fsdp", "apply_ddp", "parallelize", "gradient_sync",
           "unwrap", "device_meshes"]

DDP_BUCKET_CAP_MB = 25
"""DDP's default bucket size; the first bucket is capped at 1 MB by DDP itself."""


class _ShardOptions(TypedDict, total=False):
    """The ``fully_shard`` options every unit of a model shares (torch's default where left out)."""

    mesh: DeviceMesh
    reshard_after_forward: bool
    offload_policy: OffloadPolicy
    mp_policy: MixedPrecisionPolicy


def fsdp_mp_policy(precision: Precision | str) -> MixedPrecisionPolicy | None:
    """The FSDP2 mixed-precision policy of a precision (``None`` for fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = autocast_dtype(precision)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module,
    *,
    precision: Precision | str = "fp32",
    mesh: DeviceMesh | None = None,
    finder: BlockFinder | None = None,
    reshard_after_forward: bool = True,
    offload: bool = False,
    device: torch.device | str | None = None,
) -> nn.Module:
    """``fully_shard`` each block of the block stack, then the root; returns the root.

    ``mesh`` defaults to a 1-D mesh over the default process group's ranks on ``device`` (by
    default the device of the model's parameters). ``offload`` keeps the sharded parameters,
    gradients and optimizer state on the CPU (``CPUOffloadPolicy``; pinned when the mesh is a
    GPU's): the model is then passed on the CPU, and FSDP2 moves each unit's buffers to the
    device while it shards the unit, so the device never holds the whole model.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        import torch.distributed as dist

        kind = (
            torch.device(device).type
            if device is not None
            else next((p.device.type for p in model.parameters()), "cpu")
        )
        mesh = init_device_mesh(kind, (dist.get_world_size(),))
    kwargs: _ShardOptions = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        # Pinned host memory makes the copies asynchronous; a CPU mesh has nothing to pin to.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    policy = fsdp_mp_policy(precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    blocks = find_block_stack(model, finder)
    if policy is not None or weight_dtype(precision) is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
        block_ids = {id(b) for b in blocks}
        for module in model.modules():
            if (
                keeps_fp32(module)
                and id(module) not in block_ids
                and any(True for _ in module.parameters(recurse=False))
            ):
                fp32_unit: _ShardOptions = {**kwargs, "mp_policy": full}
                fully_shard(module, **fp32_unit)
    for block in blocks:
        fully_shard(block, **kwargs)
    # The root keeps what the blocks do not hold (embeddings, heads, norms); it is not
    # resharded after forward because backward needs it first (torchtitan does the same).
    root: _ShardOptions = {**kwargs, "reshard_after_forward": False}
    fully_shard(model, **root)
    return model


def apply_ddp(model: nn.Module, *, device_ids: list[int] | None = None, gradient_as_bucket_view: bool = True,
              bucket_cap_mb: float = DDP_BUCKET_CAP_MB) -> nn.Module:
    """``DistributedDataParallel`` with gradients as bucket views and default buckets."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=gradient_as_bucket_view,
                                   bucket_cap_mb=bucket_cap_mb)


def device_meshes(config: TrainConfig, device_type: str) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """The data-parallel and tensor-parallel meshes of ``config`` (None where it has no such
    axis; the data-parallel one only when it is not the default 1-D mesh: under FSDP2 x TP, and
    HSDP's 2-D ``(dp_replicate, dp_shard)`` mesh, which ``fully_shard`` shards over its last
    dimension and replicates over its first)."""
    from torch.distributed.device_mesh import init_device_mesh

    if config.dp_replicate > 1:
        return init_device_mesh(device_type, (config.dp_replicate, config.shard_size),
                                mesh_dim_names=("dp_replicate", "dp_shard")), None
    if config.tp == 1:
        return None, None

    if config.world_size == 1:
        return None, init_device_mesh(device_type, (config.tp,), mesh_dim_names=("tp",))
    mesh = init_device_mesh(device_type, (config.world_size, config.tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def parallelize(
    model: nn.Module,
    config: TrainConfig,
    *,
    finder: BlockFinder | None = None,
    device_ids: list[int] | None = None,
    mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    tp_hook: TpPlanHook | None = None,
) -> nn.Module:
    """Wrap ``model`` for ``config.strategy`` (a no-op for ``single``) after splitting it for
    ``config.tp``; needs an initialised default process group for ``ddp``, ``fsdp`` and
    ``tp > 1``. ``device`` is the training device (FSDP2's mesh; with ``cpu_offload`` the model
    arrives on the CPU). ``tp_hook`` is the model file's ``tp_plan``."""
    if config.tp > 1 or config.dp_replicate > 1:
        kind = torch.device(device).type if device is not None else next(
            (p.device.type for p in model.parameters()), "cpu")
        mesh, tp_mesh = device_meshes(config, kind)
        if tp_mesh is not None:
            apply_tp(model, tp_mesh, resolve_tp_plan(model, config.tp, hook=tp_hook, finder=finder),
                     sequence_parallel=config.sequence_parallel, finder=finder)
    if config.strategy == "single":
        return model
    if config.strategy == "ddp":
        return apply_ddp(model, device_ids=device_ids)
    return apply_fsdp(
        model, precision=config.precision, mesh=mesh, finder=finder, offload=config.cpu_offload, device=device
    )


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within the block, gradients are (``enabled``) or are not reduced across ranks.

    Accumulation runs every micro-batch but the last of a window with ``enabled=False``.
    FSDP2 ignores it and reduce-scatters every micro-batch: skipping its sync would keep an
    *unsharded* gradient of every parameter alive across the window — the whole model's
    gradients on every rank, which is what FSDP is there to avoid (a 7B model: +27 GB per
    rank). torchtitan accumulates the same way.
    """
    if enabled or _is_fsdp(model):
        yield
        return
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None:  # single device: nothing to skip
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 modifies the module in place); a pipeline's
    stages of this process."""
    from torch.nn.parallel import DistributedDataParallel

    from ._pipeline import PipelinedModel

    if isinstance(model, PipelinedModel):
        return model.modules_  # this process's stages
    return model.module if isinstance(model, DistributedDataParallel) else model
