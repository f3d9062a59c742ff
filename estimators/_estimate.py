"""From traces to an ``Estimate``: workspaces, batch scaling, the device's allocator.

``Estimator`` keeps the traces of one task and answers any configuration:

* the configuration is traced once at its own micro-batch size (exact), or
* when the micro-batch has not been traced, from three traces at small "anchor" batch sizes:
  if the three have the same events and every allocation's size is affine in the batch size,
  sizes for any batch are ``a + c·b`` and no new trace is needed (~ms); otherwise the batch
  is traced afresh. Models whose shapes depend on data values are measured with a real CPU run
  instead (method ``measured-cpu``).

The event list is then replayed: on ``cpu`` as the CPU allocator counts (bytes as asked); on
``cuda`` with 512-byte rounding (``max_memory_allocated``) and through the caching-allocator
model (``max_memory_reserved``), with the cuBLAS workspace added as its own allocation.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np
import torch

from .memory._allocator import CachingAllocatorSim
from .timing._comm import CommTime, ddp_comm, fsdp_comm, ring_bandwidth
from ._config import TrainConfig, normalize_precision
from .memory._distributed import FsdpUnits
from ._errors import ConfigError
from ._gpus import GPUSpec, detect_local_gpu, get_gpu
from ._task import Task
from .runtime._precision import cast_model, weight_dtype
from .timing._timing import (
    DeviceRates, OpCosts, StepTimeParts, TimeCalibration, cpu_rates, gpu_rates, op_costs, step_time, step_time_parts,
)
from .tracing._trace import Category, DataDependentShapes, Trace, trace_step
from .tracing._trace_worker import TraceWorker, WorkerDied, worker_available
from .memory._workspace import (WORKSPACE_ANCHORS, Source, WorkspaceFit, aligned_sources, borrow_holds, borrowed_sources,
                         fit_key, measure_fit, reference_config, workspaces_at)

__all__ = ["Estimate", "Estimator", "estimate", "resolve_target"]

Device = Literal["cpu", "cuda"]

_DIVERGED = "fake trace diverged from the real kernels"

_WorkspaceModel = tuple[WorkspaceFit, list[Source | None]]
"""A fit and, per op of a trace, its place there (see ``_workspace.workspaces_at``)."""

ANCHORS = (2, 3, 4)
"""Batch sizes traced for batch scaling on CPU targets (where kernels pick other algorithms,
with other workspaces, at batch 1)."""

CUDA_ANCHORS = (1, 2, 3)
"""Batch sizes traced for batch scaling on CUDA targets: fake tensors size tensors alone, so
batch 1 is an anchor and needs no trace of its own. A model that cannot train at batch 1
(BatchNorm refuses it) or shapes it differently falls back to ``ANCHORS``."""

DATA_DEPENDENT_DRAWS = 4
"""Real two-step runs (disjoint batches) a model with data-dependent shapes is measured on;
its estimate is the fullest, and says so."""

DATA_DEPENDENT_CAPACITY = 1.25
"""Allocations whose size differed between those runs (an expert's tokens, say) are held at this
multiple of the largest seen, as a mixture-of-experts capacity factor of 1.25 bounds an
expert's load: training moves a router, and an epoch meets batches the runs did not (on
moe_dynamic the largest seen alone fell 0.46% below a real epoch's peak; x1.1 just above it)."""

PARALLEL_TRACE_S = 1.0
"""Fake traces taking at least this long share batch-scaling anchors with a worker process."""


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Predicted (or measured) memory and time of one training configuration.

    All sizes are bytes (int). ``peak_allocated_bytes`` is what
    ``torch.cuda.max_memory_allocated()`` reports (on cpu: the CPU allocator's live bytes);
    ``peak_reserved_bytes`` what ``max_memory_reserved()`` reports (None on cpu).
    ``context_bytes`` (CUDA context) is outside both, as on a real GPU.
    """

    config: TrainConfig
    device: str
    gpu: str | None
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None
    breakdown: Mapping[str, int]
    peak_phase: str
    context_bytes: int
    workspace_bytes: int
    method: str
    """traced | scaled | measured-cpu | measured (a probe)."""
    modelled: bool
    """True for CUDA predictions not validated on a GPU."""
    params: int
    trainable_params: int
    step_time_s: float | None = None
    """One optimizer step at the planned batch (for items of varying shape: the worst one)."""
    samples_per_s: float | None = None
    """Over an epoch: for items of varying shape, at the epoch's mean padded batch
    (``batch_shapes["padding_factor"]`` of the planned one; less with ``length_grouped``)."""
    notes: tuple[str, ...] = ()
    batch_shapes: Mapping[str, Any] | None = None
    """For items of varying shape: the batch planned for (``policy``, ``padded`` sizes, the
    ``items`` that set them), where the sizes came from (``source``, ``coverage``), and, when
    asked (``Estimator.shape_distribution``), the predicted peak at the ``median``, ``p99``
    and ``max`` batch. For data-dependent models: the real batches the worst was taken over
    (``draws``, ``batch_offset`` of the worst). None for fixed-shape data."""
    time_parts: Mapping[str, float] | None = None
    """A prediction's step time before calibration, in the parts probes refit: ``overhead``
    (per-op fixed cost), the roofline work per op dtype (``float32``, ``bfloat16``, …), and
    ``fixed`` (exposed communication, which calibration leaves alone); seconds. Kept so that a
    stored prediction (a resumed study's) can be recalibrated, and can calibrate, without its
    trace. None for measurements."""

    @property
    def peak_bytes(self) -> int:
        """The figure a budget is compared with: reserved on cuda (what the driver sees,
        context excluded, as ``set_per_process_memory_fraction`` counts), allocated on cpu."""
        return self.peak_reserved_bytes if self.peak_reserved_bytes is not None else self.peak_allocated_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = self.config.to_dict()
        d["breakdown"] = dict(self.breakdown)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Estimate:
        d = dict(data)
        d["config"] = TrainConfig.from_dict(d["config"])
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)


_CALIBRATED = "step time calibrated on "


def _calibrated_note(points: int) -> str:
    return f"{_CALIBRATED}{points} probe(s)"


def _stored_parts(estimate: Estimate) -> StepTimeParts | None:
    """The uncalibrated step-time parts a prediction carries (``Estimate.time_parts``)."""
    stored = estimate.time_parts
    if stored is None or "overhead" not in stored:
        return None
    work = {k: float(v) for k, v in stored.items() if k not in ("overhead", "fixed")}
    return StepTimeParts(float(stored["overhead"]), work)


def resolve_target(device: str | None, gpu: str | None) -> tuple[Device, GPUSpec | None]:
    """The target device type and GPU spec from ``--device`` / ``--gpu``."""
    if gpu is not None:
        spec = get_gpu(gpu)
        if device not in (None, "cuda"):
            raise ConfigError(f"--gpu {gpu} plans for a CUDA card; drop --device {device} or use --device cuda")
        return "cuda", spec
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; use cpu or cuda")
    if device == "cuda":
        spec = detect_local_gpu()
        if spec is None:
            raise ConfigError("--device cuda but no GPU is visible here; name the card with --gpu NAME (e.g. --gpu A100-80GB)")
        return "cuda", spec
    return "cpu", None


@dataclass
class _Scaling:
    base_batch: int
    intercept: np.ndarray  # bytes at batch 0 (float, affine fit)
    slope: np.ndarray
    trace: Trace
    costs: tuple[OpCosts, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    """Base op costs and the affine fits (flops, bytes) of each op, when the anchors' ops line up."""


@dataclass
class _Prepared:
    """A trace with workspace events inserted, ready to replay."""

    alloc_bytes: np.ndarray
    alloc_category: np.ndarray
    event_alloc: np.ndarray
    event_sign: np.ndarray
    event_phase: np.ndarray
    phase_labels: list[str]
    method: str
    notes: tuple[str, ...] = ()
    ops: list = field(default_factory=list)
    costs: OpCosts | None = None
    host_allocs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Allocations in host memory on any device (see ``Trace.host_allocs``)."""
    workspaces: tuple[np.ndarray, WorkspaceFit, list[Source | None]] | None = None
    """The kernel workspaces' allocations and where the fit has each: batch scaling sizes
    them from the fit, since a workspace is not affine in the batch size."""
    draws: tuple[int, int, int | None] | None = None
    """(real batches, batch offset of the fullest, its peak or None) of a data-dependent
    model's real runs (see ``Estimator._worst_real_trace``)."""

    def op_costs(self) -> OpCosts:
        if self.costs is None:
            self.costs = op_costs(self.ops)
        return self.costs


class Estimator:
    """Estimates configurations of one task on one target, caching traces.

    Thread-safe for concurrent ``estimate`` calls (a lock serialises tracing).
    """

    def __init__(self, task: Task, *, device: str | None = None, gpu: str | None = None,
                 shape_policy: str | None = None) -> None:
        self.task = task.with_shape_policy(shape_policy) if shape_policy is not None else task
        self._shape_estimators: dict[str, Estimator] = {}
        self.device, self.spec = resolve_target(device, gpu)
        self._prepared: dict[tuple[Any, int], _Prepared] = {}
        self._scaling: dict[Any, _Scaling | None] = {}
        self._data_dependent = False
        self._lock = threading.RLock()
        self._facts: _ModelFacts | None = None
        self._workspace_fits: dict[tuple[Any, ...], WorkspaceFit | None] = {}
        self._borrow_checks: dict[tuple[Any, ...], bool] = {}  # a borrowed fit's key -> does it hold?
        self._affine: bool | None = None  # are allocation sizes affine in the batch size?
        self._anchors = CUDA_ANCHORS if self.device == "cuda" else ANCHORS
        self._worker: TraceWorker | None = None
        self._worker_failed = False
        self._last_fake_trace_s = 0.0
        self._fake_traced = False  # a fake trace succeeded: shapes follow sizes, not values
        self._rates: DeviceRates | None = None
        self._calibration = TimeCalibration()
        self._exact_shapes: set[tuple[Any, ...]] = set()
        # Traces of accumulation 1 derived from traces of accumulation 2, not yet prepared.
        self._derived: dict[tuple[Any, int], Trace] = {}
        # A prefetch (see expect): traces queued in the worker (key -> ticket), those it sent
        # back and not yet prepared, and this process's share, run while it waits.
        self._pending: dict[tuple[Any, int], int] = {}
        self._queue: list[tuple[tuple[Any, int], TrainConfig, int]] = []  # fake traces not yet handed out
        self._fetched: dict[tuple[Any, int], Trace] = {}
        self._ahead: list[tuple[str, TrainConfig, int]] = []
        # The configuration whose three anchors the prefetch traces to check affinity.
        self._affinity_check: TrainConfig | None = None

    # -- public -----------------------------------------------------------------------
    def estimate(self, config: TrainConfig, *, exact: bool = False) -> Estimate:
        """Estimate ``config``; ``exact=True`` traces its micro-batch size itself instead of
        scaling from the anchor traces (one trace instead of three, for a single answer)."""
        self.check_config(config)
        prepared, method = self._events(config, exact=exact)
        return self._replay(config, prepared, method)

    def expect(self, configs: Iterable[TrainConfig], *, prefetch: bool = False) -> None:
        """Say which configurations will be estimated. Batch scaling costs two or three anchor
        traces per shape (everything but the micro-batch size); a shape asked at no more than
        two micro-batch sizes is traced at its own sizes instead: as few traces or fewer, and
        exact. Accumulation 1 under a fixed global batch has one size, but its anchors come
        free with those of accumulation 2 (``Trace.single_micro``): it is scaled when they are.

        ``prefetch=True`` (every configuration will be asked) starts the traces they need
        now, on both cores: a worker process and this one share a queue of fake traces. This
        process first runs its own share, the real CPU runs (batch 1, kernel workspaces) of a
        CPU target, then takes traces from the queue's end whenever it waits for the worker.
        """
        configs = list(configs)
        sizes: dict[tuple[Any, ...], set[int]] = {}
        for config in configs:
            sizes.setdefault(self._shape_key(config), set()).add(config.micro_batch_size)
        with self._lock:
            few = {key for key, batches in sizes.items()
                   if len({b for b in batches if b >= self._anchors[0]}) <= 2}
            self._exact_shapes = {key for key in few if not self._derivable(key, sizes, few)}
            if prefetch:
                self._prefetch(configs, sizes, few)

    @staticmethod
    def _derivable(key: tuple[Any, ...], sizes: Mapping[tuple[Any, ...], set[int]], few: set[tuple[Any, ...]]) -> bool:
        """Do ``key``'s anchors come with the anchors of its accumulating sibling?"""
        sibling = (2, *key[1:])
        return key[0] == 1 and key[3] == "single" and sibling in sizes and sibling not in few

    def _prefetch(self, configs: list[TrainConfig], sizes: Mapping[tuple[Any, ...], set[int]],
                  few: set[tuple[Any, ...]]) -> None:
        if (self._data_dependent or self._worker_failed or not worker_available()
                or (os.cpu_count() or 1) < 2):
            return
        fake: dict[tuple[Any, int], tuple[TrainConfig, int]] = {}
        # On a CPU target the real runs are this process's own share.
        local: list[tuple[str, TrainConfig, int]] = []
        planned: set[tuple[Any, ...]] = set()
        fits: set[tuple[Any, ...]] = set()
        borrowers: dict[tuple[Any, ...], TrainConfig] = {}
        first_scaled = self._affine is None
        for config in configs:
            key, b = self._shape_key(config), config.micro_batch_size
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
                if self._have((key, a)) or (key, a) in fake:
                    continue
                if self.device == "cpu" and a < WORKSPACE_ANCHORS[0]:
                    local.append(("trace", config, a))  # a real, profiled run (see _raw_trace)
                else:
                    fake[(key, a)] = (config, a)
            fitted = reference_config(config) or config
            if self.device == "cpu" and self._fit_key(fitted) not in fits:
                fits.add(self._fit_key(fitted))
                local.append(("workspace", fitted, 0))
            if self.device == "cpu" and fitted is not config:
                # The small run that checks the borrowed fit: on the most blocks recomputed.
                checked = borrowers.get(fit_key(fitted))
                if checked is None or config.checkpoint_segments > checked.checkpoint_segments:
                    borrowers[fit_key(fitted)] = config
        local.extend(("borrow", config, 0) for config in borrowers.values())
        if len(fake) < 2:
            return
        try:
            if self._worker is None or not self._worker.alive():
                self._worker = TraceWorker(self.task)
        except Exception:  # noqa: BLE001 - no worker: trace alone
            self._drop_worker()
            return
        self._queue = [(key, config, a) for key, (config, a) in fake.items()]
        # Workspace fits and their checks first: the small real runs halve once the worker's first trace is back.
        self._ahead = sorted(local, key=lambda item: item[0] == "trace")
        self._top_up()

    def _top_up(self) -> None:
        """Keep the worker two traces ahead; the rest of the queue waits for whichever
        process is free first (this one takes from its end)."""
        while self._queue and self._worker is not None and len(self._pending) < 2:
            key, config, a = self._queue.pop(0)
            try:
                self._pending[key] = self._worker.submit(config, a, self.device, self._capability())
            except Exception:  # noqa: BLE001 - the worker is gone: this process traces alone
                self._drop_worker()

    def _collect(self, done: Callable[[], bool]) -> None:
        """Take the worker's traces until ``done()``, doing this process's share meanwhile:
        its real runs, then fake traces from the end of the queue."""
        while self._pending and not done():
            worker = self._worker
            if worker is None:
                self._pending.clear()
                return
            if not worker.ready():
                # A small real run halves once a fake trace has come back (see _raw_trace):
                # the first is worth a short wait.
                wait = self._ahead and self._ahead[0][0] == "trace" and self.device == "cpu" and not self._fake_traced
                if self._ahead and not wait:
                    kind, config, b = self._ahead.pop(0)
                    try:
                        if kind == "workspace":
                            self._workspace_fit(config)
                        elif kind == "borrow":
                            self._borrow_holds(config)
                        else:
                            self._trace(config, b)
                    except Exception:  # noqa: BLE001 - raised again, properly, when it is asked
                        pass
                    continue
                if self._queue and not self._ahead:
                    # Kept as the worker's traces are (prepared when asked), so that an
                    # estimate does not depend on which process traced what.
                    key, config, b = self._queue.pop()
                    try:
                        self._fetched[key] = self._keep_derived(self._raw_trace(config, b))
                    except Exception:  # noqa: BLE001 - raised again, properly, when it is asked
                        pass
                    continue
            if not self._receive():
                return

    def _receive(self) -> bool:
        """Take the worker's next trace, waiting for it, and hand it the next one; False
        when the worker is gone (this process then traces alone)."""
        assert self._worker is not None
        try:
            ticket, payload = self._worker.next_result(timeout_s=max(120.0, 20 * self._last_fake_trace_s))
        except WorkerDied:
            self._drop_worker()
            return False
        arrived = next((k for k, t in self._pending.items() if t == ticket), None)
        if arrived is not None:
            del self._pending[arrived]
            if isinstance(payload, Trace) and payload.method == "traced":
                self._fetched[arrived] = self._keep_derived(payload)
                self._fake_traced = True
            # A failure in the worker is traced again here, which raises it properly.
        self._top_up()
        return True

    def _pump(self) -> None:
        """Take whatever the worker has finished, without waiting, so that it is never idle
        while this process traces what the search asks."""
        while self._pending and self._worker is not None and self._worker.ready():
            if not self._receive():
                return

    def _capability(self) -> tuple[int, int] | None:
        """The target card's compute capability (CUDA kernels chosen per card), None on cpu."""
        return self.spec.compute_capability if self.device == "cuda" and self.spec is not None else None

    def rates(self) -> DeviceRates:
        """The target's compute and memory rates (spec table for GPUs, measured for the CPU)."""
        if self._rates is None:
            self._rates = gpu_rates(self.spec) if self.spec is not None else cpu_rates()
        return self._rates

    def calibrate(self, config: TrainConfig, measured_step_time_s: float, *,
                  predicted: Estimate | None = None) -> None:
        """Refit the step-time model with a probe's measurement of ``config``: the per-op
        fixed cost and the work are refitted apart once probes differ in their mix of the two
        (see ``TimeCalibration``). ``predicted``, this estimator's prediction of ``config``
        (from a resumed study, say), saves tracing it again."""
        self.check_config(config)
        parts = _stored_parts(predicted) if predicted is not None and predicted.config == config else None
        with self._lock:
            if parts is None:
                p, _ = self._events(config)
                parts = step_time_parts(p.op_costs(), p.phase_labels, config.grad_accum_steps, self.rates())
            self._calibration.add(parts, measured_step_time_s)

    def recalibrated(self, estimate: Estimate) -> Estimate:
        """``estimate`` (a prediction of this estimator's) with its step time refitted by the
        probes so far, from its stored parts: no trace is needed, so a resumed study's
        predictions stay cheap. One without parts (stored by an older version) is estimated
        again."""
        parts = _stored_parts(estimate)
        if parts is None:
            return self.estimate(estimate.config)
        assert estimate.time_parts is not None
        with self._lock:
            seconds, note = self._step_seconds(parts, float(estimate.time_parts.get("fixed", 0.0)))
        notes = [n for n in estimate.notes if not n.startswith(_CALIBRATED)]
        if note is not None:
            # Where _replay puts it: before the communication note.
            at = next((i for i, n in enumerate(notes) if n.startswith("communication ")), len(notes))
            notes.insert(at, note)
        return replace(estimate, step_time_s=seconds,
                       samples_per_s=_throughput(estimate.config, seconds, estimate.batch_shapes),
                       notes=tuple(notes))

    def _step_seconds(self, parts: StepTimeParts, fixed: float) -> tuple[float, str | None]:
        """A step's seconds from its uncalibrated parts, refitted by the probes so far, plus
        ``fixed`` (communication, which probes do not measure); and the note saying it was
        calibrated (None without probes)."""
        points = len(self._calibration.points)
        seconds = parts.total_s + self._calibration.correction(parts) + fixed
        return seconds, _calibrated_note(points) if points else None

    def close(self) -> None:
        """Stop the trace worker, if one runs (a later trace starts it again when needed)."""
        with self._lock:
            worker, self._worker = self._worker, None
            self._pending.clear()
            self._queue.clear()
            self._ahead.clear()
            if worker is not None:
                worker.close()

    def check_config(self, config: TrainConfig) -> None:
        if config.precision in ("bf16-mixed", "bf16-true") and self.spec is not None and not self.spec.bf16:
            raise ConfigError(
                f"{self.spec.name} has no bf16 support (needs compute capability 8.0+); use "
                "--precision fp16 or fp32"
            )
        if config.strategy == "fsdp" and config.world_size > 1 and not self._has_block_stack():
            raise ConfigError(
                f"{self.task.name}: fsdp shards each block of the model's block stack, and none was "
                "found; define checkpoint_blocks(model) in the model file, or use ddp"
            )

    # -- traces -------------------------------------------------------------------------
    def _shape_key(self, config: TrainConfig) -> tuple[Any, ...]:
        # Everything but the micro-batch size; accumulation beyond 2 traces the same as 2.
        # With items of varying shape, the items that set the planned batch's padded size.
        return (min(config.grad_accum_steps, 2), config.precision, config.checkpoint_segments,
                config.strategy, config.world_size, self._planned_key(config))

    def _planned_key(self, config: TrainConfig) -> tuple[Any, ...] | None:
        planned = self.task.planned(config.micro_batch_size)
        return planned.key() if planned is not None else None

    def _fit_key(self, config: TrainConfig) -> tuple[Any, ...]:
        """Workspaces are fitted at the planned batch's padded size: kernels' scratch follows it."""
        return (*fit_key(config), self._planned_key(config))

    def _trace(self, config: TrainConfig, batch: int) -> _Prepared:
        key = (self._shape_key(config), batch)
        with self._lock:
            if key not in self._prepared:
                self._pump()
                # Asked before the worker took it: traced here (and off the shared queue).
                self._queue = [item for item in self._queue if item[0] != key]
                if key in self._pending:
                    self._collect(lambda: key not in self._pending)
                elif self.device == "cpu" and batch < WORKSPACE_ANCHORS[0] and not self._fake_traced:
                    # A small real run halves once a fake trace has come back (_raw_trace).
                    self._collect(lambda: self._fake_traced)
                trace = (self._fetched.pop(key, None) or self._derived.pop(key, None)
                         or self._keep_derived(self._raw_trace(config, batch)))
                self._prepared[key] = self._prepare(trace)
            return self._prepared[key]

    def _have(self, key: tuple[Any, int]) -> bool:
        """Is the trace of ``key`` here, prepared or waiting to be (derived, or from the worker)?"""
        return key in self._prepared or key in self._derived or key in self._fetched

    def _keep_derived(self, trace: Trace) -> Trace:
        """Keep the accumulation-1 trace derived from ``trace``, for when it is asked."""
        if trace.single_micro is not None:
            derived = trace.single_micro
            self._derived.setdefault((self._shape_key(derived.config), derived.batch_size), derived)
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

    def _workspaces(self, trace: Trace) -> tuple[list[int] | None, str | None, _WorkspaceModel | None]:
        """Per-op CPU workspace bytes for ``trace``: measured directly when the trace was a
        real, profiled run, else carried over from a fit of real runs (see ``_workspace``),
        with the fit and each op's place in it.
        A checkpointed configuration borrows the fit of the same one without checkpointing
        when its ops are all found there and one real run of it confirms the borrowed figures
        (``borrow_holds``), and is measured on its own otherwise."""
        if trace.op_workspace is not None:
            return trace.op_workspace, None, None
        reference = reference_config(trace.config)
        if reference is not None and self._fit_key(trace.config) not in self._workspace_fits:
            borrowed = self._workspace_fit(reference)
            sources = borrowed_sources(trace, borrowed) if borrowed is not None else None
            if sources is not None and self._borrow_holds(trace.config):
                return workspaces_at(borrowed, sources, trace.batch_size), None, (borrowed, sources)
        fit = self._workspace_fit(trace.config)
        if fit is None:
            return None, "kernel workspaces not measured (small-batch CPU runs failed)", None
        sources = aligned_sources(trace, fit)
        if sources is None:
            # Fake tensors took other kernels than the CPU runs: this model is measured for real.
            return None, _DIVERGED, None
        return workspaces_at(fit, sources, trace.batch_size), None, (fit, sources)

    def _workspace_fit(self, config: TrainConfig) -> WorkspaceFit | None:
        key = self._fit_key(config)
        with self._lock:
            if key not in self._workspace_fits:
                self._workspace_fits[key] = measure_fit(self.task, config)
            return self._workspace_fits[key]

    def _borrow_holds(self, config: TrainConfig) -> bool:
        """Does the fit of ``reference_config(config)`` hold for ``config``? Checked by one
        small real run (``borrow_holds``) per fit borrowed: a recomputed block runs its own
        forward again, on the same kernels or not whichever blocks are checkpointed. A fit
        that fails its check is not borrowed again: each setting measures its own."""
        reference = reference_config(config)
        if reference is None:
            return False
        key = fit_key(reference)
        with self._lock:
            if key not in self._borrow_checks:
                fit = self._workspace_fit(reference)
                self._borrow_checks[key] = fit is not None and borrow_holds(self.task, config, fit)
            return self._borrow_checks[key]

    def _prepare(self, trace: Trace) -> _Prepared:
        notes: list[str] = list(trace.notes)
        inserts: list[tuple[int, int, int]] = []  # (event position, bytes, op or -1)
        model = None
        if self.device == "cpu":
            ws, note, model = self._workspaces(trace)
            if note == _DIVERGED:
                # Fake tensors took other kernels than the CPU really runs (oneDNN RNNs, for
                # one): their memory differs, so measure this model with real CPU runs.
                self._data_dependent = True
                trace = trace_step(self.task, trace.config, batch_size=trace.batch_size, real=True, profile=True)
                ws, note = trace.op_workspace, None
            if note:
                notes.append(note)
            if ws is not None:
                # Every op gets its (possibly zero) workspace event, so traces at different
                # batch sizes keep the same events and stay comparable for batch scaling.
                inserts.extend((pos, w, op) for op, (pos, w) in enumerate(zip(trace.op_positions, ws)))
        alloc_bytes = list(trace.alloc_bytes.tolist())
        alloc_cat = list(trace.alloc_category.tolist())
        ev_alloc = trace.event_alloc.tolist()
        ev_sign = trace.event_sign.tolist()
        ev_phase = trace.event_phase.tolist()
        if self.device == "cuda" and self.spec is not None:
            # cuBLAS allocates its workspace through the caching allocator on the first GEMM
            # and keeps it: one allocation alive from the first forward on.
            first_forward = next((i for i, p in enumerate(ev_phase) if p > 0), len(ev_phase))
            inserts.append((first_forward, -self.spec.cublas_workspace_bytes, -1))
        op_alloc = [-1] * len(trace.ops)  # per op: its workspace allocation
        if inserts:
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
                    out_alloc.append(index); out_sign.append(1); out_phase.append(phase)
                    if nbytes >= 0:  # a kernel's scratch: freed when the op returns
                        out_alloc.append(index); out_sign.append(-1); out_phase.append(phase)
                    j += 1
                if i < len(ev_alloc):
                    out_alloc.append(ev_alloc[i]); out_sign.append(ev_sign[i]); out_phase.append(ev_phase[i])
            ev_alloc, ev_sign, ev_phase = out_alloc, out_sign, out_phase
        return _Prepared(
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
        )

    def _events(self, config: TrainConfig, *, exact: bool = False) -> tuple[_Prepared, str]:
        b = config.micro_batch_size
        key = (self._shape_key(config), b)
        if key in self._prepared:
            p = self._prepared[key]
            return p, p.method
        # Below the smallest anchor the fit would extrapolate into sizes where kernels pick
        # other algorithms (oneDNN at batch 1): trace such batches themselves.
        scaling = None if (exact or b < self._anchors[0] or key[0] in self._exact_shapes) else self._scaling_for(config)
        if scaling is not None:
            sizes = np.rint(scaling.intercept + scaling.slope * b).astype(np.int64)
            sizes = np.maximum(sizes, 0)
            base = self._prepared[(self._shape_key(config), scaling.base_batch)]
            if base.workspaces is not None:
                allocs, fit, sources = base.workspaces
                sizes[allocs[allocs >= 0]] = np.asarray(workspaces_at(fit, sources, b), dtype=np.int64)[allocs >= 0]
            scaled = _Prepared(
                alloc_bytes=sizes, alloc_category=base.alloc_category, event_alloc=base.event_alloc,
                event_sign=base.event_sign, event_phase=base.event_phase,
                phase_labels=base.phase_labels, method="scaled", notes=base.notes,
                ops=base.ops, host_allocs=base.host_allocs, workspaces=base.workspaces,
            )
            if scaling.costs is not None:
                c, f0, f1, m0, m1 = scaling.costs
                scaled.costs = OpCosts(np.maximum(f0 + f1 * b, 0), np.maximum(m0 + m1 * b, 0), c.dtype, c.phase, c.names)
            return scaled, "scaled"
        p = self._trace(config, b)
        return p, p.method

    def _scaling_for(self, config: TrainConfig) -> _Scaling | None:
        shape_key = self._shape_key(config)
        with self._lock:
            if shape_key in self._scaling:
                return self._scaling[shape_key]
            check, self._affinity_check = self._affinity_check, None
            if check is not None and self._affine is None and self._shape_key(check) != shape_key:
                # The prefetch traces a third anchor for this one configuration only: affinity
                # is checked there, and every other shape then scales from two.
                self._scaling_for(check)
            scaling: _Scaling | None = None
            if not self._data_dependent and self._affine is not False:
                traces, anchors = self._anchor_traces(config)
                if traces and all(t.method == "traced" for t in traces) and _aligned(traces):
                    b0, b2 = anchors[0], anchors[-1]
                    s0, s2 = traces[0].alloc_bytes.astype(np.float64), traces[-1].alloc_bytes.astype(np.float64)
                    slope = (s2 - s0) / (b2 - b0)
                    intercept = s0 - slope * b0
                    affine = True
                    if len(anchors) == 3:
                        b1, s1 = anchors[1], traces[1].alloc_bytes
                        tensors = traces[0].alloc_category != int(Category.WORKSPACE)
                        # Tensor sizes must be exactly affine (a contrastive loss's b x b
                        # logits are not); workspaces are fitted, kernels pick algorithms by size.
                        affine = np.array_equal(np.rint((intercept + slope * b1)[tensors]), s1[tensors])
                        if not affine and self._anchors != ANCHORS:
                            # Batch 1 may take its own path (a squeezed dimension): judge
                            # affinity on the CPU's anchors before giving scaling up.
                            self._anchors = ANCHORS
                            return self._scaling_for(config)
                        self._affine = affine
                    if affine:
                        scaling = _Scaling(anchors[0], intercept, slope, traces[0])
                        costs = [op_costs(t.ops) for t in traces]
                        if costs[0].names == costs[-1].names:
                            f1 = (costs[-1].flops - costs[0].flops) / (b2 - b0)
                            m1 = (costs[-1].bytes_moved - costs[0].bytes_moved) / (b2 - b0)
                            scaling.costs = (costs[0], costs[0].flops - f1 * b0, f1,
                                             costs[0].bytes_moved - m1 * b0, m1)
            self._scaling[shape_key] = scaling
            return scaling

    def _anchor_traces(self, config: TrainConfig) -> tuple[list[_Prepared], tuple[int, ...]]:
        """Traces of ``config`` at the anchor batch sizes ([] when they cannot be had).

        The first configuration of a model checks affinity on three anchors; once the model
        has shown its sizes are affine in the batch (a property of the model, not of
        precision or checkpointing), two anchors fit the others."""
        while True:
            anchors = self._anchors if self._affine is None else (self._anchors[0], self._anchors[-1])
            try:
                self._trace_in_parallel(config, anchors)
                traces = [self._trace(config, a) for a in anchors]
            except Exception:  # noqa: BLE001 - small batches may be refused; trace each b
                traces = []
            if self._anchors == ANCHORS or (traces and _aligned(traces)):
                return traces, anchors
            # Batch 1 refused or shaped apart from the others: anchor where the CPU does.
            self._anchors = ANCHORS

    def _trace_in_parallel(self, config: TrainConfig, batches: Sequence[int]) -> None:
        """Trace the last missing batch size in the worker process while this one traces
        the others, when traces of this model take long enough to be worth a second core."""
        if self._pending or self._queue:
            return  # a prefetch is in flight: its queue has the anchors, or this process traces them
        shape_key = self._shape_key(config)
        missing = [b for b in batches if not self._have((shape_key, b))]
        if len(missing) >= 2 and self._last_fake_trace_s == 0.0 and not self._data_dependent:
            # The model's first trace says how long its traces take.
            self._trace(config, missing.pop(0))
        if (len(missing) < 2 or self._data_dependent or self._worker_failed
                or self._last_fake_trace_s < PARALLEL_TRACE_S or not worker_available()
                or (os.cpu_count() or 1) < 2):
            return
        remote = missing[-1]
        try:
            if self._worker is None or not self._worker.alive():
                self._worker = TraceWorker(self.task)
            self._worker.submit(config, remote, self.device, self._capability())
        except Exception:  # noqa: BLE001 - no worker: trace alone
            self._drop_worker()
            return
        try:
            for b in missing[:-1]:
                self._trace(config, b)
        finally:
            try:
                # Its trace takes about as long as ours: far longer means it is stuck.
                trace = self._worker.result(timeout_s=max(120.0, 20 * self._last_fake_trace_s))
            except WorkerDied:
                self._drop_worker()
                trace = None
            except Exception:  # noqa: BLE001 - traced here again, which raises it properly
                trace = None
            if trace is not None and trace.method == "traced":
                self._prepared.setdefault((shape_key, remote), self._prepare(self._keep_derived(trace)))

    def _drop_worker(self) -> None:
        self._worker_failed = True
        self.close()

    # -- replay ---------------------------------------------------------------------------
    def _replay(self, config: TrainConfig, p: _Prepared, method: str) -> Estimate:
        cuda = self.device == "cuda"
        sizes = replay_sizes(p, self.device)
        signed = sizes[p.event_alloc] * p.event_sign.astype(np.int64)
        running = np.cumsum(signed)
        peak_index = int(np.argmax(running)) if len(running) else 0
        peak_allocated = int(running[peak_index]) if len(running) else 0
        cats = p.alloc_category[p.event_alloc[: peak_index + 1]].astype(np.int64)
        by_cat = np.bincount(cats, weights=signed[: peak_index + 1], minlength=len(Category))
        breakdown = {Category(i).label: int(round(v)) for i, v in enumerate(by_cat)}
        reserved = None
        notes = list(p.notes)
        batch_shapes = self._batch_shapes(config, p)
        if batch_shapes is not None:
            notes.append(_shapes_note(batch_shapes))
        if cuda:
            reserved = _simulate_reserved(sizes, p.event_alloc, p.event_sign)
        params, trainable = self._param_counts()
        parts = step_time_parts(p.op_costs(), p.phase_labels, config.grad_accum_steps, self.rates())
        comm = self._comm_time(config, p)
        # Added after calibration: probes run on one device and measure no communication.
        fixed = comm.exposed_s if comm is not None else 0.0
        seconds, calibrated = self._step_seconds(parts, fixed)
        if calibrated is not None:
            notes.append(calibrated)
        if comm is not None:
            notes.append(f"communication {comm.total_s * 1e3:.2f} ms per step, "
                         f"{comm.exposed_s * 1e3:.2f} ms of it not hidden by compute")
        assert self.spec is not None or not cuda
        return Estimate(
            step_time_s=seconds,
            samples_per_s=_throughput(config, seconds, batch_shapes),
            config=config,
            device=self.device,
            gpu=self.spec.name if self.spec else None,
            peak_allocated_bytes=peak_allocated,
            peak_reserved_bytes=reserved,
            breakdown=breakdown,
            peak_phase=p.phase_labels[int(p.event_phase[peak_index])] if len(running) else "setup",
            context_bytes=self.spec.context_bytes if (cuda and self.spec) else 0,
            workspace_bytes=self.spec.cublas_workspace_bytes if (cuda and self.spec) else 0,
            method=method,
            modelled=cuda,
            params=params,
            trainable_params=trainable,
            notes=tuple(notes),
            time_parts={"overhead": parts.overhead_s, **parts.work_s, "fixed": fixed},
            batch_shapes=batch_shapes,
        )

    def _batch_shapes(self, config: TrainConfig, p: _Prepared) -> dict[str, Any] | None:
        """What ``Estimate.batch_shapes`` says of the batch this estimate was made for."""
        planned = self.task.planned(config.micro_batch_size)
        out: dict[str, Any] = {}
        if planned is not None:
            profile = self.task.shapes()
            dims = profile.varying_dims
            per_item = profile.sizes.shape[1]
            out.update(policy=self.task.shape_policy, items=list(planned.items),
                       padded=[planned.padded[i] for i in dims], dims=[int(i) for i in dims],
                       item_max=[int(profile.sizes[:, i].max()) for i in dims],
                       source=profile.source, coverage=profile.coverage, per_item=per_item)
            if not profile.collate_pads:
                out["collate"] = "does not pad to the longest item; planned from collating the planned items"
            else:
                out.update(padding_factor=self._padding_factor(config),
                           order="length-grouped" if config.length_grouped else "random")
        if p.draws is not None:
            out.update(draws=p.draws[0], batch_offset=p.draws[1])
            if p.draws[2] is not None:
                out.update(bound=f"allocations that vary between the draws at {DATA_DEPENDENT_CAPACITY}x "
                                 "their largest", capacity=DATA_DEPENDENT_CAPACITY, fullest_batch_peak_bytes=p.draws[2])
        return out or None

    def _padding_factor(self, config: TrainConfig) -> float:
        from ._shapes import padding_factor
        planned = self.task.planned(config.micro_batch_size)
        assert planned is not None
        return padding_factor(self.task.shapes(), planned, config.micro_batch_size,
                              config.global_batch if config.length_grouped else 0)

    def shape_distribution(self, config: TrainConfig, *, exact: bool = False) -> Estimate:
        """``estimate(config)`` with the predicted peak at the median, 99th-percentile and
        worst batch of varying-shape data added to ``batch_shapes`` (each an exact trace of
        its own; the same estimate for fixed-shape data)."""
        est = self.estimate(config, exact=exact)
        if est.batch_shapes is None or "policy" not in est.batch_shapes:
            return est
        shapes = dict(est.batch_shapes)
        for label in ("median", "p99", "max"):
            if label == self.task.shape_policy:
                other = est
            else:
                sub = self._shape_estimators.get(label)
                if sub is None:
                    sub = self._shape_estimators[label] = Estimator(
                        self.task.with_shape_policy(label), device=self.device,
                        gpu=self.spec.name if self.spec is not None else None)
                other = sub.estimate(config, exact=True)
            assert other.batch_shapes is not None
            shapes[label] = {"padded": list(other.batch_shapes["padded"]), "items": list(other.batch_shapes["items"]),
                             "peak_bytes": other.peak_bytes}
        notes = [*est.notes, "peak at the median / p99 / max batch: " + " / ".join(
            f"{_mib(shapes[k]['peak_bytes'])} ({', '.join(map(str, shapes[k]['padded']))})"
            for k in ("median", "p99", "max"))]
        return replace(est, batch_shapes=shapes, notes=tuple(notes))

    def _comm_time(self, config: TrainConfig, p: _Prepared) -> CommTime | None:
        """Collectives of one optimizer step and the part backward and forward do not hide."""
        if config.strategy == "single" or config.world_size == 1:
            return None
        facts = self._model_facts()
        link = ring_bandwidth(self.spec, config.nodes)
        forward_s = self._pass_time(p, "forward")
        backward_s = self._pass_time(p, "backward")
        if config.strategy == "ddp":
            low = weight_dtype(config.precision) is not None
            return ddp_comm(facts.ddp_buckets_low if low else facts.ddp_buckets, backward_s, config, link)
        # FSDP2 gathers in the autocast dtype under mixed precision and reduces in fp32; under
        # a true low precision it gathers and reduces the low-precision weights as they are.
        param_bytes = 2 if config.precision != "fp32" else 4
        grad_bytes = 2 if weight_dtype(config.precision) is not None else 4
        return fsdp_comm(facts.units.block_numels, facts.units.root_numel, param_bytes, grad_bytes,
                         forward_s, backward_s, config, link)

    def _pass_time(self, p: _Prepared, kind: str) -> float:
        """Compute time of one steady-state micro-batch's forward or backward pass."""
        costs = p.op_costs()
        keep = np.asarray([p.phase_labels[int(ph)].endswith(kind) for ph in costs.phase], dtype=bool)
        if not keep.any():
            return 0.0
        subset = OpCosts(costs.flops[keep], costs.bytes_moved[keep], [d for d, k in zip(costs.dtype, keep) if k],
                         costs.phase[keep], [n for n, k in zip(costs.names, keep) if k])
        return step_time(subset, p.phase_labels, 1, self.rates())

    def _param_counts(self) -> tuple[int, int]:
        facts = self._model_facts()
        return facts.params, facts.trainable

    def _has_block_stack(self) -> bool:
        return len(self._model_facts().units.block_numels) > 0

    def _model_facts(self) -> _ModelFacts:
        """Parameter counts, FSDP2 units and DDP buckets, from a fake copy of the model."""
        if self._facts is None:
            from .runtime._checkpoint import find_block_stack
            from .memory._distributed import ddp_bucket_bytes, fsdp_units
            from .tracing._trace import _fake_mode, build_fake_model
            model = build_fake_model(self.task, _fake_mode())
            distinct = list(dict.fromkeys(model.parameters()))
            find_block_stack(model, self.task.checkpoint_blocks)
            self._facts = _ModelFacts(
                params=sum(p.numel() for p in distinct),
                trainable=sum(p.numel() for p in distinct if p.requires_grad),
                units=fsdp_units(model, self.task.checkpoint_blocks),
                ddp_buckets=tuple(ddp_bucket_bytes(model)),
                # DDP's buckets hold the gradients, in the weights' dtype: half under bf16-true.
                ddp_buckets_low=tuple(ddp_bucket_bytes(cast_model(model, "bf16-true"))),
            )
        return self._facts


@dataclass(frozen=True)
class _ModelFacts:
    params: int
    trainable: int
    units: FsdpUnits
    ddp_buckets: tuple[int, ...]
    ddp_buckets_low: tuple[int, ...]
    """DDP's buckets under bf16-true/fp16-true (2-byte gradients; batch norm's stay fp32)."""


def _throughput(config: TrainConfig, seconds: float, shapes: Mapping[str, Any] | None) -> float | None:
    """Samples per second over an epoch: ``seconds`` is the planned batch's step, and with
    items of varying shape an average step pads to ``padding_factor`` of its volume."""
    if seconds <= 0:
        return None
    factor = float((shapes or {}).get("padding_factor", 1.0)) or 1.0
    return config.global_batch / (seconds * factor)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _shapes_note(shapes: Mapping[str, Any]) -> str:
    parts = []
    if "policy" in shapes:
        what = ("the worst batch the loader can form" if shapes["policy"] == "max"
                else f"the {shapes['policy']} batch of an epoch")
        parts.append(f"batch shapes: planned for {what}, padded to sizes ({', '.join(map(str, shapes['padded']))}) "
                     f"(items {', '.join(map(str, shapes['items'][:4]))}{', …' if len(shapes['items']) > 4 else ''}); "
                     f"item sizes from {shapes['source']}, {shapes['coverage']}")
        if "collate" in shapes:
            parts.append(f"the collate {shapes['collate']}")
        if "padding_factor" in shapes:
            parts.append(f"throughput at an epoch's mean batch ({shapes['order']} order): "
                         f"{shapes['padding_factor']:.2f} of the planned batch's padded size")
    if "draws" in shapes:
        if "bound" in shapes:
            parts.append(f"shapes depend on data: over {shapes['draws']} real batches, every allocation at the "
                         f"largest it reached, those that varied at {shapes['capacity']}x that (a capacity factor); "
                         f"the fullest batch, from item {shapes['batch_offset']}, needs "
                         f"{_mib(shapes['fullest_batch_peak_bytes'])}; a router more skewed than that may need more")
        else:
            parts.append(f"shapes depend on data: the fullest of {shapes['draws']} real batches "
                         f"(from item {shapes['batch_offset']}); other batches may need more")
    return "; ".join(parts)


def _trace_peak(trace: Trace) -> int:
    """A trace's peak: tensors alive, plus the largest kernel scratch measured during an op."""
    signed = trace.alloc_bytes[trace.event_alloc] * trace.event_sign.astype(np.int64)
    running = np.concatenate([[0], np.cumsum(signed)])
    peak = int(running.max())
    if trace.op_workspace is not None and trace.op_positions:
        pos = np.minimum(np.asarray(trace.op_positions, dtype=np.int64), len(running) - 1)
        peak = max(peak, int((running[pos] + np.asarray(trace.op_workspace, dtype=np.int64)).max()))
    return peak


def _aligned(traces: list[_Prepared]) -> bool:
    first = traces[0]
    return all(
        len(t.alloc_bytes) == len(first.alloc_bytes)
        and np.array_equal(t.event_alloc, first.event_alloc)
        and np.array_equal(t.event_sign, first.event_sign)
        and np.array_equal(t.alloc_category, first.alloc_category)
        for t in traces[1:]
    )


def replay_sizes(p: _Prepared, device: str) -> np.ndarray:
    """Bytes of each allocation as the target's allocator counts them (one place, so that
    the estimate and its timeline export cannot disagree)."""
    sizes = p.alloc_bytes
    if device == "cuda":
        sizes = np.where(sizes > 0, ((sizes + 511) // 512) * 512, 0)
        if len(p.host_allocs):
            sizes = sizes.copy()
            sizes[p.host_allocs] = 0  # host memory, not the GPU's
    return sizes


def _simulate_reserved(sizes: np.ndarray, event_alloc: np.ndarray, event_sign: np.ndarray) -> int:
    sim = CachingAllocatorSim()
    handles: dict[int, int] = {}
    for index, sign in zip(event_alloc.tolist(), event_sign.tolist()):
        if sign > 0:
            n = int(sizes[index])
            if n > 0:
                handles[index] = sim.malloc(n)
        else:
            h = handles.pop(index, None)
            if h is not None:
                sim.free(h)
    return sim.stats.peak_reserved


def estimate(
    model: Task | str,
    *,
    batch_size: int,
    accum: int = 1,
    precision: str = "fp32",
    checkpoint: int = 0,
    device: str | None = None,
    gpu: str | None = None,
    shape_policy: str = "max",
) -> Estimate:
    """Predict the peak memory of training ``model`` with one configuration.

    ``model`` is a model-file path or a :class:`Task`. When the dataset's items vary in shape
    the estimate is for the batch ``shape_policy`` names (``max``: the worst the loader can
    form; ``p99``: the 99th percentile of an epoch's), and ``batch_shapes`` gives the peak at
    the median, p99 and max batch.

    >>> est = estimate("examples/digits.py", batch_size=64)     # doctest: +SKIP
    >>> est.peak_allocated_bytes                                 # doctest: +SKIP
    1843200
    """
    from ._task import load_task
    task = load_task(model) if isinstance(model, str) else model
    config = TrainConfig(micro_batch_size=batch_size, grad_accum_steps=accum,
                         precision=normalize_precision(precision), checkpoint_segments=checkpoint)
    return Estimator(task, device=device, gpu=gpu, shape_policy=shape_policy).shape_distribution(config)

