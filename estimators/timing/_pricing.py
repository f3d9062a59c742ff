"""Pricing prepared events: a step's seconds from its op costs, probes and communication.

The roofline (``_timing.step_time_parts``) gives a step's uncalibrated parts; the probes so
far refit them (``TimeCalibration``); exposed communication (``_comm``), which probes on one
device cannot measure, is added after calibration. A prediction keeps its parts
(``Estimate.time_parts``) so that it can be recalibrated, and calibrate, without its trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .._config import TrainConfig
from ..hardware._gpus import GPUSpec
from ..memory._facts import ModelFacts
from ..memory._prepare import Prepared
from ..runtime._precision import weight_dtype
from ._activation_offload_time import activation_offload_time
from ._calibration import TimeCalibration
from ._comm import (
    COLLECTIVE_PREFIX,
    CommTime,
    ddp_comm,
    fsdp_comm,
    pipeline_time,
    ring_bandwidth,
    tensor_parallel_comm,
)
from ._cpu_offload_time import cpu_offload_time
from ._timing import DeviceRates, OpCosts, StepTimeParts, costs_of, steady_state_weights, step_time, step_time_parts

__all__ = ["CALIBRATED", "Price", "calibrated_note", "price", "step_seconds", "stored_parts"]

CALIBRATED = "step time calibrated on "


@dataclass(frozen=True)
class Price:
    """A step's predicted seconds, its uncalibrated parts and the notes that explain it."""

    seconds: float
    time_parts: dict[str, float]
    notes: tuple[str, ...]


def calibrated_note(points: int) -> str:
    return f"{CALIBRATED}{points} probe(s)"


def stored_parts(time_parts: Mapping[str, float] | None) -> StepTimeParts | None:
    """The uncalibrated step-time parts a prediction carries (``Estimate.time_parts``)."""
    stored = time_parts
    if stored is None or "overhead" not in stored:
        return None
    work = {k: float(v) for k, v in stored.items() if k not in ("overhead", "fixed")}
    return StepTimeParts(float(stored["overhead"]), work)


def step_seconds(parts: StepTimeParts, fixed: float, calibration: TimeCalibration) -> tuple[float, str | None]:
    """A step's seconds from its uncalibrated parts, refitted by the probes so far, plus
    ``fixed`` (communication, which probes do not measure); and the note saying it was
    calibrated (None without probes)."""
    points = len(calibration.points)
    seconds = parts.total_s + calibration.correction(parts) + fixed
    return seconds, calibrated_note(points) if points else None


def price(config: TrainConfig, p: Prepared, rates: DeviceRates, calibration: TimeCalibration,
          facts: ModelFacts, spec: GPUSpec | None) -> Price:
    """One optimizer step of ``config`` on the target of ``rates``, from ``p``'s op costs."""
    costs = costs_of(p)
    offload = None
    if config.cpu_offload and spec is not None:
        # The optimizer steps on the CPU: its ops leave the card's roofline for the host's.
        on_host = _phase_mask(p, costs, "step 2 optimizer")
        offload = cpu_offload_time(config, facts, spec, forward_s=_pass_time(p, "forward", rates),
                                   backward_s=_pass_time(p, "backward", rates),
                                   optimizer_bytes=int(costs.bytes_moved[on_host].sum()))
        costs = _subset(costs, ~on_host)
    tp_comm = None
    if config.tp > 1:
        # DTensor's collectives are in the trace: priced on the node's link, not the roofline.
        collective = np.asarray([n.startswith(COLLECTIVE_PREFIX) for n in costs.names], dtype=bool)
        runs = steady_state_weights(costs, p.phase_labels, config.grad_accum_steps)[collective]
        tp_comm = tensor_parallel_comm([n for n, c in zip(costs.names, collective) if c],
                                       list(costs.bytes_moved[collective]), list(runs), config.tp,
                                       ring_bandwidth(spec, 1))
        costs = _subset(costs, ~collective)
    parts = step_time_parts(costs, p.phase_labels, config.grad_accum_steps, rates, every_micro=config.pp > 1)
    comm = _comm_time(config, p, facts, spec, rates)
    if tp_comm is not None:
        comm = tp_comm if comm is None else CommTime(comm.total_s + tp_comm.total_s,
                                                     comm.exposed_s + tp_comm.exposed_s)
    piped = None
    if config.pp > 1:
        # A pipeline runs at its busiest stage's pace (``stage_scale``: its compute over this,
        # the fullest, stage's), and waits in its bubble.
        compute_s = parts.total_s * p.stage_scale
        piped = pipeline_time(compute_s, config, p.send_bytes, ring_bandwidth(spec, 1))
    # Added after calibration: probes run on one device and measure no communication (nor
    # host traffic, as they run without offload's copies on CPU).
    fixed = (comm.exposed_s if comm is not None else 0.0) + (offload.added_s if offload is not None else 0.0)
    if piped is not None:
        fixed += parts.total_s * (p.stage_scale - 1) + piped.exposed_s
    activations = activation_offload_time(p, config.grad_accum_steps, rates, spec)
    if activations is not None:  # offloaded activations: the host link's copies compute does not hide
        fixed += activations.exposed_s
    seconds, calibrated = step_seconds(parts, fixed, calibration)
    notes = [calibrated] if calibrated is not None else []
    if comm is not None:
        notes.append(f"communication {comm.total_s * 1e3:.2f} ms per step, "
                     f"{comm.exposed_s * 1e3:.2f} ms of it not hidden by compute")
    if piped is not None:
        notes.append(f"pipeline: {config.pp} stages, {config.pp_microbatches} micro-batches, "
                     f"{p.send_bytes / 1e6:.2f} MB sent each way per micro-batch and stage; bubble and transfers "
                     f"{piped.exposed_s * 1e3:.2f} ms of the step")
    if offload is not None:
        notes.append(offload.note())
    if activations is not None:
        notes.append(f"activation offload: {activations.bytes_per_micro / 1e6:.1f} MB each way per micro-batch at "
                     f"{activations.link_bytes_per_s / 1e9:.1f} GB/s, {activations.total_s * 1e3:.2f} ms per step, "
                     f"{activations.exposed_s * 1e3:.2f} ms of it not hidden by compute")
    return Price(seconds, {"overhead": parts.overhead_s, **parts.work_s, "fixed": fixed}, tuple(notes))


def _comm_time(config: TrainConfig, p: Prepared, facts: ModelFacts, spec: GPUSpec | None,
               rates: DeviceRates) -> CommTime | None:
    """Collectives of one optimizer step and the part backward and forward do not hide."""
    if config.strategy == "single" or config.world_size == 1:
        return None
    link = ring_bandwidth(spec, config.nodes)
    replicate_link = None
    if config.dp_replicate > 1:
        # HSDP's shard groups are neighbouring ranks: within a node unless a group is larger
        # than one; its replica groups take one rank of each, across nodes when there are several.
        per_node = config.world_size // config.nodes
        link = ring_bandwidth(spec, 2 if config.shard_size > per_node else 1)
        replicate_link = ring_bandwidth(spec, config.nodes)
    forward_s = _pass_time(p, "forward", rates)
    backward_s = _pass_time(p, "backward", rates)
    low = weight_dtype(config.precision) is not None
    if config.strategy == "ddp":
        return ddp_comm(facts.ddp_buckets_low if low else facts.ddp_buckets, backward_s, config, link)
    # FSDP2 gathers in the autocast dtype under mixed precision and reduces in fp32; under
    # a true low precision it gathers and reduces the low-precision weights as they are.
    param_bytes = 2 if config.precision != "fp32" else 4
    blocks = tuple(n // config.tp for n in facts.units.block_numels)  # a rank's unit: 1/tp of it
    return fsdp_comm(blocks, facts.units.root_numel, param_bytes, 2 if low else 4,
                     forward_s, backward_s, config, link, replicate_link)


def _pass_time(p: Prepared, kind: str, rates: DeviceRates) -> float:
    """Compute time of one steady-state micro-batch's forward or backward pass."""
    costs = costs_of(p)
    keep = np.asarray([p.phase_labels[int(ph)].endswith(kind) and not name.startswith(COLLECTIVE_PREFIX)
                       for ph, name in zip(costs.phase, costs.names)], dtype=bool)
    if not keep.any():
        return 0.0
    return step_time(_subset(costs, keep), p.phase_labels, 1, rates)


def _phase_mask(p: Prepared, costs: OpCosts, label: str) -> np.ndarray:
    return np.asarray([p.phase_labels[int(ph)] == label for ph in costs.phase], dtype=bool)


def _subset(costs: OpCosts, keep: np.ndarray) -> OpCosts:
    return OpCosts(costs.flops[keep], costs.bytes_moved[keep], [d for d, k in zip(costs.dtype, keep) if k],
                   costs.phase[keep], [n for n, k in zip(costs.names, keep) if k] if costs.names else costs.names)
