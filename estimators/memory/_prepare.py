"""A trace made ready to replay: kernel workspaces and the cuBLAS workspace put in its events.

A :class:`Prepared` is what the rest of the estimate reads (batch scaling, the allocator
replay, pricing): the trace's allocations and events, with one allocation per op for its
kernel scratch (a CPU target's measured workspaces) and, on CUDA, the cuBLAS workspace
alive from the first forward on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..tracing._events import EventTable
from ..tracing._recorder import Category
from ..tracing._trace import Trace
from ._workspace import Source, WorkspaceFit

__all__ = ["Prepared", "prepare"]


@dataclass(kw_only=True)
class Prepared(EventTable):
    """A trace's event table with the workspace events inserted, ready to replay."""

    method: str
    notes: tuple[str, ...] = ()
    ops: list = field(default_factory=list)
    costs: Any = None
    """The ops' FLOPs and bytes moved, as the time model computes them (``timing.costs_of``
    fills this in once; batch scaling sets it scaled): kept here, computed there."""
    host_allocs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Allocations in host memory on any device (see ``Trace.host_allocs``)."""
    workspaces: tuple[np.ndarray, WorkspaceFit, list[Source | None]] | None = None
    """The kernel workspaces' allocations and where the fit has each: batch scaling sizes
    them from the fit, since a workspace is not affine in the batch size."""
    stage_scale: float = 1.0
    """A pipeline's (``Trace.stage_scale``): its busiest stage's compute over this stage's."""
    send_bytes: int = 0
    """A pipeline's (``Trace.send_bytes``): bytes a stage sends each way per micro-batch."""
    draws: tuple[int, int, int | None] | None = None
    """(real batches, batch offset of the fullest, its peak or None) of a data-dependent
    model's real runs (see ``TraceSource._worst_real_trace``)."""


def prepare(trace: Trace, *, workspaces: Sequence[int] | None, cublas_workspace_bytes: int | None,
            notes: Sequence[str], model: tuple[WorkspaceFit, list[Source | None]] | None) -> Prepared:
    """``trace`` with a workspace allocation per op (``workspaces``, CPU targets) and the
    cuBLAS workspace (``cublas_workspace_bytes``, CUDA targets) inserted in its events;
    ``model`` is the workspace fit and each op's place in it, kept for batch scaling."""
    inserts: list[tuple[int, int, int]] = []  # (event position, bytes, op or -1)
    if workspaces is not None:
        # Every op gets its (possibly zero) workspace event, so traces at different
        # batch sizes keep the same events and stay comparable for batch scaling.
        inserts.extend((pos, w, op) for op, (pos, w) in enumerate(zip(trace.op_positions, workspaces)))
    alloc_bytes = list(trace.alloc_bytes.tolist())
    alloc_cat = list(trace.alloc_category.tolist())
    ev_alloc = trace.event_alloc.tolist()
    ev_sign = trace.event_sign.tolist()
    ev_phase = trace.event_phase.tolist()
    if cublas_workspace_bytes is not None:
        # cuBLAS allocates its workspace through the caching allocator on the first GEMM
        # and keeps it: one allocation alive from the first forward on.
        first_forward = next((i for i, p in enumerate(ev_phase) if p > 0), len(ev_phase))
        inserts.append((first_forward, -cublas_workspace_bytes, -1))
    op_alloc = [-1] * len(trace.ops)  # per op: its workspace allocation
    if inserts:
        ev_alloc, ev_sign, ev_phase = _insert(inserts, alloc_bytes, alloc_cat, op_alloc, ev_alloc, ev_sign, ev_phase)
    return Prepared(
        alloc_bytes=np.asarray(alloc_bytes, dtype=np.int64),
        alloc_category=np.asarray(alloc_cat, dtype=np.int8),
        event_alloc=np.asarray(ev_alloc, dtype=np.int64),
        event_sign=np.asarray(ev_sign, dtype=np.int8),
        event_phase=np.asarray(ev_phase, dtype=np.int32),
        phase_labels=trace.phase_labels,
        method=trace.method,
        notes=tuple(notes),
        ops=trace.ops,
        host_allocs=trace.host_allocs,
        workspaces=None if model is None else (np.asarray(op_alloc, dtype=np.int64), *model),
        draws=(trace.draws, trace.batch_offset, trace.fullest_peak) if trace.draws else None,
        stage_scale=trace.stage_scale,
        send_bytes=trace.send_bytes,
    )


def _insert(inserts: list[tuple[int, int, int]], alloc_bytes: list[int], alloc_cat: list[int], op_alloc: list[int],
            ev_alloc: list[int], ev_sign: list[int], ev_phase: list[int]) -> tuple[list[int], list[int], list[int]]:
    """The events with each insert's allocation (and, for a kernel's scratch, its free) put at
    its position; the new allocations are appended to ``alloc_bytes``/``alloc_cat``."""
    out_alloc, out_sign, out_phase = [], [], []
    inserts.sort(key=lambda x: x[0])
    j = 0
    for i in range(len(ev_alloc) + 1):
        while j < len(inserts) and inserts[j][0] == i:
            pos, nbytes, op = inserts[j]
            phase = ev_phase[min(max(i - 1, 0), len(ev_phase) - 1)] if ev_phase else 0
            index = len(alloc_bytes)
            if op >= 0:
                op_alloc[op] = index
            alloc_bytes.append(abs(nbytes))
            alloc_cat.append(int(Category.WORKSPACE))
            out_alloc.append(index)
            out_sign.append(1)
            out_phase.append(phase)
            if nbytes >= 0:  # a kernel's scratch: freed when the op returns
                out_alloc.append(index)
                out_sign.append(-1)
                out_phase.append(phase)
            j += 1
        if i < len(ev_alloc):
            out_alloc.append(ev_alloc[i])
            out_sign.append(ev_sign[i])
            out_phase.append(ev_phase[i])
    return out_alloc, out_sign, out_phase
