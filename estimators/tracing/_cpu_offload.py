"""FSDP2's CPU offload in a trace for a GPU: which allocations live in host memory, and the
copies to the device that a CPU trace does not make.

The trace runs on CPU tensors, where ``CPUOffloadPolicy`` moves nothing (``.to("cpu")`` of a
CPU tensor is the tensor itself). On a card the same step keeps in host memory:

* the sharded parameters (the ``_sharded_param_data`` FSDP2 copies to the CPU at wrapping);
* their gradients (each unit's reduce-scatter output copied to the CPU, accumulated there);
* the optimizer's state, and whatever the optimizer step and clipping allocate: they run on
  the CPU, where the parameters and gradients are;
* an EMA copy of the parameters (made from the CPU parameters).

and copies each unit's shards to the device before its all-gather (``all_gather_inputs``:
``sharded_param_data.to(device)``, then the cast to the gather dtype). :func:`device_copies`
makes that copy a clone during the trace, so the replay sees the transient it is; the
allocations :func:`host_allocations` names are left out of the device's replay and counted
as host memory instead (``memory._replay``).

Not modelled: the device-side reduce-scatter output before its copy to the CPU (one unit's
gradients in the reduce dtype, for as long as the copy takes; the trace knows only the
storage that becomes the CPU gradient).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence

import torch

from ._recorder import Category, Recorder

__all__ = ["device_copies", "host_allocations"]

_HOST_CATEGORIES = (Category.GRADIENTS, Category.OPTIMIZER, Category.EMA)


@contextlib.contextmanager
def device_copies() -> Iterator[None]:
    """Within the block, FSDP2 copies an offloaded unit's shards before gathering them, as
    its host-to-device copy does on a card (a clone: on CPU tensors ``.to`` copies nothing)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState

    # The property itself (not what its getter returns), patched by name and put back.
    name = "all_gather_inputs"
    original = inspect.getattr_static(FSDPParam, name)
    assert isinstance(original, property) and original.fget is not None
    gather = original.fget

    def all_gather_inputs(self: FSDPParam) -> list[torch.Tensor]:
        if not self.offload_to_cpu or self.sharded_state != ShardedState.SHARDED \
                or hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather"):
            return gather(self)
        host = self._sharded_param_data
        self._sharded_param_data = host.clone()  # the device's copy; dies once gathered
        try:
            return gather(self)
        finally:
            self._sharded_param_data = host

    setattr(FSDPParam, name, property(all_gather_inputs))
    try:
        yield
    finally:
        setattr(FSDPParam, name, original)


def host_allocations(rec: Recorder, phase_labels: Sequence[str], sharded_params: Sequence[int]) -> list[int]:
    """The allocations of an offloaded step that live in host memory: ``sharded_params`` (the
    indices the trace gave the sharded parameters), the gradients, optimizer state and EMA,
    and everything born in an optimizer phase (the step and clipping run on the CPU)."""
    host = set(sharded_params)
    wanted = {int(c) for c in _HOST_CATEGORIES}
    host.update(i for i, c in enumerate(rec.alloc_category) if c in wanted)
    optimizer_phases = {k for k, label in enumerate(phase_labels) if label.endswith("optimizer")}
    for index, sign, phase in zip(rec.event_alloc, rec.event_sign, rec.event_phase):
        if sign > 0 and phase in optimizer_phases:
            host.add(index)
    return sorted(host)
