"""Trace one real training step's allocations, on fake tensors (or real ones as a fallback).

The trace runs the trainer's step (:func:`estimators.runtime._step.train_step`: forward and
loss under the precision's autocast, backward (scaled under fp16), clipping, the optimizer
step, EMA, ``zero_grad(set_to_none=True)``) for two optimizer steps, so both the step that
creates optimizer state and a steady-state step are seen. With gradient accumulation, two
micro-batches per step are traced: from the second micro-batch on, nothing new is alive
(gradients exist, activations are the same), so a third would repeat the second byte for byte.

What is recorded, and how, is :mod:`._recorder`; the fake model is :mod:`._fake`.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn as nn

from .._config import TrainConfig
from .._errors import MemplanError, ModelFileError
from .._step_options import StepOptions
from ..runtime import _activation_offload
from ..runtime._build import BuiltModel, build_for_training
from ..runtime._planned import PlannedSteps
from ..runtime._step import StepHooks
from ..task._task import Task, _one_line
from . import _cpu_offload
from . import _simulated_ranks as _distributed
from ._cuda_semantics import semantics_notes, trace_semantics
from ._depth import DepthCut, checkpoint_cut, cut_stack, param_blocks, tagged_blocks
from ._events import EventTable
from ._fake import build_fake_model, fake_mode, quiet_fake_tensor_log
from ._profiler import allocated_bytes, collector_paused, event_tree, memory_profile, walk_events
from ._recorder import Category, OnCompute, OpRecord, Recorder, RecordingHooks, recorded_rng_states
from ._steady import RawEvents, drop_second_micro, repeat_first_step

if TYPE_CHECKING:
    from torch.profiler import profile

__all__ = ["Trace", "TaggedRaw", "trace_step", "run_steps", "finish_trace", "DataDependentShapes"]


class DataDependentShapes(MemplanError):
    """The model's shapes depend on data values; fake tensors cannot trace it."""


@dataclass(eq=False, kw_only=True)
class Trace(EventTable):
    """The event table of one traced training run (:class:`EventTable`), with its ops and
    what it was traced for."""

    batch_size: int
    config: TrainConfig
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
    stage_scale: float = 1.0
    """A pipeline's: its busiest traced stage's FLOPs over this (the fullest) stage's."""
    stage: int | None = None
    """A pipeline's: the rank whose stage this is."""
    send_bytes: int = 0
    """A pipeline's: the bytes its busiest sending stage passes on per micro-batch (its
    neighbour sends the gradients back, as many bytes)."""
    tagged: TaggedRaw | None = None
    """A trace of a cut block stack (``trace_step(cut=...)``): the recorded events before the
    later steps were derived, with the block of each (``estimators.tracing._compose``)."""


@dataclass(eq=False, kw_only=True)
class TaggedRaw:
    """The events of a traced step as recorded, each allocation, event and op with its block
    (-1: none; see ``_recorder.BlockTags``), and how :func:`finish_trace` makes them a trace."""

    raw: RawEvents
    alloc_block: list[int]
    event_block: list[int]
    event_after_op: list[int]
    op_block: list[int]
    derive: bool
    """Were the later steps to be derived from the first (``_steady``)?"""
    method: str
    notes: tuple[str, ...]


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
    on_compute: OnCompute | None = None,
    cut: DepthCut | None = None,
    stage: int | None = None,
) -> Trace:
    """Trace ``steps`` optimizer steps of ``config`` (micro-batch ``batch_size`` if given).

    With ``real=False`` everything runs on fake tensors; models whose shapes depend on data
    raise :class:`DataDependentShapes`, and ``real=True`` then measures a real CPU run with
    real batches instead.

    ``ddp`` and ``fsdp`` configurations trace rank 0 of ``config.world_size`` ranks in this
    process, on a fake process group (:mod:`estimators.tracing._simulated_ranks`); the trace starts from
    the wrapped model (sharded parameters, DDP's gradient buckets), as training does.

    A two-step fake trace of a one-device configuration traces step 1 and derives step 2
    from it (:mod:`estimators.tracing._steady`), halving the dispatch time; ``synthesize=False``
    traces both. A real run steps through real batches, whose shapes may depend on their
    values: it runs both steps unless ``derive_real=True`` says the model's shapes do not
    (its fake trace succeeded), which halves a profiled run too.

    ``options`` are the step's parts besides forward, backward and the optimizer step
    (clipping, EMA, label smoothing: :class:`~estimators._step_options.StepOptions`);
    ``task.step`` when None. ``on_compute(index, func, args, kwargs)`` is shown each op
    whose FLOPs torch counts (kernel workspaces replay them: ``memory._workspace``).

    ``target`` is the device type the estimate is for: on ``"cuda"`` the step runs CUDA's
    kernel semantics on CPU tensors (``_cuda_semantics.trace_semantics``: CUDA's autocast policy,
    attention backend of the card of compute ``capability``, bool dropout masks) and the
    optimizer its multi-tensor (foreach) implementation, as PyTorch's optimizers default to
    there.

    ``cut`` traces the model with its block stack cut short (``_depth.DepthCut``; its own
    blocks checkpointed instead of ``config.checkpoint_segments``), every event tagged with its
    block: ``Trace.tagged``, from which ``_compose`` builds the trace of the whole stack.

    A pipeline (``config.pp > 1``) traces the process of pipeline rank ``stage``; by default
    those of :func:`~estimators.runtime._pipeline.traced_ranks` (the first, a middle and the
    last), and answers the fullest one's trace, noting each one's peak
    (:func:`_fullest_stage`).
    """
    if config.pp > 1 and stage is None:
        return _fullest_stage(task, config, batch_size=batch_size, real=real, profile=profile, steps=steps,
                              target=target, capability=capability, batch_offset=batch_offset, options=options,
                              on_compute=on_compute)
    b = batch_size or config.micro_batch_size
    options = options if options is not None else task.step
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    # Datasets load before any mode is active: their tensors must be real, not fake, and
    # their loading is not part of the step.
    task.batch_template()
    if not real:
        task.fake_batch(b, like=config.micro_batch_size)  # the planned items, collated outside fake mode
    ranks = (_distributed.simulated_ranks(config.ranks, rank=stage or 0)
             if config.ranks > 1 or config.strategy != "single" else contextlib.nullcontext())
    with ranks:
        traced = _trace_step(task, config, b, real=real, profile=profile, steps=steps,
                             synthesize=synthesize and (derive_real or not real), foreach=target == "cuda",
                             cuda=target == "cuda", capability=capability, batch_offset=batch_offset,
                             options=options, on_compute=on_compute, cut=cut)
    traced.stage = stage if config.pp > 1 else None
    return traced


def _trace_step(task: Task, config: TrainConfig, b: int, *, real: bool, profile: bool, steps: int,
                synthesize: bool, foreach: bool, cuda: bool = False,
                capability: tuple[int, int] | None = None, batch_offset: int = 0,
                options: StepOptions | None = None, on_compute: OnCompute | None = None,
                cut: DepthCut | None = None) -> Trace:
    # One device or FSDP2 on fake tensors: trace one step and derive the later ones (see _steady).
    derive = synthesize and config.strategy in ("single", "fsdp") and steps == 2 and config.pp == 1
    traced_steps = 1 if derive else steps
    fake = None if real else fake_mode()
    mode: contextlib.AbstractContextManager[object] = fake if fake is not None else contextlib.nullcontext()
    quiet = contextlib.nullcontext() if real else quiet_fake_tensor_log()
    kept: list[nn.Module] = []  # the blocks a cut keeps

    def cut_model(m: nn.Module) -> None:
        assert cut is not None
        kept.extend(cut_stack(m, task.checkpoint_blocks, cut.keep))

    if fake is None:
        model = copy.deepcopy(task.prebuilt) if task.prebuilt is not None else task.build_model()
        if cut is not None:
            cut_model(model)
    else:
        model = build_fake_model(task, fake, shape=cut_model if cut is not None else None)
    built: BuiltModel | None = None
    rec = Recorder()
    rec.label_ops = profile and real
    rec.on_compute = on_compute
    phase_labels: list[str] = ["setup"]
    hooks = RecordingHooks(rec, phase_labels)
    prof = None
    semantics = None
    tagging: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    owners: dict[int, int] = {}
    try:
        built_config = config
        if cut is not None:
            checkpoint_cut(kept, cut, config.checkpoint_policy)
            built_config = config.replace(checkpoint_segments=0, checkpoint_policy="full")
        # Wrapped before recording starts: the full model a rank holds before sharding is
        # not part of the step (training builds it sharded, or frees it before the first step).
        built = build_for_training(task, built_config, "cpu", model=model,
                                   wrap=lambda m: _distributed.parallelize_simulated(
                                       m, config, finder=task.checkpoint_blocks, mode=fake, tp_hook=task.tp_plan,
                                       example=lambda: (task.real_batch(b, like=config.micro_batch_size) if real
                                                        else task.fake_batch(b, like=config.micro_batch_size))))
        model = built.wrapped
        if cut is not None:
            owners = param_blocks(kept)
            tagging = tagged_blocks(rec, kept, built.wrapped, owners)
        with mode, quiet, tagging:
            sharded = [_track_owned(rec, p, Category.PARAMS, owners) for p in model.parameters()]
            buf: torch.Tensor | None = None
            for buf in model.buffers():
                _track_owned(rec, buf, Category.BUFFERS, owners)
            for bucket in getattr(model, "buckets", ()):
                rec.track(bucket, Category.GRADIENTS)
            # A loop variable would keep the last bucket alive past DDP's rebuild.
            p = buf = bucket = None  # noqa: F841
            with contextlib.ExitStack() as stack:
                prof = None
                if rec.label_ops:
                    stack.enter_context(collector_paused())
                    prof = stack.enter_context(memory_profile(collect=False))
                stack.enter_context(rec)
                stack.enter_context(recorded_rng_states(rec))
                if config.strategy == "fsdp":
                    stack.enter_context(_distributed.fsdp_storage_events(rec.resized_up, rec.resized_down))
                if config.tp > 1:
                    rec.below_dtensor = True
                    stack.enter_context(_distributed.dtensor_propagation_unrecorded(rec))
                if config.cpu_offload and cuda:
                    stack.enter_context(_cpu_offload.device_copies())
                semantics = stack.enter_context(
                    trace_semantics(config.precision, cuda=cuda, capability=capability, fake=not real))
                if cuda:  # offloaded activations go to host memory and back, as on the card
                    stack.enter_context(_activation_offload.simulated_transfers())
                run_steps(task, config, built, batch_size=b, real=real, steps=traced_steps, hooks=hooks,
                          foreach=foreach, batch_offset=batch_offset, options=options)
        send_bytes = getattr(built.wrapped, "send_bytes", 0)
        if config.cpu_offload and cuda:
            rec.host.extend(_cpu_offload.host_allocations(rec, phase_labels, [i for i in sharded if i is not None]))
    except MemplanError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _step_failed(exc, task, config, b, real=real) from exc
    finally:
        del model, built
        kept.clear()
    notes = tuple(semantics_notes(semantics, {op.name for op in rec.ops} if semantics else None))
    if options is not None and options.compile:
        notes += (_COMPILE_NOTE,)
    traced = _finished(rec, phase_labels, prof, config, b, "measured-cpu" if real else "traced", notes, derive=derive)
    traced.send_bytes = send_bytes
    return traced


def _fullest_stage(task: Task, config: TrainConfig, **kwargs: Any) -> Trace:
    """Each of the traced pipeline ranks' traces; the fullest, with a note of every one's peak
    and, in ``stage_scale``, how much more compute the busiest of them runs (a pipeline runs at
    its slowest stage's pace)."""
    from ..runtime._pipeline import traced_ranks

    traces = {rank: trace_step(task, config, stage=rank, **kwargs) for rank in traced_ranks(config.pp)}
    peaks = {rank: _event_peak(t) for rank, t in traces.items()}
    fullest = max(peaks, key=lambda r: (peaks[r], -r))
    work = {rank: float(sum(op.flops for op in t.ops)) for rank, t in traces.items()}
    chosen = traces[fullest]
    chosen.stage_scale = max(work.values()) / work[fullest] if work[fullest] else 1.0
    chosen.send_bytes = max(t.send_bytes for t in traces.values())
    said = ", ".join(f"rank {r} {peaks[r] / 2**20:.1f} MiB" for r in sorted(peaks))
    chosen.notes = (*chosen.notes, f"pipeline: traced stages' peaks {said} (allocated); the estimate is rank "
                                   f"{fullest}'s")
    return chosen


def _event_peak(trace: Trace) -> int:
    signed = trace.alloc_bytes[trace.event_alloc] * trace.event_sign.astype(np.int64)
    return int(np.concatenate([[0], np.cumsum(signed)]).max())


def _track_owned(rec: Recorder, tensor: torch.Tensor, category: Category, owners: dict[int, int]) -> int | None:
    """Track a parameter or buffer before the step, as its block's when blocks are tagged."""
    if rec.tags is not None:
        rec.tags.block = owners.get(id(tensor), -1)
    try:
        return rec.track(tensor, category)
    finally:
        if rec.tags is not None:
            rec.tags.block = -1


def _step_failed(exc: Exception, task: Task, config: TrainConfig, b: int, *, real: bool) -> MemplanError:
    """The one-line error a failed traced step becomes."""
    name = type(exc).__name__
    if not real and (name in _DATA_DEPENDENT or "data-dependent" in str(exc).lower()
                     or "dynamic output shape" in str(exc).lower()):
        return DataDependentShapes(f"{task.name}: shapes depend on data ({name})")
    if _unsupported_kernel(exc):
        return ModelFileError(
            f"{task.name}: a kernel of this model is not supported on this device in "
            f"{config.precision} ({_one_line(exc)}); use another precision, e.g. --precision fp32")
    return ModelFileError(
        f"{task.name}: a training step with batch size {b} failed: {_one_line(exc)}; "
        "check that the model accepts batches from train_data() and that loss() returns a scalar")


def _finished(rec: Recorder, phase_labels: list[str], prof: profile | None, config: TrainConfig, b: int, method: str,
              notes: tuple[str, ...], *, derive: bool) -> Trace:
    """The recorded events as a Trace (with the later steps derived from the first, when asked)."""
    # Whatever is still alive at the end (params, buffers, optimizer state) is released at
    # the end of the trace's lifetime; that is not part of the step, so no events are added.
    # Frees recorded after the last step are dropped too: the garbage collector decides
    # which of those land before recording stops, and traces to be compared must not differ
    # by its timing.
    end = len(phase_labels) - 1
    kept = next((k for k, ph in enumerate(rec.event_phase) if ph >= end), len(rec.event_phase))
    raw = RawEvents(alloc_bytes=rec.alloc_bytes, alloc_category=rec.alloc_category,
                    event_alloc=rec.event_alloc[:kept], event_sign=rec.event_sign[:kept],
                    event_phase=rec.event_phase[:kept], phase_labels=phase_labels, ops=rec.ops,
                    op_positions=rec.op_positions, host=rec.host,
                    op_workspace=_op_workspaces(prof, rec.op_new_bytes) if prof is not None else None,
                    resized=rec.resized)
    trace = finish_trace(raw, config, b, method, notes, derive=derive)
    if rec.tags is not None:
        tags = rec.tags
        trace.tagged = TaggedRaw(raw=raw, alloc_block=tags.alloc[:len(raw.alloc_bytes)],
                                 event_block=tags.event[:kept], event_after_op=tags.after_op[:kept],
                                 op_block=tags.op[:len(raw.ops)],
                                 derive=derive, method=method, notes=notes)
    return trace


def finish_trace(raw: RawEvents, config: TrainConfig, b: int, method: str, notes: tuple[str, ...], *,
                 derive: bool) -> Trace:
    """The recorded events as a Trace: the later steps derived from the first when ``derive``
    (with accumulation, the step of one micro-batch as ``single_micro`` too), frees in their
    canonical order."""
    if not derive:
        return _as_trace(raw, config, b, method, notes)
    single = drop_second_micro(raw) if config.grad_accum_steps >= 2 else None
    trace = _as_trace(repeat_first_step(raw), config, b, method, notes)
    if single is not None:
        trace.single_micro = _as_trace(repeat_first_step(single), config.replace(grad_accum_steps=1), b, method,
                                       notes)
    return trace


_COMPILE_NOTE = ("torch.compile: the eager step is estimated (fake tensors cannot run Inductor, whose fused "
                 "kernels usually hold less); a probe on the device measures the compiled step")


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


def _op_workspaces(prof: profile, new_bytes: list[int]) -> list[int]:
    """Per op: the allocator's highest level during the op above its start, less the op's
    outputs — scratch memory no tensor shows (oneDNN reorders, RNN workspaces, sort buffers)."""
    from torch._C._profiler import _EventType

    result = [0] * len(new_bytes)
    for node in walk_events(event_tree(prof)):
        if node.tag != _EventType.TorchOp or not node.name.startswith("memplan_op::"):
            continue
        i = int(node.name.split("::", 1)[1])
        running = peak = 0
        allocs = [(n.start_time_ns, size) for n in walk_events(node.children)
                  if (size := allocated_bytes(n)) is not None]
        for _, size in sorted(allocs, key=lambda e: e[0]):
            running += size
            peak = max(peak, running)
        if i < len(result):
            result[i] = max(0, peak - new_bytes[i])
    return result


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
                       micro_steps=config.pp_microbatches if config.pp > 1 else min(config.grad_accum_steps, 2), batch_offset=batch_offset, foreach=foreach,
                       hooks=hooks)
    for step in range(1, steps + 1):
        run(step)
    (hooks or StepHooks()).phase("end", "end")
