"""Activation offloading (``TrainConfig.offload_activations``): the tensors autograd saves in
forward wait in host memory until backward needs them, as torchtune's ``OffloadActivations``.

:func:`offloading` is a ``torch.autograd.graph.saved_tensors_hooks`` context the step enters
around each micro-batch's forward (and loss). Every tensor autograd saves goes through
``pack``; the packed object lives in the graph until backward calls ``unpack`` on it, whether
or not the context is still entered, so one context serves forward and backward.

What is offloaded: a saved tensor of at least :data:`MIN_OFFLOAD_BYTES` (torchtune's
``min_offload_size``: a small one costs a transfer's latency for nothing) whose memory is not
a parameter's, a buffer's or the batch's (a view of one included): those stay on the device
whatever the graph does, and a host copy would only add two transfers (torchtune skips
``Parameter`` and ``Buffer`` instances only). Everything else is saved as is.

Per device:

* **CUDA** (the trainer, the probes): ``pack`` copies the tensor to pinned host memory on a
  side stream (non-blocking, after the compute stream's pending work) and drops its reference,
  so the device memory frees as soon as nothing else holds the tensor (``record_stream`` keeps
  the caching allocator from reusing it before the copy is done, where torchtune keeps a stash
  of the last five); ``unpack`` copies it back on the side stream and makes the compute stream
  wait for it. The side stream lets the copies run while the GPU works through the kernels
  queued before them, as torchtune's streams do.
* **CPU**: host memory is the device's memory, so offloading would save nothing: ``pack`` and
  ``unpack`` are the identity (a CPU run, and its measurement, allocate as without offloading).
* **A trace for a CUDA target** (fake CPU tensors under :func:`simulated_transfers`): ``pack``
  makes the host copy a new allocation the trace records as host memory and drops the trace's
  reference to the device tensor, ``unpack`` makes a new device allocation in backward, as the
  card would; the copies are reported through the step's hooks (:meth:`StepHooks.copying`
  and :meth:`StepHooks.offloaded`) so the trace prices them as transfers, not kernels.

With checkpointing the two combine as in torchtune: the non-reentrant ``checkpoint`` saves a
checkpointed block's inputs through the hooks active around it (these), and everything inside
the block through its own, which take precedence; so the blocks' inputs are offloaded and
their insides recomputed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten

from .._types import Batch

__all__ = ["MIN_OFFLOAD_BYTES", "held_storages", "offloading", "simulated_transfers", "worth_offloading"]

MIN_OFFLOAD_BYTES = 1024
"""Saved tensors below this size stay where they are (torchtune's ``min_offload_size``)."""

_SIMULATED: contextvars.ContextVar[bool] = contextvars.ContextVar("memplan_offload_simulated", default=False)


@contextlib.contextmanager
def simulated_transfers() -> Iterator[None]:
    """While active, offloading on CPU tensors runs as on a CUDA device (the trace for a CUDA
    target): host copies in forward, device copies in backward."""
    token = _SIMULATED.set(True)
    try:
        yield
    finally:
        _SIMULATED.reset(token)


class TransferObserver(Protocol):
    """What sees the simulated copies (the step's hooks: ``_step.StepHooks``)."""

    def copying(self, on: bool) -> None: ...
    def offloaded(self, tensor: torch.Tensor, where: str) -> None: ...


def held_storages(model: nn.Module, batch: Batch = None) -> set[int]:
    """Ids of the storages that outlive a micro-batch's graph: the model's parameters and
    buffers, and the batch's tensors (the step holds the batch until its backward is done)."""
    tensors = [*model.parameters(), *model.buffers(), *(t for t in tree_flatten(batch)[0]
                                                         if isinstance(t, torch.Tensor))]
    out: set[int] = set()
    for t in tensors:
        try:
            out.add(id(t.untyped_storage()))
        except (NotImplementedError, RuntimeError):  # DTensor shards, sparse tensors: no plain storage
            continue
    return out


def worth_offloading(tensor: torch.Tensor, held: set[int] | frozenset[int] = frozenset()) -> bool:
    """Whether a saved tensor is offloaded (see the module docstring); ``held``: storages that
    stay on the device anyway (:func:`held_storages`)."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        return False
    if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
        return False  # FSDP2's unsharded parameters (and their views) are not in ``held``
    if tensor.numel() * tensor.element_size() < MIN_OFFLOAD_BYTES:
        return False
    try:
        return id(tensor.untyped_storage()) not in held
    except (NotImplementedError, RuntimeError):
        return False


class _Packed:
    """An offloaded saved tensor: its host copy and the device it returns to."""

    __slots__ = ("host", "device")

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host, self.device = host, device


def offloading(enabled: bool, device: torch.device, hooks: TransferObserver, model: nn.Module,
               batch: Batch = None) -> contextlib.AbstractContextManager[None]:
    """The context a micro-batch's forward runs in: offloading hooks when ``enabled`` and the
    device (or the simulated one) keeps its memory apart from the host's, else nothing.
    ``model`` and ``batch`` hold tensors that are never offloaded (:func:`held_storages`)."""
    if not enabled:
        return contextlib.nullcontext()
    if _SIMULATED.get():
        return _simulated_hooks(hooks, held_storages(model, batch))
    if device.type == "cuda":
        return _cuda_hooks(device, held_storages(model, batch))
    return contextlib.nullcontext()  # CPU (or another device sharing host memory): nothing moves


def _simulated_hooks(hooks: TransferObserver, held: set[int]) -> saved_tensors_hooks:
    def pack(tensor: torch.Tensor) -> torch.Tensor | _Packed:
        if not worth_offloading(tensor, held):
            return tensor
        hooks.copying(True)
        try:
            with torch.no_grad():
                host = torch.empty_like(tensor, device="cpu")
                host.copy_(tensor.detach())
        finally:
            hooks.copying(False)
        hooks.offloaded(host, "host")
        return _Packed(host, tensor.device)

    def unpack(packed: torch.Tensor | _Packed) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        hooks.copying(True)
        try:
            with torch.no_grad():
                back = packed.host.clone()
        finally:
            hooks.copying(False)
        hooks.offloaded(back, "device")
        return back  # the host copy frees with the graph's saved variable, after its node ran

    return saved_tensors_hooks(pack, unpack)


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _cuda_hooks(device: torch.device, held: set[int]) -> saved_tensors_hooks:
    side = _side_stream(device)

    def pack(tensor: torch.Tensor) -> torch.Tensor | _Packed:
        if tensor.device.type != "cuda" or not worth_offloading(tensor, held):
            return tensor
        compute = torch.cuda.current_stream(tensor.device)
        side.wait_stream(compute)  # the tensor is written by kernels queued before this point
        with torch.cuda.stream(side), torch.no_grad():
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor.detach(), non_blocking=True)
        tensor.record_stream(side)  # not reused by the allocator before the copy has read it
        return _Packed(host, tensor.device)

    def unpack(packed: torch.Tensor | _Packed) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        compute = torch.cuda.current_stream(packed.device)
        with torch.cuda.stream(side), torch.no_grad():
            back = packed.host.to(packed.device, non_blocking=True)
        compute.wait_stream(side)
        back.record_stream(compute)  # allocated on the side stream, used on the compute stream
        return back

    return saved_tensors_hooks(pack, unpack)
