"""What the trace records: each storage's birth (an op's output) and death (a weak reference),
its category, the phase it falls in, and each op's FLOPs and bytes moved.

Storages are keyed by their Python object, which PyTorch keeps alive exactly as long as the
storage itself. :class:`RecordingHooks` are the trace's :class:`~estimators.runtime._step.StepHooks`:
they name the phases and mark what each allocation holds.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.nn as nn
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from .._types import Batch
from ..runtime._step import StepHooks
from . import _simulated_ranks as _distributed

__all__ = ["DEFERRED", "BlockTags", "Category", "OnCompute", "OpRecord", "Recorder", "RecordingHooks", "PHASES",
           "recorded_rng_states"]

OnCompute: TypeAlias = Callable[[int, OpOverload, Sequence[object], Mapping[str, object]], None]
"""``on_compute(index, func, args, kwargs)``: shown each op whose FLOPs torch counts."""

_Released: TypeAlias = Callable[["weakref.ref[torch.UntypedStorage]"], None]


class Category(enum.IntEnum):
    """What an allocation holds (the breakdown of an estimate)."""

    PARAMS = 0
    BUFFERS = 1
    BATCH = 2
    ACTIVATIONS = 3
    GRADIENTS = 4
    OPTIMIZER = 5
    TEMPORARIES = 6
    WORKSPACE = 7
    EMA = 8
    OFFLOADED = 9
    """Host copies of offloaded activations (``TrainConfig.offload_activations``): host memory."""

    @property
    def label(self) -> str:
        return {
            0: "params", 1: "buffers", 2: "batch", 3: "activations", 4: "gradients",
            5: "optimizer", 6: "temporaries", 7: "workspace", 8: "ema", 9: "offloaded",
        }[int(self)]


PHASES = ("setup", "forward", "backward", "optimizer", "zero_grad")


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One aten op of the trace, for the time model and workspace measurement."""

    name: str
    phase: int
    flops: int
    bytes_moved: int
    dtype: str
    """Dtype of the op's first floating input ("float32", "bfloat16", …)."""
    new_bytes: int = 0
    """Bytes of the storages the op created."""
    moves_data: bool = True
    """False for views, metadata and fake-tensor bookkeeping ops: they cost no kernel."""

    @property
    def significant(self) -> bool:
        """Ops that allocate or compute: the ones real and fake runs share (fake tensors add
        bookkeeping ops such as ``prim.device`` and ``detach`` that a real run lacks)."""
        return self.new_bytes > 0 or self.flops > 0


DEFERRED = -2
"""The tag of what a factory op makes outside any block until an op shows whose it is."""


class BlockTags:
    """Which block of the model's block stack each allocation, event and op of a trace belongs
    to (-1: none), for composing the trace of a deeper stack (``_compose``).

    Inside a block's forward or backward (``block``, set by ``_depth.tagged_blocks``' hooks)
    everything recorded is that block's. Outside, an allocation belongs to the block its op's
    inputs belong to (the ``i``-th output of a ``_foreach_`` op: its ``i``-th input's), to
    none when they belong to several or to none; what an op without inputs makes (the scalar
    ``step`` Adam makes before each parameter's moments) belongs to the block of the next op
    with recorded inputs, unless a block starts or ends first (:meth:`resolve`). An op belongs to its outputs'
    (else its inputs') block; an event to its allocation's block. A free outside any block also
    notes the block of the op it follows (``after_op``): ``_compose`` gives a burst of frees
    of one block's allocations to that op's block when it is the same or a neighbour (a loop
    over the parameters drops the last parameter's temporary while it works on the next one).
    """

    __slots__ = ("block", "alloc", "event", "after_op", "op", "last_op", "views", "_deferred")

    def __init__(self) -> None:
        self.block = -1
        """The block whose forward or backward runs now; -1 between blocks."""
        self.last_op = -1
        """Outside any block: the block of the last op recorded, or of the block that just ended."""
        self.alloc: list[int] = []
        self.event: list[int] = []
        self.after_op: list[int] = []
        """Per event: for a free outside any block, the block of the op before it (else -1)."""
        self.op: list[int] = []
        self.views: dict[int, int] = {}
        """id of a view -> its block, where the view's storage is no block's (DDP's gradient
        views into a bucket shared by several blocks' parameters)."""
        self._deferred: list[tuple[list[int], int]] = []  # (column, row) waiting for a block

    def defer(self, column: list[int], row: int) -> None:
        self._deferred.append((column, row))

    def resolve(self, block: int) -> None:
        """What waits for a block is ``block``'s."""
        for column, row in self._deferred:
            column[row] = block
        self._deferred.clear()

    def enter(self, block: int) -> None:
        """``block`` runs now (-1: none); what waits belongs to no block. Frees right after a
        block ends follow it as they would its last op."""
        self.resolve(-1)
        self.last_op = self.block if block < 0 else -1
        self.block = block

    def reset(self) -> None:
        """A new phase: no block runs."""
        self.enter(-1)


class Recorder(TorchDispatchMode):
    """Records storage births (op outputs) and deaths (weakref callbacks)."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc_bytes: list[int] = []
        self.alloc_category: list[int] = []
        self.event_alloc: list[int] = []
        self.event_sign: list[int] = []
        self.event_phase: list[int] = []
        self.phase = 0
        self.live: dict[int, int] = {}  # id(storage) -> allocation index
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.ops: list[OpRecord] = []
        self.op_positions: list[int] = []  # per op: event position right after its outputs
        self.op_new_bytes: list[int] = []  # per op: bytes of the storages it created
        self.quiet = False  # batch creation is not part of the step's ops
        self.label_ops = False  # wrap ops in profiler ranges (real runs measuring workspaces)
        # Shown each compute op's index, func, args and kwargs (workspace fits keep them to replay).
        self.on_compute: OnCompute | None = None
        self.host: list[int] = []  # allocations in host memory whatever the device
        self.resized: list[int] = []  # allocations freed by resizing their storage to 0
        self.tags: BlockTags | None = None  # the block of each allocation, event and op, when asked
        self._pending = -1  # outside any block: the block the outputs being tracked belong to
        self.below_dtensor = False
        """Record the local ops DTensor runs instead of its own (tensor parallelism): the shard's
        shapes are the memory and the FLOPs of a rank; see :meth:`_dtensor_op`."""
        self._in_dtensor = False
        self.unrecorded = 0  # > 0: ops that are no part of the step (DTensor's shape propagation)

    # storages --------------------------------------------------------------------------
    def track(self, tensor: torch.Tensor, category: Category = Category.TEMPORARIES) -> int | None:
        try:
            # FSDP2's parameters, gradients and optimizer state are DTensors: the memory is
            # their local shard's.
            storage = _distributed.local_tensor(tensor).untyped_storage()
        except (NotImplementedError, RuntimeError):
            return None  # sparse / nested tensors without a plain storage
        key = id(storage)
        index = self.live.get(key)
        if index is not None:
            return index
        nbytes = int(storage.nbytes())
        index = len(self.alloc_bytes)
        self.alloc_bytes.append(nbytes)
        self.alloc_category.append(int(category))
        if self.tags is not None:
            tag = self.tags.block if self.tags.block >= 0 else self._pending
            if tag == DEFERRED:
                self.tags.defer(self.tags.alloc, len(self.tags.alloc))
            self.tags.alloc.append(tag)
        self.live[key] = index
        self._event(index, +1)
        self._refs[key] = weakref.ref(storage, functools_partial(self._released, key))
        return index

    def _released(self, key: int, _ref: object) -> None:
        index = self.live.pop(key, None)
        self._refs.pop(key, None)
        if index is not None:
            self._event(index, -1)

    def resized_down(self, tensor: torch.Tensor) -> None:
        """The storage of ``tensor`` is about to be resized to 0 bytes (FSDP2 freeing an
        unsharded parameter): a free, though the storage object lives on."""
        key = id(tensor.untyped_storage())
        index = self.live.pop(key, None)
        self._refs.pop(key, None)  # the dropped weakref will not report the storage's death
        if index is not None:
            self._event(index, -1)
            self.resized.append(index)

    def resized_up(self, tensor: torch.Tensor) -> None:
        """The storage of ``tensor`` was resized from 0 bytes: a new allocation of its size."""
        self.track(tensor, Category.PARAMS)

    def _event(self, index: int, sign: int) -> None:
        self.event_alloc.append(index)
        self.event_sign.append(sign)
        self.event_phase.append(self.phase)
        if self.tags is not None:
            tags = self.tags
            tag = tags.block if tags.block >= 0 else tags.alloc[index]
            tags.after_op.append(tags.last_op if tags.block < 0 and sign < 0 else -1)
            if tag == DEFERRED:
                self.tags.defer(self.tags.event, len(self.tags.event))
            self.tags.event.append(tag)

    def index_of(self, tensor: torch.Tensor) -> int | None:
        try:
            return self.live.get(id(_distributed.local_tensor(tensor).untyped_storage()))
        except (NotImplementedError, RuntimeError):
            return None

    # ops -------------------------------------------------------------------------------
    def _track_outputs(self, func: OpOverload, out: object,
                       args: Sequence[object] = ()) -> bool | tuple[bool, ...]:
        # Returns the schema marks as aliases (views, in-place and out= results) are storage
        # that already exists — possibly from before the trace, like the dataset tensor a
        # batch item is a view of; only the other returns can be new allocations.
        aliased = _aliased(func)
        if aliased is True:
            return aliased
        returns = out if isinstance(out, (tuple, list)) else (out,)
        flags = aliased if isinstance(aliased, tuple) else (False,) * len(returns)
        tags = self.tags
        if tags is not None and tags.block < 0 and not self.quiet:
            self._track_tagged(func, returns, flags, args)
            return aliased
        for ret, is_alias in zip(returns, flags):
            if not is_alias:
                for t in _tensors(ret, []):
                    self.track(t)
        return aliased

    def _block_of(self, tensor: object) -> int:
        if not isinstance(tensor, torch.Tensor) or self.tags is None:
            return -1
        view = self.tags.views.get(id(tensor))
        if view is not None:
            return view
        index = self.index_of(tensor)
        return -1 if index is None else self.tags.alloc[index]

    def _track_tagged(self, func: OpOverload, returns: Sequence[object], flags: Sequence[bool],
                      args: Sequence[object]) -> None:
        """Track an op's outputs outside any block, each with the block its inputs say (see
        :class:`BlockTags`)."""
        assert self.tags is not None
        tag = self._inputs_block(_tensors(args, []))
        per_item = (func._overloadpacket.__name__.startswith("_foreach_") and args
                    and isinstance(args[0], (list, tuple)))
        first = args[0] if per_item else ()
        assert isinstance(first, (list, tuple))
        for j, (ret, is_alias) in enumerate(zip(returns, flags)):
            if is_alias:
                continue
            if per_item and isinstance(ret, (list, tuple)):  # one of several returned lists
                for i, t in enumerate(ret):
                    self._pending = self._block_of(first[i]) if i < len(first) else -1
                    for leaf in _tensors(t, []):
                        self.track(leaf)
            else:  # the j-th item of the one returned list, or an op's j-th return
                self._pending = (self._block_of(first[j]) if j < len(first) else -1) if per_item else tag
                for t in _tensors(ret, []):
                    self.track(t)
        self._pending = -1

    def __torch_dispatch__(self, func: OpOverload, types: Sequence[type], args: Sequence[object] = (),
                           kwargs: Mapping[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        if self.unrecorded:
            return func(*args, **kwargs)
        if self.below_dtensor and _has_dtensor(types):
            return self._dtensor_op(func, args, kwargs)
        if func is _WAIT_TENSOR and _is_fake(args[0]):
            # A fake process group's collective returns a new tensor, which waiting returns
            # again as yet another; on a real one the wait returns the collective's output.
            return args[0]
        if self.quiet:
            out = func(*args, **kwargs)
            self._track_outputs(func, out)
            return out
        if self.label_ops:
            with torch.profiler.record_function(f"memplan_op::{len(self.ops)}"):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        packet = func._overloadpacket
        in_tensors = _tensors(args, _tensors(kwargs, []))
        out_tensors = _tensors(out, [])
        before = len(self.alloc_bytes)
        aliased = self._track_outputs(func, out, args)
        new_bytes = sum(self.alloc_bytes[before:])
        flops = 0
        if packet in flop_registry:
            try:
                flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a counting failure must not stop the trace
                flops = 0
        moved = sum(_nbytes(t) for t in in_tensors) + sum(_nbytes(t) for t in out_tensors)
        dtype = next((_dtype_name(t.dtype) for t in in_tensors if t.is_floating_point()), "none")
        inplace = aliased is True and (packet.__name__.endswith("_") or "out" in kwargs)
        moves = bool(out_tensors) and (new_bytes > 0 or inplace or flops > 0)
        name = _OP_NAMES.get(packet)
        if name is None:
            name = _OP_NAMES[packet] = str(packet)
        if flops and self.on_compute is not None:
            self.on_compute(len(self.ops), func, args, kwargs)
        self.ops.append(OpRecord(name, self.phase, flops, moved, dtype, new_bytes, moves))
        self.op_positions.append(len(self.event_alloc))
        self.op_new_bytes.append(new_bytes)
        if self.tags is not None:
            self._tag_op(before, in_tensors)
        return out

    def _dtensor_op(self, func: OpOverload, args: Sequence[object], kwargs: Mapping[str, object]) -> object:
        """An op on DTensors, run by DTensor with this mode on top again, so that the local ops
        it runs on the shards are recorded (not the op at the global shape): its second visit
        here declines, and DTensor's own dispatch takes it."""
        if self._in_dtensor:
            return NotImplemented
        self._in_dtensor = True
        try:
            with self:
                return func(*args, **kwargs)
        finally:
            self._in_dtensor = False

    def _tag_op(self, before: int, in_tensors: list[torch.Tensor]) -> None:
        """The op's block: the current block's, else its outputs' (all one block's), else its
        inputs' (see :class:`BlockTags`)."""
        tags = self.tags
        assert tags is not None
        if tags.block >= 0:
            tags.op.append(tags.block)
            return
        made = set(tags.alloc[before:])
        if made:
            tag = made.pop() if len(made) == 1 else -1
        else:
            tag = self._inputs_block(in_tensors)
        if tag == DEFERRED:
            tags.defer(tags.op, len(tags.op))
        else:
            tags.resolve(tag)
        tags.op.append(tag)
        tags.last_op = tag

    def _inputs_block(self, tensors: list[torch.Tensor]) -> int:
        """The block of an op's inputs: theirs if one, -1 for several or one of none, DEFERRED
        when no input was recorded (a factory op) or all wait for their block."""
        assert self.tags is not None
        blocks: set[int] = set()
        untagged = False
        views = self.tags.views
        for t in tensors:
            b = views.get(id(t), -3)
            if b == -3:
                index = self.index_of(t)
                if index is None:
                    continue
                b = self.tags.alloc[index]
            if b >= 0:
                blocks.add(b)
            elif b == -1:
                untagged = True
        if len(blocks) == 1:
            return blocks.pop()
        return -1 if blocks or untagged else DEFERRED


_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


def _has_dtensor(types: Sequence[type]) -> bool:
    api = sys.modules.get("torch.distributed.tensor._api")
    return api is not None and any(issubclass(t, api.DTensor) for t in types)


def _is_fake(t: object) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


_ALIASED: dict[OpOverload, bool | tuple[bool, ...]] = {}
_OP_NAMES: dict[OpOverloadPacket, str] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _tensors(obj: object, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results, appended to ``out`` in order.

    Aten ops take and return tensors, lists or tuples of them, scalars and None (dicts only
    as kwargs); a direct walk is several times cheaper than the generic pytree flatten, and
    the trace runs it twice per op."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                out.append(item)
            elif isinstance(item, (list, tuple, dict)):
                _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)
    return out


# ``torch.tensor(data)`` builds its tensor outside the dispatcher; these ops are where such a
# fresh tensor first appears, returned as an "alias" of itself: it is a new allocation.
_FRESH = {"lift_fresh", "lift_fresh_copy", "lift"}


def _aliased(func: OpOverload) -> bool | tuple[bool, ...]:
    if func not in _ALIASED:
        from ..runtime._guard import _aliased_returns
        _ALIASED[func] = False if func._overloadpacket.__name__ in _FRESH else _aliased_returns(func)
    return _ALIASED[func]


def functools_partial(fn: Callable[[int, weakref.ref[torch.UntypedStorage]], None], key: int) -> _Released:
    # A plain closure is cheaper than functools.partial for the millions of weakrefs of big traces.
    return lambda ref: fn(key, ref)


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except Exception:  # noqa: BLE001
        return 0


# -- building the model on fake tensors ---------------------------------------------------

@contextlib.contextmanager
def recorded_rng_states(rec: Recorder) -> Iterator[None]:
    """Record the CPU RNG states ``torch.utils.checkpoint`` saves (one 5,056-byte tensor per
    checkpointed block): ``torch.get_rng_state`` builds them outside the dispatcher, where no
    dispatch mode sees them. They stay in host memory when training on a GPU."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        if not rec.quiet:
            index = rec.track(state, Category.ACTIVATIONS)
            if index is not None:
                rec.host.append(index)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _mark(rec: Recorder, indices: set[int], category: Category, *, only_from: Category) -> None:
    for i in indices:
        if rec.alloc_category[i] == only_from:
            rec.alloc_category[i] = int(category)


def _mark_tensor(rec: Recorder, tensor: torch.Tensor, category: Category) -> None:
    index = rec.index_of(tensor)
    if index is not None and rec.alloc_category[index] in (Category.TEMPORARIES, Category.ACTIVATIONS):
        rec.alloc_category[index] = int(category)


class RecordingHooks(StepHooks):
    def __init__(self, rec: Recorder, phase_labels: list[str]) -> None:
        self.rec, self.labels = rec, phase_labels

    def phase(self, label: str, kind: str = "") -> None:
        self.labels.append(label)
        self.rec.phase = len(self.labels) - 1
        if self.rec.tags is not None:
            self.rec.tags.reset()

    def making_batch(self, on: bool) -> None:
        self.rec.quiet = on

    def batch(self, batch: Batch) -> None:
        for leaf in tree_flatten(batch)[0]:
            if isinstance(leaf, torch.Tensor):
                index = self.rec.track(leaf, Category.BATCH)
                if index is not None:
                    self.rec.alloc_category[index] = int(Category.BATCH)

    def after_forward(self) -> None:
        _mark(self.rec, set(self.rec.live.values()), Category.ACTIVATIONS, only_from=Category.TEMPORARIES)

    def after_backward(self, model: nn.Module) -> None:
        for p in model.parameters():
            if p.grad is not None:
                _mark_tensor(self.rec, p.grad, Category.GRADIENTS)

    def gradient_ready(self, param: torch.Tensor) -> None:
        # Stepped in backward: the gradient dies before after_backward could see it.
        if param.grad is not None:
            _mark_tensor(self.rec, param.grad, Category.GRADIENTS)

    def after_optimizer(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    _mark_tensor(self.rec, value, Category.OPTIMIZER)
        if scaler is not None:
            for value in (scaler._scale, scaler._growth_tracker):
                if value is not None:
                    _mark_tensor(self.rec, value, Category.OPTIMIZER)

    def held(self, tensors: Sequence[torch.Tensor], kind: str) -> None:
        for t in tensors:
            index = self.rec.track(t, Category.EMA)
            if index is not None:
                self.rec.alloc_category[index] = int(Category.EMA)

    def copying(self, on: bool) -> None:
        self.rec.quiet = on  # a transfer over the host link, priced apart from the kernels

    def offloaded(self, tensor: torch.Tensor, where: str) -> None:
        index = self.rec.index_of(tensor)
        if index is None:
            return
        if where == "host":
            self.rec.alloc_category[index] = int(Category.OFFLOADED)
            self.rec.host.append(index)
        else:  # brought back for backward: an activation again, on the device
            self.rec.alloc_category[index] = int(Category.ACTIVATIONS)
