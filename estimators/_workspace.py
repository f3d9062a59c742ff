"""Kernel workspaces on CPU: scratch memory that no tensor shows (oneDNN's weight reorders,
sort buffers), measured by real, profiled runs and carried over to fake traces.

A fit is measured from two real runs of one micro-batch at ``WORKSPACE_ANCHORS``: per phase
kind (forward, backward, each optimizer step), the ops in order with their workspace, the
bytes they created, their FLOPs and bytes moved, each affine in the batch size.

A trace gets its workspaces from the fit of its own precision and checkpointing by aligning
op names within each phase kind (``aligned_workspaces``). A checkpointed configuration runs no
kernel the same configuration without checkpointing lacks: its forward runs the same kernels
(without saving), its backward runs them again before the gradient kernels. So the fit
without checkpointing serves it too (``borrowed_workspaces``), matching each op on what it
computes — name, FLOPs, bytes moved, bytes created at the trace's batch size —, which takes
two real runs per precision instead of two per checkpoint setting.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._config import TrainConfig
from ._task import Task
from ._trace import Trace, trace_step

__all__ = ["WORKSPACE_ANCHORS", "WorkspaceFit", "aligned_workspaces", "borrowed_workspaces", "fit_key",
           "measure_fit", "reference_config"]

WORKSPACE_ANCHORS = (2, 4)
"""Batch sizes of the real, profiled CPU runs that measure kernel workspaces."""

_WS, _NEW, _FLOPS, _MOVED = range(4)  # columns of a fit's per-op arrays

BORROW_MISS = 0.01
"""Share of a trace's significant ops a borrowed fit may leave unmatched (they get no
workspace); more, and the trace's own fit is measured."""


@dataclass(frozen=True)
class WorkspaceFit:
    """Per phase kind: op names in order, and per op ``intercept + slope·b`` of its
    workspace, new bytes, FLOPs and bytes moved (columns ``_WS``, ``_NEW``, ``_FLOPS``,
    ``_MOVED``)."""

    kinds: dict[str, tuple[list[str], np.ndarray, np.ndarray]]

    def at(self, kind: str, batch: int) -> np.ndarray:
        _names, intercept, slope = self.kinds[kind]
        return np.maximum(np.rint(intercept + slope * batch), 0).astype(np.int64)


def fit_key(config: TrainConfig) -> tuple[Any, ...]:
    """Configurations sharing a fit: one device needs the precision and checkpointing (the
    accumulation runs the same kernels); DDP and FSDP2 run other ops in their first step and
    in skipped-sync micro-batches, so their layout and accumulation count too."""
    if config.strategy == "single":
        return (config.precision, config.checkpoint_segments)
    return (config.precision, config.checkpoint_segments, config.strategy, config.world_size,
            min(config.grad_accum_steps, 2))


def reference_config(config: TrainConfig) -> TrainConfig | None:
    """The configuration whose fit ``config`` borrows (one device, checkpointed), else None."""
    if config.strategy == "single" and config.checkpoint_segments:
        return config.replace(checkpoint_segments=0)
    return None


def phase_kind(label: str, config: TrainConfig) -> str:
    """Forward and backward passes run the same kernels in every micro-batch; the first
    optimizer step (which creates the state) differs from the later ones. Under ddp and fsdp
    every phase is its own (see ``measure_fit``)."""
    if config.strategy != "single":
        return label
    kind = label.rsplit(" ", 1)[-1]
    return kind if kind in ("forward", "backward") else f"{label.split(' ')[1]} {kind}"


def ops_by_phase(trace: Trace) -> dict[str, list[int]]:
    """Indices of the significant ops of each phase ("step 1 micro 2 forward", …), in order."""
    out: dict[str, list[int]] = {}
    for i, op in enumerate(trace.ops):
        if op.significant:
            out.setdefault(trace.phase_labels[op.phase], []).append(i)
    return out


def measure_fit(task: Task, config: TrainConfig) -> WorkspaceFit | None:
    """Two real, profiled runs of ``config``'s kernels; None when they fail."""
    if config.strategy == "single":
        # One optimizer step of one micro-batch: every forward and backward kernel runs;
        # optimizer steps allocate no scratch worth measuring (elementwise kernels).
        one, steps = config.replace(grad_accum_steps=1), 1
    else:
        # DDP and FSDP2 run other ops in their first step (lazy initialisation, bucket
        # rebuild) and in skipped-sync micro-batches: the runs have the trace's phases.
        one, steps = config.replace(grad_accum_steps=min(config.grad_accum_steps, 2)), 2
    try:
        runs = [trace_step(task, one, batch_size=a, real=True, profile=True, steps=steps)
                for a in WORKSPACE_ANCHORS]
    except Exception:  # noqa: BLE001 - no workspace model rather than no estimate
        return None
    per_run = []
    for run in runs:
        assert run.op_workspace is not None
        per_run.append({
            phase_kind(phase, config): (
                [run.ops[i].name for i in idx],
                np.asarray([[run.op_workspace[i], run.ops[i].new_bytes, run.ops[i].flops, run.ops[i].bytes_moved]
                            for i in idx], dtype=np.float64).reshape(-1, 4))
            for phase, idx in ops_by_phase(run).items()})
    kinds = {}
    (a0, a1) = WORKSPACE_ANCHORS
    for kind, (names, w0) in per_run[0].items():
        other = per_run[1].get(kind)
        if other is None or other[0] != names:
            continue
        slope = (other[1] - w0) / (a1 - a0)
        kinds[kind] = (names, w0 - slope * a0, slope)
    return WorkspaceFit(kinds)


def aligned_workspaces(trace: Trace, fit: WorkspaceFit) -> list[int] | None:
    """Per-op workspace bytes of ``trace`` from the fit of its own configuration, or None
    when fake and real runs took other kernels.

    Each phase kind of the trace is aligned with the same kind of the fit by op name. Fake
    and real runs can differ in a few ops (autograd may accumulate a gradient in place on
    one and out of place on the other), which the alignment skips."""
    full = [0] * len(trace.ops)
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
                full[i] = int(real[block.a + k, _WS])
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


def borrowed_workspaces(trace: Trace, fit: WorkspaceFit) -> list[int] | None:
    """Per-op workspace bytes of ``trace`` from another configuration's fit (see
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

    ref: dict[str, tuple[list[tuple[Any, ...]], np.ndarray]] = {}
    for kind, (names, _i, _s) in fit.kinds.items():
        at = fit.at(kind, b)
        ref[kind] = ([(n, *row[1:].tolist()) for n, row in zip(names, at)], at[:, _WS])
    all_tokens = [t for tokens, _ in ref.values() for t in tokens]
    all_ws = np.concatenate([ws for _, ws in ref.values()]) if ref else np.zeros(0, dtype=np.int64)
    largest: dict[tuple[Any, ...], int] = {}
    for t, w in zip(all_tokens, all_ws.tolist()):
        largest[t] = max(largest.get(t, 0), w)

    full = [0] * len(trace.ops)
    placed: set[int] = set()
    considered: list[int] = []
    for phase, indices in ops_by_phase(trace).items():
        kind = phase_kind(phase, trace.config)
        if kind not in ref and kind not in ("forward", "backward"):
            continue  # a phase the runs do not have (a later optimizer step): no scratch
        considered.extend(indices)
        if kind in ref:
            tokens, ws = ref[kind]
            _place(indices, [token(i) for i in indices], tokens, ws, full, placed)
        rest = [i for i in indices if i not in placed]
        for run in _runs(rest, indices):
            _place(run, [token(i) for i in run], all_tokens, all_ws, full, placed)
    missing = 0
    for i in considered:
        if i not in placed:
            w = largest.get(token(i))
            if w is None:
                missing += 1
            else:
                full[i] = w
    if missing > BORROW_MISS * max(len(considered), 1):
        return None
    return full


def _place(indices: list[int], mine: list[tuple[Any, ...]], theirs: list[tuple[Any, ...]], ws: np.ndarray,
           full: list[int], placed: set[int]) -> None:
    blocks = difflib.SequenceMatcher(None, theirs, mine, autojunk=False).get_matching_blocks()
    for block in blocks:
        for k in range(block.size):
            i = indices[block.b + k]
            full[i] = int(ws[block.a + k])
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
