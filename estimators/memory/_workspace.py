"""Kernel workspaces on CPU: scratch memory that no tensor shows (oneDNN's weight reorders,
sort buffers), measured by real, profiled runs and carried over to fake traces.

A fit is measured from real runs of one micro-batch at ``WORKSPACE_ANCHORS``: per phase kind
(forward, backward, each optimizer step), the ops in order with their workspace at each
anchor, and the bytes they created, their FLOPs and bytes moved (affine in the batch size).
A workspace is not affine in the batch size: kernels switch algorithms as it grows (oneDNN's
bf16 convolutions by batch 4) and pad a dimension that grows with it to their block (a
native-bf16 GEMM blocks its reduction dimension by 32, so with 16 rows per sample the
weight-gradient GEMM's scratch steps every second batch size). ``workspace_at`` takes the
measured values up to 4, the line of 2 to 4 above, and keeps the step of an odd size.

A trace gets its workspaces from the fit of its own precision and checkpointing by aligning
op names within each phase kind (``aligned_workspaces``). A checkpointed configuration should
run no kernel the same configuration without checkpointing lacks: its forward runs the same
kernels (without saving), its backward runs them again before the gradient kernels. So the
fit without checkpointing serves it too (``borrowed_workspaces``), matching each op on what
it computes — name, FLOPs, bytes moved, bytes created at the trace's batch size —, which
takes the runs of one precision instead of those of each checkpoint setting. One small real
run of a checkpointed configuration confirms it (``borrow_holds``): a block whose
recomputation takes other kernels (another backend inside the backward) has the same ops,
sizes and FLOPs in a fake trace, and only a real run shows its other scratch.

Kernels also switch by size past the anchors, which the anchors cannot show: torch sends a
bf16 or fp16 GEMM to oneDNN only when ``m·n·k`` exceeds 16³ (``checksize`` and
``mkldnn_gemm`` in ``aten/src/ATen/native/mkldnn/Matmul.cpp``; fp16 only where oneDNN has
fp16 kernels, ``ideep::has_fp16_type_support``: avx512_fp16 or avx_ne_convert) and runs the
others on a reference kernel without scratch. A layer too small to cross that line at
batch 4 runs oneDNN's kernel, with its scratch, at a larger batch (an MLP of 16-64-4 in
bf16-true: 36% of its peak at batch 32). So the fit keeps the arguments of each compute op
(the ops torch counts FLOPs of) at the anchors, and an op without scratch there is run
alone, for real, at the batch asked once it is larger than every op of its kind seen
without scratch, where its kind was seen to allocate (``switched_workspaces``). No dtype
or instruction set is assumed: whether a kind of op allocates is what the anchors or one
probe of it show.

Ops with scratch at the anchors switch past them as well (a bf16 convolution's backward on
this project's AVX-512-BF16 machine; GEMMs blocked by other sizes on CPUs with other
kernels), so they too are run alone at the batch asked when small enough, each once checked:
its run alone at the largest anchor must give what the step measured there, else its line
stays. Identical calls (a block stack's) run once.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from .._config import TrainConfig
from ..task._task import Task
from ..tracing._profiler import collector_paused, memory_profile
from ..tracing._trace import Trace, trace_step

__all__ = ["WORKSPACE_ANCHORS", "Source", "WorkspaceFit", "aligned_sources", "aligned_workspaces",
           "borrow_holds", "borrowed_sources", "borrowed_workspaces", "fit_key", "measure_fit",
           "reference_config", "switched_workspaces", "workspace_at", "workspaces_at"]

WORKSPACE_ANCHORS = (2, 3, 4)
"""Batch sizes of the real, profiled CPU runs that measure kernel workspaces (see
``workspace_at``)."""

Source = tuple[str, int]
"""Where an op's workspace comes from: a phase kind of a fit and the op's row in it."""

_WS, _NEW, _FLOPS, _MOVED = range(4)  # columns of a fit's per-op arrays

BORROW_MISS = 0.01
"""Share of a trace's significant ops a borrowed fit may leave unmatched (they get no
workspace); more, and the trace's own fit is measured."""

REPLAY_MAX_FLOPS = 1 << 26
"""Largest op (FLOPs at the batch asked) ``switched_workspaces`` runs alone: ~10 ms on one
core. Size switches concern ops that were small at the anchors (16³ multiply-adds for
torch's oneDNN GEMMs); a larger one is not replayed and keeps the fit's figure."""


@dataclass(frozen=True)
class Replay:
    """A compute op's arguments at the anchors, to run it alone at another batch size:
    ``func`` and the arguments' structure (``skeleton``: dtypes, flags, floats), and per
    anchor the integers in it (sizes, strides, integer arguments), affine in the batch."""

    func: Any
    skeleton: Any
    ints: np.ndarray  # (anchors, n) integers of the arguments at each anchor

    def arguments_at(self, batch: int) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Real tensors and arguments of the op at ``batch``; None where an integer is not
        affine in the batch or lands off the integers."""
        a0, a1 = WORKSPACE_ANCHORS[0], WORKSPACE_ANCHORS[-1]
        values = []
        for column in self.ints.T.tolist():
            slope = Fraction(column[-1] - column[0], a1 - a0)
            if any(v != column[0] + slope * (a - a0) for a, v in zip(WORKSPACE_ANCHORS, column)):
                return None
            value = column[0] + slope * (batch - a0)
            if value.denominator != 1 or value < 0:
                return None
            values.append(int(value))
        args, kwargs = _rebuild(self.skeleton, iter(values))
        return tuple(args), dict(kwargs)


@dataclass(frozen=True)
class WorkspaceFit:
    """Per phase kind: op names in order, and per op ``intercept + slope·b`` of its new
    bytes, FLOPs and bytes moved (columns ``_NEW``, ``_FLOPS``, ``_MOVED``); ``measured``
    holds each op's workspace at every anchor (column ``_WS`` comes from ``workspace_at``).
    ``replays``: per phase kind, the compute ops' arguments by row, for the ops whose kernel
    may switch past the anchors (see ``switched_workspaces``), whose figures ``switched``
    keeps per batch size; ``probed``: per group of ops without scratch at the anchors,
    whether one of them, run larger, showed some."""

    kinds: dict[str, tuple[list[str], np.ndarray, np.ndarray]]
    measured: dict[str, np.ndarray]
    replays: dict[str, dict[int, Replay]] = field(default_factory=dict)
    switched: dict[int, dict[Source, int]] = field(default_factory=dict, compare=False, repr=False)
    probed: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)
    faithful: dict[Source, bool] = field(default_factory=dict, compare=False, repr=False)

    def at(self, kind: str, batch: int) -> np.ndarray:
        _names, intercept, slope = self.kinds[kind]
        out = np.maximum(np.rint(intercept + slope * batch), 0).astype(np.int64)
        out[:, _WS] = workspace_at(self.measured[kind], batch)
        return out

    def workspace(self, kind: str, batch: int) -> np.ndarray:
        """Per op of ``kind``: its workspace bytes at ``batch``, with those of the ops whose
        kernel switched past the anchors measured at ``batch`` (``switched_workspaces``)."""
        out = workspace_at(self.measured[kind], batch)
        if batch > WORKSPACE_ANCHORS[-1] and self.replays:
            switched = self.switched.get(batch)
            if switched is None:
                switched = self.switched[batch] = switched_workspaces(self, batch)
            for (k, row), value in switched.items():
                if k == kind:
                    out[row] = value
        return out


def workspace_at(measured: np.ndarray, batch: int) -> np.ndarray:
    """Per op: workspace bytes at ``batch`` from its values at the anchors 2, 3, 4 (columns
    of ``measured``).

    Up to 4, the measured values and straight lines between them; above, the line through 2
    and 4. An op whose scratch at 3 lies above that line pads the batch dimension to an even
    size, and odd sizes keep that step. (A slope taken from 4 and 8 instead, past oneDNN's
    switches at 4, made ViT and GPT estimates 3-6% high at batch 16-24: kernels split large
    GEMMs in blocks, so their scratch grows slower than 4 to 8 shows; see
    ``benchmarks/results/workspace_isa.md``.)"""
    w = np.asarray(measured, dtype=np.float64).reshape(-1, len(WORKSPACE_ANCHORS))
    a2, a3, a4 = WORKSPACE_ANCHORS
    w2, w3, w4 = (w[:, k] for k in range(3))
    if batch <= a3:  # below 2, kernels differ anyway (the estimator runs such batches for real)
        value = w2 + (w3 - w2) * min(max(batch - a2, 0), 1)
    elif batch <= a4:
        value = w3 + (w4 - w3) * (batch - a3)
    else:
        value = w4 + (w4 - w2) * (batch - a4) / (a4 - a2)
        if batch % 2:
            value = value + np.maximum(w3 - (w2 + w4) / 2, 0)
    return np.maximum(np.rint(value), 0).astype(np.int64)


def fit_key(config: TrainConfig) -> tuple[Any, ...]:
    """Configurations sharing a fit: one device needs the precision and checkpointing (the
    accumulation runs the same kernels); DDP and FSDP2 run other ops in their first step and
    in skipped-sync micro-batches, so their layout and accumulation count too; a tensor-parallel
    rank runs its kernels at the shard's shapes, so the degree counts."""
    if config.strategy == "single" and config.tp == 1 and config.pp == 1:
        return (config.precision, config.checkpoint_segments, config.checkpoint_policy, config.optimizer_in_backward)
    return (config.precision, config.checkpoint_segments, config.checkpoint_policy, config.strategy,
            config.world_size, min(config.grad_accum_steps, 2), config.cpu_offload, config.tp,
            config.sequence_parallel, config.dp_replicate) + (
        (config.pp, config.pp_schedule, config.pp_microbatches) if config.pp > 1 else ())


def reference_config(config: TrainConfig) -> TrainConfig | None:
    """The configuration whose fit ``config`` borrows (one device, checkpointed), else None."""
    if config.strategy == "single" and config.tp == 1 and config.pp == 1 and config.checkpoint_segments:
        return config.replace(checkpoint_segments=0, checkpoint_policy="full")
    return None


def phase_kind(label: str, config: TrainConfig) -> str:
    """Forward and backward passes run the same kernels in every micro-batch; the first
    optimizer step (which creates the state) differs from the later ones, and so does the
    first backward when the optimizer steps in it. Under ddp and fsdp
    every phase is its own (see ``measure_fit``), and so is each of a pipeline's (its stage
    starts each micro-batch differently, as the schedule receives, sends and frees)."""
    if config.strategy != "single" or config.pp > 1:
        return label
    kind = label.rsplit(" ", 1)[-1]
    # With the optimizer step in backward, the first backward creates the state too.
    if kind == "forward" or (kind == "backward" and not config.optimizer_in_backward):
        return kind
    return f"{label.split(' ')[1]} {kind}"


def ops_by_phase(trace: Trace) -> dict[str, list[int]]:
    """Indices of the significant ops of each phase ("step 1 micro 2 forward", …), in order."""
    out: dict[str, list[int]] = {}
    for i, op in enumerate(trace.ops):
        if op.significant:
            out.setdefault(trace.phase_labels[op.phase], []).append(i)
    return out


def measure_fit(task: Task, config: TrainConfig, *, stage: int | None = None) -> WorkspaceFit | None:
    """Real, profiled runs of ``config``'s kernels at ``WORKSPACE_ANCHORS``; None when they
    fail. A pipeline's are of the stage of rank ``stage`` (the trace's)."""
    if config.strategy == "single" and config.pp == 1:
        # One optimizer step of one micro-batch: every forward and backward kernel runs;
        # optimizer steps allocate no scratch worth measuring (elementwise kernels).
        # With the optimizer step in backward, the first backward differs from the later
        # ones (it creates the state): two steps.
        one, steps = config.replace(grad_accum_steps=1), 2 if config.optimizer_in_backward else 1
    else:
        # DDP and FSDP2 run other ops in their first step (lazy initialisation, bucket
        # rebuild) and in skipped-sync micro-batches, a pipeline in its first (the stage's
        # buffers): the runs have the trace's phases.
        one, steps = config.replace(grad_accum_steps=min(config.grad_accum_steps, 2)), 2

    Run = dict[str, tuple[list[str], np.ndarray, list[tuple[Any, Any, list[int]] | None]]]

    def run(batch: int) -> Run:
        arguments = _Arguments()
        trace = trace_step(task, one, batch_size=batch, real=True, profile=True, steps=steps, on_compute=arguments,
                           stage=stage if config.pp > 1 else None)
        assert trace.op_workspace is not None
        ws = trace.op_workspace
        return {phase_kind(phase, config): (
                    [trace.ops[i].name for i in idx],
                    np.asarray([[ws[i], trace.ops[i].new_bytes, trace.ops[i].flops,
                                 trace.ops[i].bytes_moved] for i in idx], dtype=np.float64).reshape(-1, 4),
                    [arguments.recorded.get(i) for i in idx])
                for phase, idx in ops_by_phase(trace).items()}

    try:
        per_run = [run(a) for a in WORKSPACE_ANCHORS]
    except Exception:  # noqa: BLE001 - no workspace model rather than no estimate
        return None
    kinds: dict[str, tuple[list[str], np.ndarray, np.ndarray]] = {}
    measured: dict[str, np.ndarray] = {}
    replays: dict[str, dict[int, Replay]] = {}
    a0, a1 = WORKSPACE_ANCHORS[0], WORKSPACE_ANCHORS[-1]
    for kind, (names, w0, args0) in per_run[0].items():
        others = [r[kind] for r in per_run[1:] if kind in r]
        if len(others) < len(per_run) - 1 or any(other[0] != names for other in others):
            continue  # other kernels at another size: this phase kind gets no workspace
        slope = (others[-1][1] - w0) / (a1 - a0)
        kinds[kind] = (names, w0 - slope * a0, slope)
        measured[kind] = np.stack([w0[:, _WS]] + [other[1][:, _WS] for other in others], axis=1)
        rows = {}
        for row, recorded in enumerate(zip(args0, *(other[2] for other in others))):
            replay = _replay_of(list(recorded))
            if replay is not None:
                rows[row] = replay
        if rows:
            replays[kind] = rows
    return WorkspaceFit(kinds, measured, replays)


def workspaces_at(fit: WorkspaceFit, sources: list[Source | None], batch: int) -> list[int]:
    """Per op: the workspace bytes of its source at ``batch`` (0 where it has none)."""
    at = {kind: fit.workspace(kind, batch) for kind in {s[0] for s in sources if s is not None}}
    return [0 if s is None else int(at[s[0]][s[1]]) for s in sources]


def aligned_workspaces(trace: Trace, fit: WorkspaceFit) -> list[int] | None:
    """Per-op workspace bytes of ``trace`` from the fit of its own configuration (see
    ``aligned_sources``)."""
    sources = aligned_sources(trace, fit)
    return None if sources is None else workspaces_at(fit, sources, trace.batch_size)


def borrowed_workspaces(trace: Trace, fit: WorkspaceFit) -> list[int] | None:
    """Per-op workspace bytes of ``trace`` from another configuration's fit (see
    ``borrowed_sources``)."""
    sources = borrowed_sources(trace, fit)
    return None if sources is None else workspaces_at(fit, sources, trace.batch_size)


def aligned_sources(trace: Trace, fit: WorkspaceFit) -> list[Source | None] | None:
    """Per op of ``trace``: its row in the fit of its own configuration, or None when fake
    and real runs took other kernels.

    Each phase kind of the trace is aligned with the same kind of the fit by op name. Fake
    and real runs can differ in a few ops (autograd may accumulate a gradient in place on
    one and out of place on the other), which the alignment skips."""
    full: list[Source | None] = [None] * len(trace.ops)
    matched = total = real_new = size_gap = 0
    for phase, indices in ops_by_phase(trace).items():
        kind = phase_kind(phase, trace.config)
        if kind not in fit.kinds:
            if kind in ("forward", "backward"):
                total += len(indices)
            continue
        names = fit.kinds[kind][0]
        mine = [trace.ops[i].name for i in indices]
        blocks = difflib.SequenceMatcher(None, names, mine, autojunk=False).get_matching_blocks()
        real = fit.at(kind, trace.batch_size)
        for block in blocks:
            for k in range(block.size):
                i = indices[block.b + k]
                full[i] = (kind, block.a + k)
                real_new += int(real[block.a + k, _NEW])
                size_gap += abs(int(real[block.a + k, _NEW]) - trace.ops[i].new_bytes)
        matched += sum(b.size for b in blocks)
        total += max(len(mine), len(names))
    # A poor match, or matched ops whose outputs differ in size, means fake tensors took
    # other kernels than the CPU runs (oneDNN's LSTM, whose meta kernel cannot know the
    # real workspace output).
    if matched < 0.9 * max(total, 1) or size_gap > 0.01 * max(real_new, 1):
        return None
    return full


def borrowed_sources(trace: Trace, fit: WorkspaceFit) -> list[Source | None] | None:
    """Per op of ``trace``: its row in another configuration's fit (see
    ``reference_config``), or None when too few of its ops are found there.

    Ops are compared by what they compute at the trace's batch size: name, FLOPs, bytes moved
    and bytes created. Each phase kind is first aligned in order with the same kind of the
    fit, which tells apart equal-looking kernels by their place (two matrix products of one
    shape, one on a transposed operand). The ops left — a checkpointed forward recomputed
    inside the backward — are aligned with the fit's whole sequence, and what is still
    unplaced takes the largest workspace of an identical op anywhere in the fit."""
    b = trace.batch_size

    def token(i: int) -> tuple[Any, ...]:
        op = trace.ops[i]
        return (op.name, op.new_bytes, op.flops, op.bytes_moved)

    ref: dict[str, tuple[list[tuple[Any, ...]], list[Source], np.ndarray]] = {}
    for kind, (names, _i, _s) in fit.kinds.items():
        at = fit.at(kind, b)
        ref[kind] = ([(n, *row[1:].tolist()) for n, row in zip(names, at)],
                     [(kind, r) for r in range(len(names))], at[:, _WS])
    all_tokens = [t for tokens, _, _ in ref.values() for t in tokens]
    all_sources = [s for _, sources, _ in ref.values() for s in sources]
    largest: dict[tuple[Any, ...], tuple[int, Source]] = {}
    for t, src, w in zip(all_tokens, all_sources, (w for _, _, ws in ref.values() for w in ws.tolist())):
        if t not in largest or w > largest[t][0]:
            largest[t] = (w, src)

    full: list[Source | None] = [None] * len(trace.ops)
    placed: set[int] = set()
    considered: list[int] = []
    for phase, indices in ops_by_phase(trace).items():
        kind = phase_kind(phase, trace.config)
        if kind not in ref and kind not in ("forward", "backward"):
            continue  # a phase the runs do not have (a later optimizer step): no scratch
        considered.extend(indices)
        if kind in ref:
            tokens, sources, _ws = ref[kind]
            _place(indices, [token(i) for i in indices], tokens, sources, full, placed)
        rest = [i for i in indices if i not in placed]
        for run in _runs(rest, indices):
            _place(run, [token(i) for i in run], all_tokens, all_sources, full, placed)
    missing = 0
    for i in considered:
        if i not in placed:
            found = largest.get(token(i))
            if found is None:
                missing += 1
            else:
                full[i] = found[1]
    if missing > BORROW_MISS * max(len(considered), 1):
        return None
    return full


def borrow_holds(task: Task, config: TrainConfig, fit: WorkspaceFit) -> bool:
    """Does ``fit`` (of ``reference_config(config)``) give the workspaces of ``config``?

    One real, profiled run of ``config`` at the smallest anchor checks it: the checkpointed
    backward could run its recomputed forward on other kernels than the plain forward (other
    strides, another precision), which no fit of the plain configuration shows."""
    try:
        run = trace_step(task, config.replace(grad_accum_steps=1), batch_size=WORKSPACE_ANCHORS[0],
                         real=True, profile=True, steps=1)
    except Exception:  # noqa: BLE001 - no check: measure the configuration's own fit
        return False
    truth, run.op_workspace = run.op_workspace, None
    got = borrowed_workspaces(run, fit)
    if truth is None or got is None:
        return False
    significant = [i for i, op in enumerate(run.ops) if op.significant]
    miss = sum(abs(got[i] - truth[i]) for i in significant)
    return miss <= BORROW_MISS * max(sum(truth[i] for i in significant), 1)


def _place(indices: list[int], mine: list[tuple[Any, ...]], theirs: list[tuple[Any, ...]],
           sources: list[Source], full: list[Source | None], placed: set[int]) -> None:
    blocks = difflib.SequenceMatcher(None, theirs, mine, autojunk=False).get_matching_blocks()
    for block in blocks:
        for k in range(block.size):
            i = indices[block.b + k]
            full[i] = sources[block.a + k]
            placed.add(i)


def _runs(rest: list[int], order: list[int]) -> list[list[int]]:
    """``rest`` cut into runs that are contiguous in ``order``."""
    position = {i: k for k, i in enumerate(order)}
    runs: list[list[int]] = []
    for i in rest:
        if runs and position[i] == position[runs[-1][-1]] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class _Arguments:
    """The arguments of the compute ops of a real run (``trace_step``'s ``on_compute``), by
    op index: sizes, strides and dtypes, never the tensors (which would outlive their op)."""

    def __init__(self) -> None:
        self.recorded: dict[int, tuple[Any, Any, list[int]]] = {}

    def __call__(self, index: int, func: Any, args: Any, kwargs: Any) -> None:
        ints: list[int] = []
        try:
            self.recorded[index] = (func, _skeleton((args, kwargs), ints), ints)
        except _Unreplayable:
            pass


class _Unreplayable(Exception):
    pass


_PLAIN = (bool, float, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _skeleton(obj: Any, ints: list[int]) -> Any:
    """``obj`` with its integers (and tensors' sizes and strides) moved into ``ints``."""
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided:
            raise _Unreplayable  # a subclass (DTensor, fake) runs other code
        ints.extend(obj.shape)
        ints.extend(obj.stride())
        return ("tensor", obj.dtype, obj.dim())
    if isinstance(obj, _PLAIN):
        return ("value", obj)
    if isinstance(obj, int):
        ints.append(obj)
        return ("int",)
    if isinstance(obj, (list, tuple)):
        return ("list" if isinstance(obj, list) else "tuple", tuple(_skeleton(x, ints) for x in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((k, _skeleton(v, ints)) for k, v in obj.items()))
    raise _Unreplayable


def _rebuild(skeleton: Any, ints: Any) -> Any:
    """The arguments of ``skeleton`` with the integers ``ints`` (an iterator) put back:
    tensors of those sizes and strides over zeroed storage."""
    tag = skeleton[0]
    if tag == "tensor":
        _tag, dtype, dim = skeleton
        shape = [next(ints) for _ in range(dim)]
        stride = [next(ints) for _ in range(dim)]
        extent = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))
        return torch.zeros(extent, dtype=dtype).as_strided(shape, stride)
    if tag == "value":
        return skeleton[1]
    if tag == "int":
        return next(ints)
    if tag in ("list", "tuple"):
        items = [_rebuild(x, ints) for x in skeleton[1]]
        return items if tag == "list" else tuple(items)
    return {k: _rebuild(v, ints) for k, v in skeleton[1]}


def _replay_of(recorded: list[tuple[Any, Any, list[int]] | None]) -> Replay | None:
    """The op recorded at every anchor as one ``Replay``, when it has the same structure there."""
    if any(r is None for r in recorded):
        return None
    first = recorded[0]
    assert first is not None
    if any(r is not None and (r[0] != first[0] or r[1] != first[1] or len(r[2]) != len(first[2]))
           for r in recorded[1:]):
        return None
    return Replay(first[0], first[1], np.asarray([r[2] for r in recorded if r is not None], dtype=np.int64))


def switched_workspaces(fit: WorkspaceFit, batch: int) -> dict[Source, int]:
    """The ops of ``fit`` whose kernel may have switched between the anchors and ``batch``,
    run alone at ``batch``, with the workspace each showed.

    Ops are grouped by name (a kind of kernel: ``aten.mm``, ``aten.convolution``). An op with
    no scratch at any anchor is run when, at ``batch``, it is larger (in FLOPs) than the
    largest op of its group seen without scratch at an anchor, and its group allocates
    scratch past some size: another op of the group had scratch at an anchor, or, where none
    had, the group's fastest-growing op shows some when run once at its size for
    ``REPLAY_MAX_FLOPS`` (a probe per group and fit: torch's oneDNN GEMMs pass 16³
    multiply-adds, and a group that allocates nothing there, like fp32 GEMMs, is run no more)."""
    groups: dict[str, list[tuple[Source, float, float, bool]]] = {}  # name -> (op, flops at 0, per sample, loud)
    quiet: dict[str, float] = {}  # name -> largest FLOPs seen without scratch at an anchor
    for kind, (names, intercept, slope) in fit.kinds.items():
        ws = fit.measured[kind]
        for row, name in enumerate(names):
            f0, f1 = float(intercept[row, _FLOPS]), float(slope[row, _FLOPS])
            if f1 <= 0 and f0 <= 0:
                continue  # no FLOPs: not a compute op
            for a, w in zip(WORKSPACE_ANCHORS, ws[row]):
                if w == 0:
                    quiet[name] = max(quiet.get(name, 0.0), f0 + f1 * a)
            groups.setdefault(name, []).append(((kind, row), f0, f1, bool(ws[row].any())))

    def replayable(src: Source) -> bool:
        return src[1] in fit.replays.get(src[0], {})

    unprobed: dict[str, tuple[Source, int]] = {}
    for name, ops in groups.items():
        if name in fit.probed or any(loud for *_op, loud in ops):
            continue
        silent = [(f1, src, f0) for src, f0, f1, _loud in ops if f1 > 0 and replayable(src)]
        if not silent:
            fit.probed[name] = False
            continue
        f1, src, f0 = max(silent)
        at = int((REPLAY_MAX_FLOPS - f0) // f1)
        if at <= WORKSPACE_ANCHORS[-1] or f0 + f1 * at <= quiet.get(name, 0.0):
            fit.probed[name] = False
            continue
        unprobed[name] = (src, at)
    if unprobed:
        found = _replayed(fit, [(src, at) for src, at in unprobed.values()])
        for name, (src, _at) in unprobed.items():
            fit.probed[name] = found.get(src, 0) > 0
    wanted = [(src, batch) for name, ops in groups.items()
              if fit.probed.get(name, True) or any(loud for *_op, loud in ops)
              for src, f0, f1, loud in ops
              if not loud and quiet.get(name, 0.0) < f0 + f1 * batch <= REPLAY_MAX_FLOPS and replayable(src)]
    # Ops with scratch at the anchors switch too (a bf16 convolution's backward here; GEMMs
    # block the batch dimension by other sizes on other CPUs), so the line through the anchors
    # is kept only for ops too large to run alone, and for ops whose run alone at the largest
    # anchor does not give what the step measured there.
    loud = [(src, f0, f1) for ops in groups.values() for src, f0, f1, is_loud in ops if is_loud and replayable(src)]
    loud = [(src, f0, f1) for src, f0, f1 in loud if f0 + f1 * batch <= REPLAY_MAX_FLOPS]
    unchecked = [(src, WORKSPACE_ANCHORS[-1]) for src, _f0, _f1 in loud if src not in fit.faithful]
    if unchecked:
        alone = _replayed(fit, unchecked)
        for src, _a in unchecked:
            fit.faithful[src] = src in alone and alone[src] == int(fit.measured[src[0]][src[1], -1])
    wanted += [(src, batch) for src, _f0, _f1 in loud if fit.faithful[src]]
    return _replayed(fit, wanted) if wanted else {}


def _replayed(fit: WorkspaceFit, calls: list[tuple[Source, int]]) -> dict[Source, int]:
    """Each op of ``calls`` (with its batch size) run alone under the profiler: the
    allocator's highest level during it, less its new outputs (as a step's workspaces are
    measured, ``trace._op_workspaces``). Ops that cannot be rebuilt or fail are left out."""
    # A block stack repeats its ops: each distinct call (op, argument structure, sizes) runs once.
    built: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    runs_of: dict[Source, int] = {}
    distinct: dict[tuple[Any, ...], int] = {}
    for src, batch in calls:
        replay = fit.replays[src[0]][src[1]]
        key = (replay.func, replay.skeleton, batch, replay.ints.tobytes())
        if key not in distinct:
            arguments = replay.arguments_at(batch)
            if arguments is None:
                continue
            distinct[key] = len(built)
            built.append((replay.func, *arguments))
        runs_of[src] = distinct[key]
    if not built:
        return {}
    from torch._C._profiler import _EventType

    news: dict[int, int] = {}
    try:
        with collector_paused(), torch.no_grad(), memory_profile(collect=False) as prof:
            for k, (func, args, kwargs) in enumerate(built):
                inputs = {t.untyped_storage().data_ptr() for t in _leaves((args, kwargs))}
                with torch.profiler.record_function(f"memplan_replay::{k}"):
                    out = func(*args, **kwargs)
                outputs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _leaves(out)}
                news[k] = sum(n for ptr, n in outputs.items() if ptr not in inputs)
                del out
    except Exception:  # noqa: BLE001 - no replay: the fit's figures stand
        return {}

    def walk(nodes: Any) -> Any:
        for n in nodes:
            yield n
            yield from walk(n.children)

    measured: dict[int, int] = {}
    for node in walk(prof.profiler.kineto_results.experimental_event_tree()):
        if node.tag != _EventType.TorchOp or not node.name.startswith("memplan_replay::"):
            continue
        k = int(node.name.split("::", 1)[1])
        running = peak = 0
        allocs = [n for n in walk(node.children) if n.tag == _EventType.Allocation]
        for a in sorted(allocs, key=lambda e: e.start_time_ns):
            running += a.extra_fields.alloc_size
            peak = max(peak, running)
        measured[k] = max(0, peak - news[k])
    return {src: measured[k] for src, k in runs_of.items() if k in measured}


def _leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _leaves(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _leaves(x)]
    return []
