"""Batch scaling: any micro-batch size from traces at a few small "anchor" sizes.

If the anchors' traces have the same events and every tensor allocation's size is affine in
the batch size (checked on three anchors, once per model), sizes for any batch are
``a + c·b`` and no new trace is needed (~ms); kernel workspaces, which are not affine, are
sized from their fit (``memory._workspace``), and op costs (FLOPs, bytes moved) scale alike
when the anchors' ops line up. Otherwise each batch is traced afresh.

:class:`BatchScaling` also decides which traces a set of expected configurations needs
(``expect``): a shape asked at no more than two sizes is traced at its own sizes instead.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .._config import TrainConfig
from ..memory._prepare import Prepared
from ..memory._workspace import WORKSPACE_ANCHORS, fit_key, reference_config, workspaces_at
from ..timing._timing import OpCosts, op_costs
from ..tracing._recorder import Category
from ._traces import ShapeKey, TraceKey, TraceSource

__all__ = ["ANCHORS", "CUDA_ANCHORS", "BatchScaling"]

ANCHORS = (2, 3, 4)
"""Batch sizes traced for batch scaling on CPU targets (where kernels pick other algorithms,
with other workspaces, at batch 1)."""

CUDA_ANCHORS = (1, 2, 3)
"""Batch sizes traced for batch scaling on CUDA targets: fake tensors size tensors alone, so
batch 1 is an anchor and needs no trace of its own. A model that cannot train at batch 1
(BatchNorm refuses it) or shapes it differently falls back to ``ANCHORS``."""


@dataclass
class _Scaling:
    base_batch: int
    intercept: np.ndarray  # bytes at batch 0 (float, affine fit)
    slope: np.ndarray
    trace: Prepared
    costs: tuple[OpCosts, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    """Base op costs and the affine fits (flops, bytes) of each op, when the anchors' ops line up."""


class BatchScaling:
    """Affine fits of allocation sizes in the micro-batch size, per shape of one task."""

    def __init__(self, traces: TraceSource, lock: threading.RLock) -> None:
        self.traces = traces
        self._lock = lock
        self._scaling: dict[ShapeKey, _Scaling | None] = {}
        self._affine: bool | None = None  # are allocation sizes affine in the batch size?
        self._anchors = CUDA_ANCHORS if traces.device == "cuda" else ANCHORS
        self._exact_shapes: set[ShapeKey] = set()
        # The configuration whose three anchors the prefetch traces to check affinity.
        self._affinity_check: TrainConfig | None = None

    def expect(self, configs: Iterable[TrainConfig], *, prefetch: bool = False) -> None:
        """See ``Estimator.expect``."""
        configs = list(configs)
        sizes: dict[ShapeKey, set[int]] = {}
        for config in configs:
            sizes.setdefault(self.traces.shape_key(config), set()).add(config.micro_batch_size)
        with self._lock:
            few = {key for key, batches in sizes.items()
                   if len({b for b in batches if b >= self._anchors[0]}) <= 2}
            few |= {self.traces.shape_key(c) for c in configs if self._unscalable(c)}
            self._exact_shapes = {key for key in few if not self._derivable(key, sizes, few)}
            if prefetch and self.traces.can_prefetch():
                self.traces.prefetch(*self._planned_traces(configs, sizes, few))

    def _unscalable(self, config: TrainConfig) -> bool:
        # Offloading to a GPU's host skips saved tensors under MIN_OFFLOAD_BYTES, a line that
        # per-sample-small tensors (a norm's statistics, a loss over few classes) cross between
        # the small anchors and the planned batch: such traces differ in structure, not size.
        # A pipeline's trace is its fullest stage's, with what its pricing needs (not scaled).
        return (config.offload_activations and self.traces.device == "cuda") or config.pp > 1

    @staticmethod
    def _derivable(key: ShapeKey, sizes: Mapping[ShapeKey, set[int]], few: set[ShapeKey]) -> bool:
        """Do ``key``'s anchors come with the anchors of its accumulating sibling?"""
        sibling = (2, *key[1:])
        return key[0] == 1 and key[3] == "single" and sibling in sizes and sibling not in few

    def _planned_traces(self, configs: list[TrainConfig], sizes: Mapping[ShapeKey, set[int]],
                        few: set[ShapeKey]) -> tuple[dict[TraceKey, tuple[TrainConfig, int]],
                                                     list[tuple[str, TrainConfig, int]]]:
        """The fake traces ``configs`` need (key -> (configuration, batch)) and, on a CPU
        target, this process's real runs (``trace``, ``workspace`` and ``borrow`` items)."""
        traces = self.traces
        fake: dict[TraceKey, tuple[TrainConfig, int]] = {}
        # On a CPU target the real runs are this process's own share.
        local: list[tuple[str, TrainConfig, int]] = []
        planned: set[ShapeKey] = set()
        fits: set[tuple[Hashable, ...]] = set()  # workspace fits (memory._workspace_cache.fit_key)
        borrowers: dict[tuple[tuple[Hashable, ...], str], TrainConfig] = {}
        first_scaled = self._affine is None
        for config in configs:
            key, b = traces.shape_key(config), config.micro_batch_size
            if key in self._exact_shapes or b < self._anchors[0]:
                wanted = [b]
            elif key in planned or self._derivable(key, sizes, few):
                wanted = []
            else:
                wanted = list(self._anchors if first_scaled else (self._anchors[0], self._anchors[-1]))
                if first_scaled:
                    self._affinity_check = config  # see _scaling_for
                first_scaled = False
                planned.add(key)
            for a in wanted:
                if traces.have((key, a)) or (key, a) in fake:
                    continue
                if traces.device == "cpu" and a < WORKSPACE_ANCHORS[0]:
                    local.append(("trace", config, a))  # a real, profiled run (see _raw_trace)
                else:
                    fake[(key, a)] = (config, a)
            fitted = reference_config(config) or config
            # (A pipeline's fit is its fullest stage's, measured when that stage is known.)
            if traces.device == "cpu" and config.pp == 1 and traces.workspace_fits.fit_key(fitted) not in fits:
                fits.add(traces.workspace_fits.fit_key(fitted))
                local.append(("workspace", fitted, 0))
            if traces.device == "cpu" and fitted is not config:
                # The small run that checks the borrowed fit: on the most blocks recomputed,
                # once per policy (a selective block recomputes other ops than a full one).
                borrower = (fit_key(fitted), config.checkpoint_policy)
                checked = borrowers.get(borrower)
                if checked is None or config.checkpoint_segments > checked.checkpoint_segments:
                    borrowers[borrower] = config
        local.extend(("borrow", config, 0) for config in borrowers.values())
        return fake, local

    def scaled(self, config: TrainConfig) -> Prepared | None:
        """``config``'s events scaled from its anchors' traces; None where it is traced itself."""
        b = config.micro_batch_size
        # Below the smallest anchor the fit would extrapolate into sizes where kernels pick
        # other algorithms (oneDNN at batch 1): trace such batches themselves.
        if b < self._anchors[0] or self.traces.shape_key(config) in self._exact_shapes or self._unscalable(config):
            return None
        scaling = self._scaling_for(config)
        if scaling is None:
            return None
        sizes = np.rint(scaling.intercept + scaling.slope * b).astype(np.int64)
        sizes = np.maximum(sizes, 0)
        base = self.traces.prepared(config, scaling.base_batch)
        if base.workspaces is not None:
            allocs, fit, sources = base.workspaces
            sizes[allocs[allocs >= 0]] = np.asarray(workspaces_at(fit, sources, b), dtype=np.int64)[allocs >= 0]
        scaled = Prepared(
            alloc_bytes=sizes, alloc_category=base.alloc_category, event_alloc=base.event_alloc,
            event_sign=base.event_sign, event_phase=base.event_phase,
            phase_labels=base.phase_labels, method="scaled", notes=base.notes,
            ops=base.ops, host_allocs=base.host_allocs, workspaces=base.workspaces,
        )
        if scaling.costs is not None:
            c, f0, f1, m0, m1 = scaling.costs
            scaled.costs = OpCosts(np.maximum(f0 + f1 * b, 0), np.maximum(m0 + m1 * b, 0), c.dtype, c.phase, c.names)
        return scaled

    def _scaling_for(self, config: TrainConfig) -> _Scaling | None:
        shape_key = self.traces.shape_key(config)
        with self._lock:
            if shape_key in self._scaling:
                return self._scaling[shape_key]
            check, self._affinity_check = self._affinity_check, None
            if check is not None and self._affine is None and self.traces.shape_key(check) != shape_key:
                # The prefetch traces a third anchor for this one configuration only: affinity
                # is checked there, and every other shape then scales from two.
                self._scaling_for(check)
            scaling: _Scaling | None = None
            if not self.traces.data_dependent and self._affine is not False:
                traces, anchors = self._anchor_traces(config)
                if traces and all(t.method == "traced" for t in traces) and _aligned(traces):
                    if len(anchors) == 3 and not self._check_affine(traces, anchors):
                        if self._anchors != ANCHORS:
                            # Batch 1 may take its own path (a squeezed dimension): judge
                            # affinity on the CPU's anchors before giving scaling up.
                            self._anchors = ANCHORS
                            return self._scaling_for(config)
                        # Not affine on the CPU's anchors (recorded in self._affine): no scaling.
                    else:
                        scaling = _fit(traces, anchors)
            self._scaling[shape_key] = scaling
            return scaling

    def _check_affine(self, traces: list[Prepared], anchors: tuple[int, ...]) -> bool:
        """Are the middle anchor's tensor sizes exactly on the line through the outer two?
        (Recorded for the model, unless batch 1 is to be judged again on the CPU's anchors.)"""
        intercept, slope = _line(traces, anchors)
        b1, s1 = anchors[1], traces[1].alloc_bytes
        tensors = traces[0].alloc_category != int(Category.WORKSPACE)
        # Tensor sizes must be exactly affine (a contrastive loss's b x b
        # logits are not); workspaces are fitted, kernels pick algorithms by size.
        affine = bool(np.array_equal(np.rint((intercept + slope * b1)[tensors]), s1[tensors]))
        if affine or self._anchors == ANCHORS:
            self._affine = affine
        return affine

    def _anchor_traces(self, config: TrainConfig) -> tuple[list[Prepared], tuple[int, ...]]:
        """Traces of ``config`` at the anchor batch sizes ([] when they cannot be had).

        The first configuration of a model checks affinity on three anchors; once the model
        has shown its sizes are affine in the batch (a property of the model, not of
        precision or checkpointing), two anchors fit the others."""
        while True:
            anchors = self._anchors if self._affine is None else (self._anchors[0], self._anchors[-1])
            try:
                self.traces.trace_in_parallel(config, anchors)
                traces = [self.traces.prepared(config, a) for a in anchors]
            except Exception:  # noqa: BLE001 - small batches may be refused; trace each b
                traces = []
            if self._anchors == ANCHORS or (traces and _aligned(traces)):
                return traces, anchors
            # Batch 1 refused or shaped apart from the others: anchor where the CPU does.
            self._anchors = ANCHORS


def _line(traces: list[Prepared], anchors: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Intercept and slope of allocation sizes through the first and last anchors."""
    b0, b2 = anchors[0], anchors[-1]
    s0, s2 = traces[0].alloc_bytes.astype(np.float64), traces[-1].alloc_bytes.astype(np.float64)
    slope = (s2 - s0) / (b2 - b0)
    return s0 - slope * b0, slope


def _fit(traces: list[Prepared], anchors: tuple[int, ...]) -> _Scaling:
    """The affine fit of sizes (and of op costs, when the anchors' ops line up)."""
    b0, b2 = anchors[0], anchors[-1]
    intercept, slope = _line(traces, anchors)
    scaling = _Scaling(anchors[0], intercept, slope, traces[0])
    costs = [op_costs(t.ops) for t in traces]
    if costs[0].names == costs[-1].names:
        f1 = (costs[-1].flops - costs[0].flops) / (b2 - b0)
        m1 = (costs[-1].bytes_moved - costs[0].bytes_moved) / (b2 - b0)
        scaling.costs = (costs[0], costs[0].flops - f1 * b0, f1,
                         costs[0].bytes_moved - m1 * b0, m1)
    return scaling


def _aligned(traces: list[Prepared]) -> bool:
    first = traces[0]
    return all(
        len(t.alloc_bytes) == len(first.alloc_bytes)
        and np.array_equal(t.event_alloc, first.event_alloc)
        and np.array_equal(t.event_sign, first.event_sign)
        and np.array_equal(t.alloc_category, first.alloc_category)
        for t in traces[1:]
    )
