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
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._config import TrainConfig
from .._task import Task
from ..tracing._trace import Trace, trace_step

__all__ = ["WORKSPACE_ANCHORS", "Source", "WorkspaceFit", "aligned_sources", "aligned_workspaces",
           "borrow_holds", "borrowed_sources", "borrowed_workspaces", "fit_key", "measure_fit",
           "reference_config", "workspace_at", "workspaces_at"]

WORKSPACE_ANCHORS = (2, 3, 4)
"""Batch sizes of the real, profiled CPU runs that measure kernel workspaces (see
``workspace_at``)."""

Source = tuple[str, int]
"""Where an op's workspace comes from: a phase kind of a fit and the op's row in it."""

_WS, _NEW, _FLOPS, _MOVED = range(4)  # columns of a fit's per-op arrays

BORROW_MISS = 0.01
"""Share of a trace's significant ops a borrowed fit may leave unmatched (they get no
workspace); more, and the trace's own fit is measured."""


@dataclass(frozen=True)
class WorkspaceFit:
    """Per phase kind: op names in order, and per op ``intercept + slope·b`` of its new
    bytes, FLOPs and bytes moved (columns ``_NEW``, ``_FLOPS``, ``_MOVED``); ``measured``
    holds each op's workspace at every anchor (column ``_WS`` comes from ``workspace_at``)."""

    kinds: dict[str, tuple[list[str], np.ndarray, np.ndarray]]
    measured: dict[str, np.ndarray]

    def at(self, kind: str, batch: int) -> np.ndarray:
        _names, intercept, slope = self.kinds[kind]
        out = np.maximum(np.rint(intercept + slope * batch), 0).astype(np.int64)
        out[:, _WS] = workspace_at(self.measured[kind], batch)
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
    in skipped-sync micro-batches, so their layout and accumulation count too."""
    if config.strategy == "single":
        return (config.precision, config.checkpoint_segments, config.checkpoint_policy, config.optimizer_in_backward)
    return (config.precision, config.checkpoint_segments, config.checkpoint_policy, config.strategy,
            config.world_size, min(config.grad_accum_steps, 2), config.cpu_offload)


def reference_config(config: TrainConfig) -> TrainConfig | None:
    """The configuration whose fit ``config`` borrows (one device, checkpointed), else None."""
    if config.strategy == "single" and config.checkpoint_segments:
        return config.replace(checkpoint_segments=0, checkpoint_policy="full")
    return None


def phase_kind(label: str, config: TrainConfig) -> str:
    """Forward and backward passes run the same kernels in every micro-batch; the first
    optimizer step (which creates the state) differs from the later ones, and so does the
    first backward when the optimizer steps in it. Under ddp and fsdp
    every phase is its own (see ``measure_fit``)."""
    if config.strategy != "single":
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


def measure_fit(task: Task, config: TrainConfig) -> WorkspaceFit | None:
    """Real, profiled runs of ``config``'s kernels at ``WORKSPACE_ANCHORS``; None when they
    fail."""
    if config.strategy == "single":
        # One optimizer step of one micro-batch: every forward and backward kernel runs;
        # optimizer steps allocate no scratch worth measuring (elementwise kernels).
        # With the optimizer step in backward, the first backward differs from the later
        # ones (it creates the state): two steps.
        one, steps = config.replace(grad_accum_steps=1), 2 if config.optimizer_in_backward else 1
    else:
        # DDP and FSDP2 run other ops in their first step (lazy initialisation, bucket
        # rebuild) and in skipped-sync micro-batches: the runs have the trace's phases.
        one, steps = config.replace(grad_accum_steps=min(config.grad_accum_steps, 2)), 2

    def run(batch: int) -> dict[str, tuple[list[str], np.ndarray]]:
        trace = trace_step(task, one, batch_size=batch, real=True, profile=True, steps=steps)
        assert trace.op_workspace is not None
        return {phase_kind(phase, config): (
                    [trace.ops[i].name for i in idx],
                    np.asarray([[trace.op_workspace[i], trace.ops[i].new_bytes, trace.ops[i].flops,
                                 trace.ops[i].bytes_moved] for i in idx], dtype=np.float64).reshape(-1, 4))
                for phase, idx in ops_by_phase(trace).items()}

    try:
        per_run = [run(a) for a in WORKSPACE_ANCHORS]
    except Exception:  # noqa: BLE001 - no workspace model rather than no estimate
        return None
    kinds, measured = {}, {}
    a0, a1 = WORKSPACE_ANCHORS[0], WORKSPACE_ANCHORS[-1]
    for kind, (names, w0) in per_run[0].items():
        others = [r.get(kind) for r in per_run[1:]]
        if any(other is None or other[0] != names for other in others):
            continue  # other kernels at another size: this phase kind gets no workspace
        slope = (others[-1][1] - w0) / (a1 - a0)
        kinds[kind] = (names, w0 - slope * a0, slope)
        measured[kind] = np.stack([w0[:, _WS]] + [other[1][:, _WS] for other in others], axis=1)
    return WorkspaceFit(kinds, measured)


def workspaces_at(fit: WorkspaceFit, sources: list[Source | None], batch: int) -> list[int]:
    """Per op: the workspace bytes of its source at ``batch`` (0 where it has none)."""
    at = {kind: fit.at(kind, batch)[:, _WS] for kind in {s[0] for s in sources if s is not None}}
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
