"""Data parallelism simulated in one process, so that any world size can be traced.

Three pieces:

* :func:`simulated_ranks` — a fake process group (``torch.testing``'s ``FakeStore``): every
  collective returns at once without moving data, so this process is "rank 0 of W". FSDP2
  (``estimators.runtime._parallel.apply_fsdp``) runs on it as is, on fake or real tensors.
* :class:`EmulatedDDP` — ``DistributedDataParallel``'s C++ reducer touches tensor data (bucket
  rebuilds, the comm hook) and cannot run on fake tensors, so its memory behaviour is
  reproduced here with the options ``_parallel.apply_ddp`` uses (checked against the real
  thing under gloo by ``tests/estimators/estimator/test_distributed_estimate.py``):

  - at construction, one flat gradient bucket per dtype holds every trainable parameter's
    gradient (torch >= 2.x buckets everything together until the first backward has shown the
    real gradient order);
  - with ``gradient_as_bucket_view=True`` the gradient AccumulateGrad produces is copied into
    its bucket view (divided by W on the way) and ``.grad`` is replaced by the view, so the
    produced gradient dies right away;
  - ``no_sync`` micro-batches skip all of that: their gradients accumulate outside the
    buckets, and the synchronised micro-batch copies them in;
  - in the first forward after a synchronised backward the buckets are rebuilt in the order
    gradients became ready, capped at ``bucket_cap_mb`` each: the old buckets are freed first,
    then the new ones are allocated.

* :func:`fsdp_storage_events` — FSDP2 frees and re-allocates unsharded parameters and
  all-gather outputs with ``storage.resize_(0)`` / ``storage.resize_(n)``, which no dispatch
  mode sees; during a trace its ``alloc_storage``/``free_storage`` report to the recorder.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, overload

import torch
import torch.nn as nn

from .._config import TrainConfig
from .._errors import ConfigError
from ..runtime._checkpoint import BlockFinder, find_block_stack
from ..runtime._parallel import DDP_BUCKET_CAP_MB, apply_fsdp, device_meshes
from ..runtime._tensor_parallel import TpPlanHook, apply_tp, resolve_tp_plan

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ._recorder import Recorder

__all__ = ["simulated_ranks", "dtensor_propagation_unrecorded", "BucketObserver", "EmulatedDDP", "fsdp_storage_events", "parallelize_simulated", "local_tensor",
           "FsdpUnits", "fsdp_units", "ddp_bucket_bytes"]

_MB = 1024 * 1024
# One simulated world at a time: the default process group is global state.
_PG_LOCK = threading.Lock()


@contextlib.contextmanager
def simulated_ranks(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks (this process is ``rank``: a
    pipeline's stage is its rank's).

    Raises ``ConfigError`` when a real process group is already initialised: the simulation
    would have to replace it. The group is destroyed on exit, whatever happens inside.
    """
    import torch.distributed as dist

    with _PG_LOCK:
        if dist.is_initialized():
            raise ConfigError(
                "a torch.distributed process group is already initialised in this process; "
                "estimate ddp/fsdp configurations before init_process_group() or in another "
                "process (the estimator simulates the ranks with a fake process group)"
            )
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            with _sends_held():
                yield
        finally:
            dist.destroy_process_group()


class _HeldSend:
    """A send's work that keeps the tensor sent for as long as the work lives, as a real
    backend's does (gloo's work holds its tensors until it is destroyed, after its wait); the
    fake group's holds nothing, and a gradient a pipeline stage sends back would die before the
    schedule lets go of the work."""

    def __init__(self, work: object, tensors: list[torch.Tensor]) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args: object, **kwargs: object) -> object:
        return self._work.wait(*args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._work, name)


@contextlib.contextmanager
def _sends_held() -> Iterator[None]:
    """Pipeline schedules send through ``schedules._batch_p2p``: its works hold what they send."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def held(ops: list[dist.P2POp], desc: str | None = None) -> list[object]:
        sent = [op.tensor for op in ops if op.op is dist.isend]
        return [_HeldSend(w, sent) for w in original(ops, desc=desc)]

    schedules._batch_p2p = held  # type: ignore[assignment]
    try:
        yield
    finally:
        schedules._batch_p2p = original


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard behind a ``DTensor`` (FSDP2 parameters, gradients and optimizer
    state); any other tensor as is."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class BucketObserver(Protocol):
    """What :class:`EmulatedDDP` tells of its buckets (``_depth.tagged_blocks`` listens)."""

    def making(self, param: torch.Tensor | None) -> None:
        """What follows is for ``param``'s gradient (a bucket is its first parameter's); None:
        the buckets are made."""

    def views(self, views: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The buckets were made: each parameter and its gradient's view."""


class EmulatedDDP(nn.Module):
    """What ``DistributedDataParallel(gradient_as_bucket_view=True)`` allocates, on any tensors.

    Offers ``set_requires_gradient_sync`` so that ``_parallel.gradient_sync`` drives it the
    way it drives FSDP2. Collectives are not issued: on the fake process group they move no
    data, and their time is modelled by ``estimators.timing._comm``.
    """

    def __init__(self, module: nn.Module, *, world_size: int, bucket_cap_mb: float = DDP_BUCKET_CAP_MB) -> None:
        super().__init__()
        self.module = module
        self._world_size = world_size
        self._cap = int(bucket_cap_mb * _MB)
        # DDP reduces the distinct parameters that require gradients, in registration order.
        self._params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        self._sync = True
        self._ready: list[int] = []
        self._rebuilt = False
        self.buckets: list[torch.Tensor] = []
        self._views: dict[int, torch.Tensor] = {}
        self.observer: BucketObserver | None = None
        """Told of each bucket made and of the gradient views in it (a trace tagging blocks)."""
        self._assign([sys.maxsize], list(range(len(self._params))))
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    def _assign(self, limits: list[int], order: list[int]) -> None:
        import torch.distributed as dist

        tensors: list[torch.Tensor] = [self._params[i] for i in order]
        groups, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
        # The reducer drops its buckets before allocating the new ones.
        self.buckets, self._views = [], {}
        if self.observer is not None:
            self.observer.views([])  # the old views are gone (their ids may be reused)
        observer = self.observer
        for group in groups:
            members = [tensors[j] for j in group]
            total = sum(p.numel() for p in members)
            if observer is not None:
                observer.making(members[0])
            bucket = torch.empty(total, dtype=members[0].dtype, device=members[0].device)
            offset = 0
            for p in members:
                if observer is not None:
                    observer.making(p)
                self._views[id(p)] = bucket[offset: offset + p.numel()].view(p.shape)
                offset += p.numel()
            self.buckets.append(bucket)
        if observer is not None:
            observer.making(None)
            observer.views(self.views())

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each parameter and the view of its gradient in its bucket."""
        return [(p, self._views[id(p)]) for p in self._params if id(p) in self._views]

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if not self._sync or p.grad is None:
                return
            if not self._rebuilt:
                self._ready.append(index)
            view = self._views[id(p)]
            if p.grad is view:
                view.div_(self._world_size)
            else:
                # Divide while copying into the bucket, as the reducer does (no temporary).
                torch.mul(p.grad, 1.0 / self._world_size, out=view)
                p.grad = view
        return hook

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self._sync = requires_gradient_sync

    def forward(self, *args: object, **kwargs: object) -> object:
        if torch.is_grad_enabled() and not self._rebuilt and self._ready:
            # Rebuilt once, in gradient-ready order, with the configured cap for every bucket.
            self._rebuilt = True
            self._assign([self._cap], list(dict.fromkeys(self._ready)))
        return self.module(*args, **kwargs)


@contextlib.contextmanager
def fsdp_storage_events(on_alloc: Callable[[torch.Tensor], None], on_free: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Report FSDP2's storage resizes: ``on_free(t)`` before a storage of ``t`` is resized to
    0, ``on_alloc(t)`` after it is resized back up (a new allocation of the new size)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    original_alloc, original_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor: torch.Tensor) -> None:
        before = tensor.untyped_storage().size()
        original_alloc(tensor)
        if tensor.untyped_storage().size() != before:
            if before:
                on_free(tensor)
            on_alloc(tensor)

    def free_storage(tensor: torch.Tensor) -> None:
        if tensor.untyped_storage().size() != 0:
            on_free(tensor)
        original_free(tensor)

    patched = [
        (_fsdp_param, "alloc_storage", alloc_storage),
        (_fsdp_param, "free_storage", free_storage),
        (_fsdp_param_group, "alloc_storage", alloc_storage),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patched if hasattr(mod, name)]
    try:
        for mod, name, fn in patched:
            if hasattr(mod, name):
                setattr(mod, name, fn)
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def parallelize_simulated(
    model: nn.Module,
    config: TrainConfig,
    *,
    finder: BlockFinder | None = None,
    mode: FakeTensorMode | None = None,
    tp_hook: TpPlanHook | None = None,
    example: Callable[[], object] | None = None,
) -> nn.Module:
    """Wrap ``model`` for ``config`` inside :func:`simulated_ranks`: split for ``config.tp``
    (``_tensor_parallel.apply_tp``), then FSDP2 itself (``_parallel.apply_fsdp``), or
    :class:`EmulatedDDP` with ``_parallel.apply_ddp``'s options.

    ``mode`` (a fake-tensor mode) is entered for the wrapping only: the device meshes are
    built outside it, as their rank tables must be real tensors (a 2-D mesh's ``dp`` and ``tp``
    slices too).

    A pipeline (``config.pp > 1``) is cut into stages, this rank's built (``_pipeline``), on
    the micro-batch inputs ``example()`` makes in ``mode``.
    """
    if config.pp > 1:
        import torch.distributed as dist

        from ..runtime._pipeline import build_pipeline, pipeline_inputs

        assert example is not None, "a pipeline is cut on an example micro-batch"
        with mode if mode is not None else contextlib.nullcontext():
            return build_pipeline(model, config, pipeline_inputs(example()), finder=finder,
                                  device=torch.device("cpu"), rank=dist.get_rank())
    if config.strategy == "single" and config.tp == 1:
        return model
    mesh, tp_mesh = device_meshes(config, "cpu")  # HSDP's 2-D data-parallel mesh too
    if config.strategy == "fsdp" and mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (config.world_size,))
    with mode if mode is not None else contextlib.nullcontext(), _meshes_made_real():
        if tp_mesh is not None:
            apply_tp(model, tp_mesh, resolve_tp_plan(model, config.tp, hook=tp_hook, finder=finder),
                 sequence_parallel=config.sequence_parallel, finder=finder)
        if config.strategy == "single":
            return model
        if config.strategy == "ddp":
            return EmulatedDDP(model, world_size=config.world_size)
        with _chunks_made_when_asked():
            return apply_fsdp(model, precision=config.precision, mesh=mesh, finder=finder, offload=config.cpu_offload)


class _Chunks(Sequence[torch.Tensor]):
    """``torch.chunk(tensor, n, dim)``'s pieces, padded with empty tensors to ``n`` as FSDP2's
    ``_chunk_with_empty`` pads them, each made (as the same view) only when asked for."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int) -> None:
        self._tensor, self._n, self._dim = tensor, n, dim
        size = tensor.size(dim)
        self._step = -(-size // n)  # torch.chunk's piece: the size over n, rounded up
        self._pieces = -(-size // self._step) if size else n  # an empty dimension: n empty pieces

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        if i >= self._pieces:
            return self[0].new_empty(0)
        size = self._tensor.size(self._dim)
        start = i * self._step
        return self._tensor.narrow(self._dim, start, min(self._step, size - start))


@contextlib.contextmanager
def _chunks_made_when_asked() -> Iterator[None]:
    """FSDP2 cuts each parameter into one piece per rank to keep its own (and the first, for
    the padding): at hundreds of simulated ranks, the other views (fake tensors, each recorded)
    made most of the wrapping's time. While FSDP2 shards here, the pieces are made as asked."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = _fsdp_param._chunk_with_empty
    _fsdp_param._chunk_with_empty = _Chunks  # type: ignore[assignment]
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


@contextlib.contextmanager
def _meshes_made_real() -> Iterator[None]:
    """FSDP2 joins the ``dp`` and ``tp`` meshes of a 2-D layout (``DeviceMesh._concatenate``)
    while it shards, inside the fake-tensor mode; a mesh's rank table must be real (its
    coordinates are found with ``nonzero``), so the join runs with the mode set aside."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__["_concatenate"]

    def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
        with unset_fake_temporarily():
            return original.__func__(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        DeviceMesh._concatenate = original  # type: ignore[method-assign]


@contextlib.contextmanager
def dtensor_propagation_unrecorded(rec: Recorder) -> Iterator[None]:
    """DTensor works out an op's output shapes by running it on fake tensors of the global
    shapes (``ShardingPropagator._propagate_tensor_meta_non_cached``); those ops are no part of
    a rank's step, and ``rec`` does not record them."""
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: ShardingPropagator, op_schema: OpSchema) -> object:
        rec.unrecorded += 1
        try:
            return original(self, op_schema)
        finally:
            rec.unrecorded -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


@dataclass(frozen=True, slots=True)
class FsdpUnits:
    """Parameter elements of each FSDP2 unit in forward order: the root's own parameters
    (embeddings, heads, norms) first, then each block of the block stack."""

    root_numel: int
    block_numels: tuple[int, ...]
    root_trainable: int = 0
    """Elements of the root's parameters that require gradients."""
    block_trainables: tuple[int, ...] = ()
    """The same per block."""


def fsdp_units(model: nn.Module, finder: BlockFinder | None = None) -> FsdpUnits:
    blocks = find_block_stack(model, finder)
    in_blocks: set[int] = set()
    numels, trainables = [], []
    for block in blocks:
        n = t = 0
        for p in block.parameters():
            if id(p) not in in_blocks:
                in_blocks.add(id(p))
                n += p.numel()
                t += p.numel() if p.requires_grad else 0
        numels.append(n)
        trainables.append(t)
    root = [p for p in dict.fromkeys(model.parameters()) if id(p) not in in_blocks]
    return FsdpUnits(
        sum(p.numel() for p in root), tuple(numels), sum(p.numel() for p in root if p.requires_grad), tuple(trainables)
    )


def ddp_bucket_bytes(model: nn.Module, bucket_cap_mb: float = DDP_BUCKET_CAP_MB) -> list[int]:
    """Bytes of DDP's rebuilt buckets in all-reduce order (gradients become ready roughly in
    reverse registration order), each closed once it reaches the cap."""
    cap = int(bucket_cap_mb * _MB)
    sizes: list[int] = []
    current = 0
    for p in reversed([p for p in dict.fromkeys(model.parameters()) if p.requires_grad]):
        current += p.numel() * p.element_size()
        if current >= cap:
            sizes.append(current)
            current = 0
    if current:
        sizes.append(current)
    return sizes
