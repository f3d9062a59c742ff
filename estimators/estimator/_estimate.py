"""The estimate of one training configuration, as a pipeline: trace → scale → replay → price.

``Estimator`` keeps the traces of one task and answers any configuration:

1. **trace** (``_traces.TraceSource``): one step traced on fake tensors at the configuration's
   own micro-batch size (exact), with the kernel workspaces of a CPU target put in; models
   whose shapes depend on data values are measured with real CPU runs instead (method
   ``measured-cpu``). A worker process shares the traces a search will need
   (``_prefetch``).
2. **scale** (``_scaling.BatchScaling``): a micro-batch that has not been traced is scaled
   from traces at small "anchor" sizes when every allocation's size is affine in the batch
   (``a + c·b``, ~ms, method ``scaled``); otherwise it is traced afresh.
3. **replay** (``memory._replay``): the events through the target's allocator: on ``cpu`` as
   the CPU allocator counts (bytes as asked); on ``cuda`` with 512-byte rounding
   (``max_memory_allocated``) and through the caching-allocator model
   (``max_memory_reserved``), the cuBLAS workspace its own allocation.
4. **price** (``timing._pricing``): the step's seconds on the roofline, refitted by the probes
   so far, plus the communication compute does not hide.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, TypedDict

import torch

from .._config import TrainConfig, normalize_precision
from .._errors import ConfigError
from ..hardware._gpus import GPUSpec, detect_local_gpu, get_gpu
from ..memory._facts import ModelFacts, model_facts
from ..memory._prepare import Prepared
from ..memory._replay import MemoryPeak, replay
from ..runtime._optim_bwd import check_compatible as check_optimizer_in_backward
from ..task._task import Task
from ..timing._calibration import TimeCalibration
from ..timing._cpu_rates import cpu_rates
from ..timing._pricing import CALIBRATED, Price, price, step_seconds, stored_parts
from ..timing._timing import DeviceRates, gpu_rates
from ._scaling import BatchScaling
from ._traces import DATA_DEPENDENT_CAPACITY, TraceSource

__all__ = ["BatchShapes", "Estimate", "Estimator", "ShapePeak", "estimate", "resolve_target"]

Device = Literal["cpu", "cuda"]


class ShapePeak(TypedDict):
    """The predicted peak at one batch of varying-shape data (``median``, ``p99``, ``max``)."""

    padded: list[int]
    items: list[int]
    peak_bytes: int


class BatchShapes(TypedDict, total=False):
    """``Estimate.batch_shapes``: what the estimate says of the batches it was made for."""

    # Items of varying shape: the planned batch and where its sizes came from.
    policy: str
    items: list[int]
    padded: list[int]
    dims: list[int]
    item_max: list[int]
    source: str
    coverage: str
    per_item: int
    collate: str
    padding_factor: float
    order: str
    # Asked with Estimator.shape_distribution: the peak at other batches.
    median: ShapePeak
    p99: ShapePeak
    max: ShapePeak
    # Data-dependent shapes: the real batches the worst was taken over.
    draws: int
    batch_offset: int
    bound: str
    capacity: float
    fullest_batch_peak_bytes: int


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
    batch_shapes: BatchShapes | None = None
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
    host_bytes: int = 0
    """Host memory the step holds beside the device's on cuda, outside ``peak_bytes``: CPU
    offload's parameters, gradients and optimizer state, offloaded activations, the RNG states
    checkpointing saves; 0 on cpu, where all is one memory."""

    @property
    def peak_bytes(self) -> int:
        """The figure a budget is compared with: reserved on cuda (what the driver sees,
        context excluded, as ``set_per_process_memory_fraction`` counts), allocated on cpu."""
        return self.peak_reserved_bytes if self.peak_reserved_bytes is not None else self.peak_allocated_bytes

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["config"] = self.config.to_dict()
        d["breakdown"] = dict(self.breakdown)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Estimate:
        """The estimate ``to_dict`` wrote, as read back from JSON."""
        d = dict(data)
        d["config"] = TrainConfig.from_dict(d["config"])
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)


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
        local = detect_local_gpu()
        if local is None:
            raise ConfigError("--device cuda but no GPU is visible here; name the card with --gpu NAME (e.g. --gpu A100-80GB)")
        return "cuda", local
    return "cpu", None


class Estimator:
    """Estimates configurations of one task on one target, caching traces.

    Thread-safe for concurrent ``estimate`` calls (a lock serialises tracing).
    ``compose_blocks`` (default: on unless ``MEMPLAN_FULL_TRACE=1``) composes the fake trace
    of a deep block stack from traces of the model cut to a few blocks, checked against each
    other (``tracing._compose``); an estimate's notes say when, or why a deep stack was traced
    whole.
    """

    def __init__(
        self, task: Task, *, device: str | None = None, gpu: str | None = None, shape_policy: str | None = None,
        compose_blocks: bool | None = None,
    ) -> None:
        self.task = task.with_shape_policy(shape_policy) if shape_policy is not None else task
        self._shape_estimators: dict[str, Estimator] = {}
        self.device, self.spec = resolve_target(device, gpu)
        self._lock = threading.RLock()
        self._traces = TraceSource(self.task, self.device, self.spec, self._lock, compose_blocks=compose_blocks)
        self._scaler = BatchScaling(self._traces, self._lock)
        self._facts: ModelFacts | None = None
        self._rates: DeviceRates | None = None
        self._calibration = TimeCalibration()

    # -- public -----------------------------------------------------------------------
    def estimate(self, config: TrainConfig, *, exact: bool = False) -> Estimate:
        """Estimate ``config``; ``exact=True`` traces its micro-batch size itself instead of
        scaling from the anchor traces (one trace instead of three, for a single answer)."""
        self.check_config(config)
        prepared, method = self._events(config, exact=exact)  # trace, or scale
        memory = replay(prepared, self.device)  # replay
        cost = price(
            config,
            prepared,
            self.rates(),
            self._calibration,  # price
            self._model_facts(),
            self.spec,
        )
        return self._assemble(config, prepared, method, memory, cost)

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
        self._scaler.expect(configs, prefetch=prefetch)

    def rates(self) -> DeviceRates:
        """The target's compute and memory rates (spec table for GPUs, measured for the CPU)."""
        if self._rates is None:
            self._rates = gpu_rates(self.spec) if self.spec is not None else cpu_rates()
        return self._rates

    def calibrate(self, config: TrainConfig, measured_step_time_s: float, *, predicted: Estimate | None = None) -> None:
        """Refit the step-time model with a probe's measurement of ``config``: the per-op
        fixed cost and the work are refitted apart once probes differ in their mix of the two
        (see ``TimeCalibration``). ``predicted``, this estimator's prediction of ``config``
        (from a resumed study, say), saves tracing it again."""
        self.check_config(config)
        stored = predicted.time_parts if predicted is not None and predicted.config == config else None
        parts = stored_parts(stored)
        with self._lock:
            if parts is None:
                p, _ = self._events(config)
                cost = price(config, p, self.rates(), self._calibration, self._model_facts(), self.spec)
                stored = cost.time_parts
                parts = stored_parts(stored)
            assert parts is not None and stored is not None
            # What the roofline does not model (host-link copies compute does not hide, the
            # CPU's optimizer step) is priced apart and added after calibration: a probe that
            # measured it too leaves it out of the refit.
            self._calibration.add(parts, max(measured_step_time_s - float(stored.get("fixed", 0.0)), 0.0))

    def recalibrated(self, estimate: Estimate) -> Estimate:
        """``estimate`` (a prediction of this estimator's) with its step time refitted by the
        probes so far, from its stored parts: no trace is needed, so a resumed study's
        predictions stay cheap. One without parts (stored by an older version) is estimated
        again."""
        parts = stored_parts(estimate.time_parts)
        if parts is None:
            return self.estimate(estimate.config)
        assert estimate.time_parts is not None
        with self._lock:
            seconds, note = step_seconds(parts, float(estimate.time_parts.get("fixed", 0.0)), self._calibration)
        notes = [n for n in estimate.notes if not n.startswith(CALIBRATED)]
        if note is not None:
            # Where estimate() puts it: before the communication note.
            at = next((i for i, n in enumerate(notes) if n.startswith("communication ")), len(notes))
            notes.insert(at, note)
        return replace(
            estimate,
            step_time_s=seconds,
            samples_per_s=_throughput(estimate.config, seconds, estimate.batch_shapes),
            notes=tuple(notes),
        )

    def close(self) -> None:
        """Stop the trace worker, if one runs (a later trace starts it again when needed)."""
        self._traces.close()

    def check_config(self, config: TrainConfig) -> None:
        check_optimizer_in_backward(config, self.task.step)
        if config.precision in ("bf16-mixed", "bf16-true") and self.spec is not None and not self.spec.bf16:
            raise ConfigError(
                f"{self.spec.name} has no bf16 support (needs compute capability 8.0+); use --precision fp16 or fp32"
            )
        if config.strategy == "fsdp" and config.world_size > 1 and not self._model_facts().units.block_numels:
            raise ConfigError(
                f"{self.task.name}: fsdp shards each block of the model's block stack, and none was "
                "found; define checkpoint_blocks(model) in the model file, or use ddp"
            )

    # -- the pipeline's stages ------------------------------------------------------------
    def _events(self, config: TrainConfig, *, exact: bool = False) -> tuple[Prepared, str]:
        """The events of ``config``: its own trace if there is one, else scaled from the
        anchors (unless ``exact``), else traced now."""
        known = self._traces.known(config)
        if known is not None:
            return known, known.method
        scaled = None if exact else self._scaler.scaled(config)
        if scaled is not None:
            return scaled, "scaled"
        p = self._traces.prepared(config, config.micro_batch_size)
        return p, p.method

    def _assemble(self, config: TrainConfig, p: Prepared, method: str, memory: MemoryPeak, cost: Price) -> Estimate:
        """The ``Estimate`` of the replay and the price of ``p``."""
        cuda = self.device == "cuda"
        notes = list(p.notes)
        batch_shapes = self._batch_shapes(config, p)
        if batch_shapes is not None:
            notes.append(_shapes_note(batch_shapes))
        notes.extend(cost.notes)
        facts = self._model_facts()
        assert self.spec is not None or not cuda
        return Estimate(
            step_time_s=cost.seconds,
            samples_per_s=_throughput(config, cost.seconds, batch_shapes),
            config=config,
            device=self.device,
            gpu=self.spec.name if self.spec else None,
            peak_allocated_bytes=memory.allocated,
            peak_reserved_bytes=memory.reserved,
            breakdown=memory.breakdown,
            peak_phase=memory.phase,
            context_bytes=self.spec.context_bytes if (cuda and self.spec) else 0,
            workspace_bytes=self.spec.cublas_workspace_bytes if (cuda and self.spec) else 0,
            method=method,
            modelled=cuda,
            params=facts.params,
            trainable_params=facts.trainable,
            notes=tuple(notes),
            time_parts=cost.time_parts,
            batch_shapes=batch_shapes,
            host_bytes=memory.host,
        )

    def _batch_shapes(self, config: TrainConfig, p: Prepared) -> BatchShapes | None:
        """What ``Estimate.batch_shapes`` says of the batch this estimate was made for."""
        planned = self.task.planned(config.micro_batch_size)
        out: BatchShapes = {}
        if planned is not None:
            profile = self.task.shapes()
            dims = profile.varying_dims
            per_item = profile.sizes.shape[1]
            out.update({
                "policy": self.task.shape_policy,
                "items": list(planned.items),
                "padded": [planned.padded[i] for i in dims],
                "dims": [int(i) for i in dims],
                "item_max": [int(profile.sizes[:, i].max()) for i in dims],
                "source": profile.source,
                "coverage": profile.coverage,
                "per_item": per_item,
            })
            if not profile.collate_pads:
                out["collate"] = "does not pad to the longest item; planned from collating the planned items"
            else:
                out.update({
                    "padding_factor": self._padding_factor(config),
                    "order": "length-grouped" if config.length_grouped else "random",
                })
        if p.draws is not None:
            out.update({"draws": p.draws[0], "batch_offset": p.draws[1]})
            if p.draws[2] is not None:
                out.update({
                    "bound": f"allocations that vary between the draws at {DATA_DEPENDENT_CAPACITY}x their largest",
                    "capacity": DATA_DEPENDENT_CAPACITY,
                    "fullest_batch_peak_bytes": p.draws[2],
                })
        return out or None

    def _padding_factor(self, config: TrainConfig) -> float:
        from ..task._shapes import padding_factor

        planned = self.task.planned(config.micro_batch_size)
        assert planned is not None
        return padding_factor(
            self.task.shapes(), planned, config.micro_batch_size, config.global_batch if config.length_grouped else 0
        )

    def shape_distribution(self, config: TrainConfig, *, exact: bool = False) -> Estimate:
        """``estimate(config)`` with the predicted peak at the median, 99th-percentile and
        worst batch of varying-shape data added to ``batch_shapes`` (each an exact trace of
        its own; the same estimate for fixed-shape data)."""
        est = self.estimate(config, exact=exact)
        if est.batch_shapes is None or "policy" not in est.batch_shapes:
            return est
        shapes = est.batch_shapes.copy()
        for label in ("median", "p99", "max"):
            if label == self.task.shape_policy:
                other = est
            else:
                sub = self._shape_estimators.get(label)
                if sub is None:
                    sub = self._shape_estimators[label] = Estimator(
                        self.task.with_shape_policy(label),
                        device=self.device,
                        gpu=self.spec.name if self.spec is not None else None,
                        compose_blocks=self._traces.compose_blocks,
                    )
                other = sub.estimate(config, exact=True)
            assert other.batch_shapes is not None
            shapes[label] = {
                "padded": list(other.batch_shapes["padded"]),
                "items": list(other.batch_shapes["items"]),
                "peak_bytes": other.peak_bytes,
            }
        notes = [
            *est.notes,
            "peak at the median / p99 / max batch: "
            + " / ".join(
                f"{_mib(shapes[k]['peak_bytes'])} ({', '.join(map(str, shapes[k]['padded']))})"
                for k in ("median", "p99", "max")
            ),
        ]
        return replace(est, batch_shapes=shapes, notes=tuple(notes))

    def _model_facts(self) -> ModelFacts:
        """Parameter counts, FSDP2 units and DDP buckets, from a fake copy of the model."""
        if self._facts is None:
            self._facts = model_facts(self.task)
        return self._facts


def _throughput(config: TrainConfig, seconds: float, shapes: BatchShapes | None) -> float | None:
    """Samples per second over an epoch: ``seconds`` is the planned batch's step, and with
    items of varying shape an average step pads to ``padding_factor`` of its volume."""
    if seconds <= 0:
        return None
    factor = float((shapes or {}).get("padding_factor", 1.0)) or 1.0
    return config.global_batch / (seconds * factor)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _shapes_note(shapes: BatchShapes) -> str:
    parts = []
    if "policy" in shapes:
        what = (
            "the worst batch the loader can form"
            if shapes["policy"] == "max"
            else f"the {shapes['policy']} batch of an epoch"
        )
        parts.append(
            f"batch shapes: planned for {what}, padded to sizes ({', '.join(map(str, shapes['padded']))}) "
            f"(items {', '.join(map(str, shapes['items'][:4]))}{', …' if len(shapes['items']) > 4 else ''}); "
            f"item sizes from {shapes['source']}, {shapes['coverage']}"
        )
        if "collate" in shapes:
            parts.append(f"the collate {shapes['collate']}")
        if "padding_factor" in shapes:
            parts.append(
                f"throughput at an epoch's mean batch ({shapes['order']} order): "
                f"{shapes['padding_factor']:.2f} of the planned batch's padded size"
            )
    if "draws" in shapes:
        if "bound" in shapes:
            parts.append(
                f"shapes depend on data: over {shapes['draws']} real batches, every allocation at the "
                f"largest it reached, those that varied at {shapes['capacity']}x that (a capacity factor); "
                f"the fullest batch, from item {shapes['batch_offset']}, needs "
                f"{_mib(shapes['fullest_batch_peak_bytes'])}; a router more skewed than that may need more"
            )
        else:
            parts.append(
                f"shapes depend on data: the fullest of {shapes['draws']} real batches "
                f"(from item {shapes['batch_offset']}); other batches may need more"
            )
    return "; ".join(parts)


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
    from ..task._task import load_task

    task = load_task(model) if isinstance(model, str) else model
    config = TrainConfig(
        micro_batch_size=batch_size,
        grad_accum_steps=accum,
        precision=normalize_precision(precision),
        checkpoint_segments=checkpoint,
    )
    return Estimator(task, device=device, gpu=gpu, shape_policy=shape_policy).shape_distribution(config)
