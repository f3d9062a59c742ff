"""The traces of one task on one target, each made once and kept ready to replay.

:class:`TraceSource` answers ``prepared(config, batch)``: a fake trace of the step (or, for a
CPU target's smallest batches and for models whose shapes depend on data values, real runs),
with the kernel workspaces put in (``memory._prepare``). It keeps what it traced, the
accumulation-1 traces that come free with accumulation 2 (``Trace.single_micro``), and, with
its :class:`~estimators.estimator._prefetch.Prefetching` half, what a worker process traced for it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TypeAlias

import numpy as np
import torch

from .._config import TrainConfig
from ..hardware._gpus import GPUSpec
from ..memory._prepare import Prepared, prepare
from ..memory._workspace import WORKSPACE_ANCHORS
from ..memory._workspace_cache import DIVERGED, WorkspaceFits
from ..task._task import Task
from ..tracing._compose import CutCache, compose_enabled, trace_composed
from ..tracing._trace import DataDependentShapes, Trace, trace_step
from ._prefetch import Prefetching

__all__ = ["DATA_DEPENDENT_CAPACITY", "DATA_DEPENDENT_DRAWS", "ShapeKey", "TraceKey", "TraceSource"]

ShapeKey: TypeAlias = tuple[int, str, int, str, int, "tuple[str, tuple[int, ...]] | None", str, bool, bool, bool, int, bool, int,
                            "tuple[int, str, int] | None"]
"""What traces of one shape share (:meth:`TraceSource.shape_key`): everything but the micro-batch size."""

TraceKey: TypeAlias = tuple[ShapeKey, int]
"""One trace: its shape and its micro-batch size."""

DATA_DEPENDENT_DRAWS = 4
"""Real two-step runs (disjoint batches) a model with data-dependent shapes is measured on;
its estimate is the fullest, and says so."""

DATA_DEPENDENT_CAPACITY = 1.25
"""Allocations whose size differed between those runs (an expert's tokens, say) are held at this
multiple of the largest seen, as a mixture-of-experts capacity factor of 1.25 bounds an
expert's load: training moves a router, and an epoch meets batches the runs did not (on
moe_dynamic the largest seen alone fell 0.46% below a real epoch's peak; x1.1 just above it)."""


class TraceSource(Prefetching):
    """Prepared traces of ``task`` per (shape, micro-batch size), for one target device."""

    def __init__(self, task: Task, device: str, spec: GPUSpec | None, lock: threading.RLock, *,
                 compose_blocks: bool | None = None) -> None:
        self.task, self.device, self.spec = task, device, spec
        self.compose_blocks = compose_enabled() if compose_blocks is None else compose_blocks
        """Compose a deep block stack's fake traces from traces of the model cut short
        (``tracing._compose``); off with ``MEMPLAN_FULL_TRACE=1``."""
        self._cuts: CutCache = {}  # cut traces, shared by stacks checkpointed alike
        self._lock = lock
        self._prepared: dict[TraceKey, Prepared] = {}
        # Traces of accumulation 1 derived from traces of accumulation 2, not yet prepared.
        self._derived: dict[TraceKey, Trace] = {}
        self._data_dependent = False
        self._fake_traced = False  # a fake trace succeeded: shapes follow sizes, not values
        self._last_fake_trace_s = 0.0
        self.workspace_fits = WorkspaceFits(task, lock)
        self._init_prefetch()

    @property
    def data_dependent(self) -> bool:
        """Do this model's shapes depend on its data (so it is measured with real runs)?"""
        return self._data_dependent

    def shape_key(self, config: TrainConfig) -> ShapeKey:
        # Everything but the micro-batch size; accumulation beyond 2 traces the same as 2.
        # With items of varying shape, the items that set the planned batch's padded size.
        # (The checkpoint policy goes last: ``_derivable`` reads the strategy by position.)
        planned = self.task.planned(config.micro_batch_size)
        return (min(config.grad_accum_steps, 2), config.precision, config.checkpoint_segments,
                config.strategy, config.world_size, planned.key() if planned is not None else None,
                config.checkpoint_policy, config.optimizer_in_backward, config.cpu_offload,
                config.offload_activations, config.tp, config.sequence_parallel, config.dp_replicate,
                (config.pp, config.pp_schedule, config.pp_microbatches) if config.pp > 1 else None)

    def known(self, config: TrainConfig) -> Prepared | None:
        """The prepared trace of ``config`` at its own micro-batch size, if one was made."""
        return self._prepared.get((self.shape_key(config), config.micro_batch_size))

    def prepared(self, config: TrainConfig, batch: int) -> Prepared:
        """The trace of ``config`` at micro-batch ``batch``, made (or taken from the worker) once."""
        key = (self.shape_key(config), batch)
        with self._lock:
            if key not in self._prepared:
                self._await(key, batch)
                trace = (self._fetched.pop(key, None) or self._derived.pop(key, None)
                         or self._keep_derived(self._raw_trace(config, batch)))
                self._prepared[key] = self._prepare(trace)
            return self._prepared[key]

    def have(self, key: TraceKey) -> bool:
        """Is the trace of ``key`` here, prepared or waiting to be (derived, or from the worker)?"""
        return key in self._prepared or key in self._derived or key in self._fetched

    def _capability(self) -> tuple[int, int] | None:
        """The target card's compute capability (CUDA kernels chosen per card), None on cpu."""
        return self.spec.compute_capability if self.device == "cuda" and self.spec is not None else None

    def _keep_derived(self, trace: Trace) -> Trace:
        """Keep the accumulation-1 trace derived from ``trace``, for when it is asked."""
        if trace.single_micro is not None:
            derived = trace.single_micro
            self._derived.setdefault((self.shape_key(derived.config), derived.batch_size), derived)
            trace.single_micro = None
        return trace

    def _raw_trace(self, config: TrainConfig, batch: int) -> Trace:
        if self.device == "cpu" and batch < WORKSPACE_ANCHORS[0]:
            # Kernels pick other algorithms below the batch sizes whose workspaces were
            # measured (oneDNN skips its weight reorders at batch 1): a real, profiled run of
            # such a small batch is cheap and exact; one step of it, once fake tracing has
            # shown that the model's shapes do not depend on its data.
            return trace_step(self.task, config, batch_size=batch, real=True, profile=True,
                              derive_real=self._fake_traced)
        if not self._data_dependent:
            try:
                start = time.perf_counter()
                if self.compose_blocks:
                    trace = trace_composed(self.task, config, batch_size=batch, target=self.device,
                                           capability=self._capability(), trace=trace_step,
                                           trace_cuts=self._cut_tracer(config, batch, trace_step),
                                           cache=self._cuts)
                else:
                    trace = trace_step(self.task, config, batch_size=batch, target=self.device,
                                       capability=self._capability())
                self._last_fake_trace_s = time.perf_counter() - start
                self._fake_traced = True
                return trace
            except DataDependentShapes:
                self._data_dependent = True
        return self._worst_real_trace(config, batch)

    def _worst_real_trace(self, config: TrainConfig, batch: int) -> Trace:
        """Shapes that depend on data values (routing, ``nonzero``) differ from batch to batch,
        and drift as training moves a router: real runs on ``DATA_DEPENDENT_DRAWS`` disjoint
        sets of batches, and the estimate holds every allocation at the largest it reached in
        any of them (when the runs share one sequence of allocations; else the fullest run).
        Only the first run is profiled for kernel scratch (a second, of the fullest, when the
        runs do not line up)."""
        micro = min(config.grad_accum_steps, 2)
        per_draw = 2 * micro  # batches of a two-step run
        profile = self.device == "cpu"
        runs: list[tuple[int, Trace]] = []
        for draw in range(DATA_DEPENDENT_DRAWS):
            offset = draw * (per_draw + micro) * batch
            runs.append((offset, self._real_draw(config, batch, offset, profile and draw == 0)))
        first = runs[0][1]
        aligned = all(t.same_structure(first) for _, t in runs[1:])
        if aligned:
            # Every run measured with the first one's kernel scratch (the ops line up).
            peaks = [_trace_peak(dataclasses.replace(first, alloc_bytes=t.alloc_bytes)) for _, t in runs]
        else:
            peaks = [_trace_peak(t) for _, t in runs]
        k = int(np.argmax(peaks))
        offset, fullest = runs[k]
        if aligned:
            sizes = np.array([t.alloc_bytes for _, t in runs])
            largest = sizes.max(axis=0)
            varies = largest != sizes.min(axis=0)
            largest[varies] = np.ceil(largest[varies] * DATA_DEPENDENT_CAPACITY).astype(np.int64)
            bound = dataclasses.replace(first, alloc_bytes=largest)
        else:
            bound = fullest if not profile or k == 0 else self._real_draw(config, batch, offset, True)
        bound.batch_offset, bound.draws = offset, DATA_DEPENDENT_DRAWS * per_draw
        bound.fullest_peak = int(peaks[k]) if aligned else None
        return bound

    def _real_draw(self, config: TrainConfig, batch: int, offset: int, profile: bool) -> Trace:
        # The same initial weights for every draw (and every estimate): only the batches
        # differ, and the caller's random stream is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return trace_step(self.task, config, batch_size=batch, real=True, profile=profile,
                              target=self.device, capability=self._capability(), batch_offset=offset)

    def _prepare(self, trace: Trace) -> Prepared:
        notes: list[str] = list(trace.notes)
        ws, model = None, None
        if self.device == "cpu":
            ws, note, model = self.workspace_fits.workspaces(trace)
            if note == DIVERGED:
                # Fake tensors took other kernels than the CPU really runs (oneDNN RNNs, for
                # one): their memory differs, so measure this model with real CPU runs.
                self._data_dependent = True
                trace = trace_step(self.task, trace.config, batch_size=trace.batch_size, real=True, profile=True)
                ws, note = trace.op_workspace, None
            if note:
                notes.append(note)
        cublas = self.spec.cublas_workspace_bytes if self.device == "cuda" and self.spec is not None else None
        return prepare(trace, workspaces=ws, cublas_workspace_bytes=cublas, notes=notes, model=model)


def _trace_peak(trace: Trace) -> int:
    """A trace's peak: tensors alive, plus the largest kernel scratch measured during an op."""
    signed = trace.alloc_bytes[trace.event_alloc] * trace.event_sign.astype(np.int64)
    running = np.concatenate([[0], np.cumsum(signed)])
    peak = int(running.max())
    if trace.op_workspace is not None and trace.op_positions:
        pos = np.minimum(np.asarray(trace.op_positions, dtype=np.int64), len(running) - 1)
        peak = max(peak, int((running[pos] + np.asarray(trace.op_workspace, dtype=np.int64)).max()))
    return peak
