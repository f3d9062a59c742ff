"""Trace one real training step's allocations, on fake tensors (or real ones as a fallback).

The trace runs exactly what the trainer runs — forward and loss under the precision's
autocast, backward (scaled under fp16), ``optimizer.step()``, ``zero_grad(set_to_none=True)``
— for two optimizer steps, so both the step that creates optimizer state and a steady-state
step are seen. With gradient accumulation, two micro-batches per step are traced: from the
second micro-batch on, nothing new is alive (gradients exist, activations are the same), so
a third would repeat the second byte for byte.

Every storage that comes into being is recorded by a ``TorchDispatchMode`` (outputs of each
op) and a weak reference (its death), giving an ordered list of allocation and free events.
Storages are keyed by their Python object, which PyTorch keeps alive exactly as long as the
storage itself.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..memory import _distributed
from ..runtime import _precision
from ..runtime._build import BuiltModel, build_for_training
from ..runtime._planned import PlannedSteps
from ..runtime._options import StepOptions
from ..runtime._step import StepHooks
from .._config import TrainConfig
from .._errors import MemplanError, ModelFileError
from .._task import Task, _one_line
from ._steady import RawEvents, drop_second_micro, repeat_first_step

__all__ = ["Category", "Trace", "OpRecord", "trace_step", "DataDependentShapes"]


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

    @property
    def label(self) -> str:
        return {
            0: "params", 1: "buffers", 2: "batch", 3: "activations", 4: "gradients",
            5: "optimizer", 6: "temporaries", 7: "workspace", 8: "ema",
        }[int(self)]


PHASES = ("setup", "forward", "backward", "optimizer", "zero_grad")


class DataDependentShapes(MemplanError):
    """The model's shapes depend on data values; fake tensors cannot trace it."""


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


@dataclass(eq=False)
class Trace:
    """Ordered allocation events of one traced training run.

    ``event_alloc[i]`` is the allocation an event refers to and ``event_sign[i]`` is +1 for
    its creation, -1 for its release; ``alloc_bytes``/``alloc_category`` describe each
    allocation. ``event_phase[i]`` indexes ``phase_labels``.
    """

    batch_size: int
    config: TrainConfig
    alloc_bytes: np.ndarray
    alloc_category: np.ndarray
    event_alloc: np.ndarray
    event_sign: np.ndarray
    event_phase: np.ndarray
    phase_labels: list[str]
    ops: list[OpRecord]
    method: str
    """"traced" (fake tensors) or "measured-cpu" (a real CPU run)."""
    op_positions: list[int] = field(default_factory=list)
    """Per op of ``ops``: the event position right after the op's outputs."""
    op_workspace: list[int] | None = None
    """Per op: bytes the allocator handed out during the op beyond its outputs (real,
    profiled runs only)."""
    host_allocs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Allocations that live in host memory even when training on a GPU (the CPU RNG state
    ``torch.utils.checkpoint`` saves per checkpointed block)."""
    notes: tuple[str, ...] = ()
    """Assumptions the trace made (CUDA kernels modelled on CPU tensors), for the estimate."""
    batch_offset: int = 0
    """Where a real run's batches started (``run_steps``' ``batch_offset``)."""
    draws: int | None = None
    """Real batches a data-dependent model's estimate was taken over."""
    fullest_peak: int | None = None
    """The peak of the fullest of those real runs (this trace may bound them all)."""
    single_micro: Trace | None = None
    """The same step without gradient accumulation, derived from this trace (fake traces of
    one device with accumulation >= 2; see ``estimators.tracing._steady.drop_second_micro``)."""

    def structure_key(self) -> tuple[int, int]:
        return (len(self.event_alloc), len(self.alloc_bytes))

    def same_structure(self, other: Trace) -> bool:
        return (
            self.structure_key() == other.structure_key()
            and np.array_equal(self.event_alloc, other.event_alloc)
            and np.array_equal(self.event_sign, other.event_sign)
            and np.array_equal(self.alloc_category, other.alloc_category)
        )


class _Recorder(TorchDispatchMode):
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
        self._refs: dict[int, weakref.ref] = {}
        self.ops: list[OpRecord] = []
        self.op_positions: list[int] = []  # per op: event position right after its outputs
        self.op_new_bytes: list[int] = []  # per op: bytes of the storages it created
        self.quiet = False  # batch creation is not part of the step's ops
        self.label_ops = False  # wrap ops in profiler ranges (real runs measuring workspaces)
        self.host: list[int] = []  # allocations in host memory whatever the device

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

    def resized_up(self, tensor: torch.Tensor) -> None:
        """The storage of ``tensor`` was resized from 0 bytes: a new allocation of its size."""
        self.track(tensor, Category.PARAMS)

    def _event(self, index: int, sign: int) -> None:
        self.event_alloc.append(index)
        self.event_sign.append(sign)
        self.event_phase.append(self.phase)

    def index_of(self, tensor: torch.Tensor) -> int | None:
        try:
            return self.live.get(id(_distributed.local_tensor(tensor).untyped_storage()))
        except (NotImplementedError, RuntimeError):
            return None

    # ops -------------------------------------------------------------------------------
    def _track_outputs(self, func: Any, out: Any) -> bool | tuple[bool, ...]:
        # Returns the schema marks as aliases (views, in-place and out= results) are storage
        # that already exists — possibly from before the trace, like the dataset tensor a
        # batch item is a view of; only the other returns can be new allocations.
        aliased = _aliased(func)
        if aliased is True:
            return aliased
        returns = out if isinstance(out, (tuple, list)) else (out,)
        flags = aliased if isinstance(aliased, tuple) else (False,) * len(returns)
        for ret, is_alias in zip(returns, flags):
            if not is_alias:
                for t in _tensors(ret, []):
                    self.track(t)
        return aliased

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
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
        aliased = self._track_outputs(func, out)
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
        self.ops.append(OpRecord(name, self.phase, flops, moved, dtype, new_bytes, moves))
        self.op_positions.append(len(self.event_alloc))
        self.op_new_bytes.append(new_bytes)
        return out


_ALIASED: dict[Any, Any] = {}
_OP_NAMES: dict[Any, str] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
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


def _aliased(func: Any) -> bool | tuple[bool, ...]:
    if func not in _ALIASED:
        from ..runtime._guard import _aliased_returns
        _ALIASED[func] = False if func._overloadpacket.__name__ in _FRESH else _aliased_returns(func)
    return _ALIASED[func]


def functools_partial(fn: Any, key: int) -> Any:
    # A plain closure is cheaper than functools.partial for the millions of weakrefs of big traces.
    return lambda ref: fn(key, ref)


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except Exception:  # noqa: BLE001
        return 0


# -- building the model on fake tensors ---------------------------------------------------

def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a traceback ("failed while attempting to run meta for ...") for
    every op whose meta kernel raises, before raising it: the trace reports that error in one
    line of its own, so the log would only put the traceback on the user's screen twice."""
    import logging
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fake_copy(module: nn.Module, mode: Any) -> nn.Module:
    """A copy of a real module whose parameters and buffers are fake (ties kept)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for b in module.buffers():
        if id(b) not in memo:
            memo[id(b)] = mode.from_tensor(b)
    return copy.deepcopy(module, memo)


def build_fake_model(task: Task, mode: Any) -> nn.Module:
    """The task's model with fake CPU parameters: built on meta where it can be, so that a
    billion-parameter model costs no real memory; else built for real and copied."""
    if task.prebuilt is not None:
        return _fake_copy(task.prebuilt, mode)
    try:
        with torch.device("meta"):
            model = task.build_model()
        ties = _shared_tensors(model)
        with mode:
            model.to_empty(device="cpu")
        _retie(ties)
        if any(t.device.type == "meta" for t in _plain_tensor_attrs(model)):
            raise RuntimeError("plain tensor attributes left on meta")
        return model
    except ModelFileError:
        raise
    except Exception:  # noqa: BLE001 - some models cannot be built on meta; build for real
        real = task.build_model()
        return _fake_copy(real, mode)


def _shared_tensors(model: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """Parameters and buffers held under several names (tied embeddings and heads)."""
    holders: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, value in getattr(module, kind).items():
                if value is not None:
                    holders.setdefault(id(value), []).append((module, kind, name))
    return [refs for refs in holders.values() if len(refs) > 1]


def _retie(ties: list[list[tuple[nn.Module, str, str]]]) -> None:
    # ``to_empty`` may give each holder of a tied tensor its own new tensor; tie them again
    # so the trace sees one parameter, one gradient and one optimizer state, as training does.
    for refs in ties:
        module, kind, name = refs[0]
        shared = getattr(module, kind)[name]
        for other, other_kind, other_name in refs[1:]:
            getattr(other, other_kind)[other_name] = shared


def _plain_tensor_attrs(model: nn.Module) -> Iterator[torch.Tensor]:
    for m in model.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield value


# -- the traced step ---------------------------------------------------------------------

_DATA_DEPENDENT = (
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "GuardOnDataDependentSymNode",
    "UnsupportedOperatorException",
)


def trace_step(
    task: Task,
    config: TrainConfig,
    *,
    batch_size: int | None = None,
    real: bool = False,
    profile: bool = False,
    steps: int = 2,
    synthesize: bool = True,
    derive_real: bool = False,
    target: str = "cpu",
    capability: tuple[int, int] | None = None,
    batch_offset: int = 0,
    options: StepOptions | None = None,
) -> Trace:
    """Trace ``steps`` optimizer steps of ``config`` (micro-batch ``batch_size`` if given).

    With ``real=False`` everything runs on fake tensors; models whose shapes depend on data
    raise :class:`DataDependentShapes`, and ``real=True`` then measures a real CPU run with
    real batches instead.

    ``ddp`` and ``fsdp`` configurations trace rank 0 of ``config.world_size`` ranks in this
    process, on a fake process group (:mod:`estimators.memory._distributed`); the trace starts from
    the wrapped model (sharded parameters, DDP's gradient buckets), as training does.

    A two-step fake trace of a one-device configuration traces step 1 and derives step 2
    from it (:mod:`estimators.tracing._steady`), halving the dispatch time; ``synthesize=False``
    traces both. A real run steps through real batches, whose shapes may depend on their
    values: it runs both steps unless ``derive_real=True`` says the model's shapes do not
    (its fake trace succeeded), which halves a profiled run too.

    ``options`` are the step's parts besides forward, backward and the optimizer step
    (clipping, EMA, label smoothing: :class:`~estimators.runtime._options.StepOptions`);
    ``task.step`` when None.

    ``target`` is the device type the estimate is for: on ``"cuda"`` the step runs CUDA's
    kernel semantics on CPU tensors (``_precision.trace_semantics``: CUDA's autocast policy,
    attention backend of the card of compute ``capability``, bool dropout masks) and the
    optimizer its multi-tensor (foreach) implementation, as PyTorch's optimizers default to
    there.
    """
    b = batch_size or config.micro_batch_size
    options = options if options is not None else task.step
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    # Datasets load before any mode is active: their tensors must be real, not fake, and
    # their loading is not part of the step.
    task.batch_template()
    if not real:
        task.fake_batch(b, like=config.micro_batch_size)  # the planned items, collated outside fake mode
    ranks = (_distributed.simulated_ranks(config.world_size) if config.strategy != "single"
             else contextlib.nullcontext())
    with ranks:
        return _trace_step(task, config, b, real=real, profile=profile, steps=steps,
                           synthesize=synthesize and (derive_real or not real), foreach=target == "cuda",
                           cuda=target == "cuda", capability=capability, batch_offset=batch_offset,
                           options=options)


def _trace_step(task: Task, config: TrainConfig, b: int, *, real: bool, profile: bool, steps: int,
                synthesize: bool, foreach: bool, cuda: bool = False,
                capability: tuple[int, int] | None = None, batch_offset: int = 0,
                options: StepOptions | None = None) -> Trace:
    # One device on fake tensors: trace one step and derive the later ones (see _steady).
    derive = synthesize and config.strategy == "single" and steps == 2
    traced_steps = 1 if derive else steps
    mode = contextlib.nullcontext() if real else _fake_mode()
    quiet = contextlib.nullcontext() if real else _quiet_fake_tensor_log()
    if real:
        model = copy.deepcopy(task.prebuilt) if task.prebuilt is not None else task.build_model()
    else:
        model = build_fake_model(task, mode)
    built: BuiltModel | None = None
    rec = _Recorder()
    rec.label_ops = profile and real
    phase_labels: list[str] = ["setup"]
    hooks = _RecordingHooks(rec, phase_labels)
    prof = None
    semantics = None
    try:
        # Wrapped before recording starts: the full model a rank holds before sharding is
        # not part of the step (training builds it sharded, or frees it before the first step).
        built = build_for_training(task, config, "cpu", model=model, wrap=lambda m: _distributed.parallelize_simulated(
            m, config, finder=task.checkpoint_blocks, mode=mode))
        model = built.wrapped
        with mode, quiet:
            for p in model.parameters():
                rec.track(p, Category.PARAMS)
            for buf in model.buffers():
                rec.track(buf, Category.BUFFERS)
            for bucket in getattr(model, "buckets", ()):
                rec.track(bucket, Category.GRADIENTS)
            # A loop variable would keep the last bucket alive past DDP's rebuild.
            p = buf = bucket = None  # noqa: F841
            with contextlib.ExitStack() as stack:
                prof = stack.enter_context(_memory_profiler()) if rec.label_ops else None
                stack.enter_context(rec)
                stack.enter_context(_recorded_rng_states(rec))
                if config.strategy == "fsdp":
                    stack.enter_context(_distributed.fsdp_storage_events(rec.resized_up, rec.resized_down))
                semantics = stack.enter_context(
                    _precision.trace_semantics(config.precision, cuda=cuda, capability=capability, fake=not real))
                run_steps(task, config, built, batch_size=b, real=real, steps=traced_steps, hooks=hooks,
                          foreach=foreach, batch_offset=batch_offset, options=options)
    except MemplanError:
        raise
    except Exception as exc:  # noqa: BLE001
        name = type(exc).__name__
        if not real and (name in _DATA_DEPENDENT or "data-dependent" in str(exc).lower()
                         or "dynamic output shape" in str(exc).lower()):
            raise DataDependentShapes(f"{task.name}: shapes depend on data ({name})") from exc
        if _unsupported_kernel(exc):
            raise ModelFileError(
                f"{task.name}: a kernel of this model is not supported on this device in "
                f"{config.precision} ({_one_line(exc)}); use another precision, e.g. --precision fp32"
            ) from exc
        raise ModelFileError(
            f"{task.name}: a training step with batch size {b} failed: {_one_line(exc)}; "
            "check that the model accepts batches from train_data() and that loss() returns a scalar"
        ) from exc
    finally:
        del model, built
    # Whatever is still alive at the end (params, buffers, optimizer state) is released at
    # the end of the trace's lifetime; that is not part of the step, so no events are added.
    # Frees recorded after the last step are dropped too: the garbage collector decides
    # which of those land before recording stops, and traces to be compared must not differ
    # by its timing.
    end = len(phase_labels) - 1
    kept = next((k for k, ph in enumerate(rec.event_phase) if ph >= end), len(rec.event_phase))
    raw = RawEvents(rec.alloc_bytes, rec.alloc_category, rec.event_alloc[:kept], rec.event_sign[:kept],
                    rec.event_phase[:kept], phase_labels, rec.ops, rec.op_positions, rec.host,
                    _op_workspaces(prof, rec.op_new_bytes) if prof is not None else None)
    method = "measured-cpu" if real else "traced"
    notes = tuple(_precision.semantics_notes(semantics, {op.name for op in rec.ops} if semantics else None))
    if not derive:
        return _as_trace(raw, config, b, method, notes)
    single = drop_second_micro(raw) if config.grad_accum_steps >= 2 else None
    trace = _as_trace(repeat_first_step(raw), config, b, method, notes)
    if single is not None:
        trace.single_micro = _as_trace(repeat_first_step(single), config.replace(grad_accum_steps=1), b, method,
                                       notes)
    return trace


def _as_trace(raw: RawEvents, config: TrainConfig, b: int, method: str, notes: tuple[str, ...] = ()) -> Trace:
    event_alloc, event_phase = _canonical_free_order(raw.event_alloc, raw.event_sign, raw.event_phase)
    return Trace(
        batch_size=b,
        config=config,
        alloc_bytes=np.asarray(raw.alloc_bytes, dtype=np.int64),
        alloc_category=np.asarray(raw.alloc_category, dtype=np.int8),
        event_alloc=event_alloc,
        event_sign=np.asarray(raw.event_sign, dtype=np.int8),
        event_phase=event_phase,
        phase_labels=raw.phase_labels,
        ops=raw.ops,
        method=method,
        op_positions=raw.op_positions,
        op_workspace=raw.op_workspace,
        host_allocs=np.asarray(sorted(set(raw.host)), dtype=np.int64),
        notes=notes,
    )


_UNSUPPORTED_KERNEL = (
    "could not create a primitive",  # oneDNN has no kernel for this dtype on this CPU
    "not implemented for 'bfloat16'",
    "not implemented for 'half'",
    "unsupported scalartype",
)


def _unsupported_kernel(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(marker in text for marker in _UNSUPPORTED_KERNEL)


@contextlib.contextmanager
def _recorded_rng_states(rec: _Recorder) -> Iterator[None]:
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

    torch.get_rng_state = get_rng_state  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.get_rng_state = original  # type: ignore[assignment]


def _canonical_free_order(alloc: list[int], sign: list[int], phase: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Sort each run of consecutive frees by allocation index.

    Storages that die together (a dict of cached casts cleared, a graph released) are freed
    in an order that depends on hashing, not on the model; frees only lower the running total,
    so their order within a run changes no peak, and a fixed order lets traces at different
    batch sizes be compared event by event.
    """
    a = np.asarray(alloc, dtype=np.int64)
    p = np.asarray(phase, dtype=np.int32)
    i, n = 0, len(a)
    while i < n:
        if sign[i] < 0:
            j = i
            while j < n and sign[j] < 0 and phase[j] == phase[i]:
                j += 1
            a[i:j] = np.sort(a[i:j])
            i = j
        else:
            i += 1
    return a, p


def _memory_profiler() -> Any:
    from ._profiler import memory_profile
    return memory_profile()


def _op_workspaces(prof: Any, new_bytes: list[int]) -> list[int]:
    """Per op: the allocator's highest level during the op above its start, less the op's
    outputs — scratch memory no tensor shows (oneDNN reorders, RNN workspaces, sort buffers)."""
    from torch._C._profiler import _EventType

    result = [0] * len(new_bytes)

    def walk(nodes: Any) -> Any:
        for n in nodes:
            yield n
            yield from walk(n.children)

    for node in walk(prof.profiler.kineto_results.experimental_event_tree()):
        if node.tag != _EventType.TorchOp or not node.name.startswith("memplan_op::"):
            continue
        i = int(node.name.split("::", 1)[1])
        running = peak = 0
        allocs = [n for n in walk(node.children) if n.tag == _EventType.Allocation]
        for a in sorted(allocs, key=lambda e: e.start_time_ns):
            running += a.extra_fields.alloc_size
            peak = max(peak, running)
        if i < len(result):
            result[i] = max(0, peak - new_bytes[i])
    return result


def _mark(rec: _Recorder, indices: set[int], category: Category, *, only_from: Category) -> None:
    for i in indices:
        if rec.alloc_category[i] == only_from:
            rec.alloc_category[i] = int(category)


def _mark_tensor(rec: _Recorder, tensor: torch.Tensor, category: Category) -> None:
    index = rec.index_of(tensor)
    if index is not None and rec.alloc_category[index] in (Category.TEMPORARIES, Category.ACTIVATIONS):
        rec.alloc_category[index] = int(category)


class _RecordingHooks(StepHooks):
    def __init__(self, rec: _Recorder, phase_labels: list[str]) -> None:
        self.rec, self.labels = rec, phase_labels

    def phase(self, label: str, kind: str = "") -> None:
        self.labels.append(label)
        self.rec.phase = len(self.labels) - 1

    def making_batch(self, on: bool) -> None:
        self.rec.quiet = on

    def batch(self, batch: Any) -> None:
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

    def after_optimizer(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    _mark_tensor(self.rec, value, Category.OPTIMIZER)
        if scaler is not None:
            for value in (scaler._scale, scaler._growth_tracker):
                if value is not None:
                    _mark_tensor(self.rec, value, Category.OPTIMIZER)

    def held(self, tensors: Any, kind: str) -> None:
        for t in tensors:
            index = self.rec.track(t, Category.EMA)
            if index is not None:
                self.rec.alloc_category[index] = int(Category.EMA)


def run_steps(
    task: Task,
    config: TrainConfig,
    built: BuiltModel,
    *,
    batch_size: int,
    real: bool,
    steps: int = 2,
    hooks: StepHooks | None = None,
    device: str = "cpu",
    foreach: bool = False,
    batch_offset: int = 0,
    options: StepOptions | None = None,
) -> None:
    """The training steps that are traced and measured: the trainer's :func:`train_step`.

    At most two micro-batches a step (the rest of a window repeat the second's memory); each
    micro-batch's batch is created at the start of its forward and dropped after its backward,
    as the trainer does. ``batch_offset`` moves a real run to other items (another draw of a
    data-dependent model).
    """
    run = PlannedSteps(task, config, built, device=device, options=options, real=real, batch_size=batch_size,
                       micro_steps=min(config.grad_accum_steps, 2), batch_offset=batch_offset, foreach=foreach,
                       hooks=hooks)
    for step in range(1, steps + 1):
        run(step)
    (hooks or StepHooks()).phase("end", "end")
