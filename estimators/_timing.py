"""Step time from a trace: a per-op roofline over the device's rates.

Each op that runs a kernel costs ``max(flops / compute rate of its dtype, bytes moved /
bandwidth) + a fixed per-op overhead`` (kernel launch and eager dispatch). FLOPs come from
``torch.utils.flop_counter``'s formulas (matmul, convolution, attention); elementwise ops count
only their bytes. Recomputation under checkpointing, the optimizer step and the GradScaler's
extra kernels are ops of the trace like any other, so they are priced too.

Rates: for a GPU, the spec table's dense TFLOP/s per dtype and memory bandwidth times
efficiency factors; for the CPU, rates measured once per machine by a short calibration (a few
matmuls, a large copy, a tiny op) and cached. A probe's measured step time refits a scale factor
per model and device (``TimeCalibration``), so predictions improve as probes accumulate.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ._gpus import GPUSpec

__all__ = ["DeviceRates", "gpu_rates", "cpu_rates", "OpCosts", "op_costs", "step_time", "TimeCalibration"]

# Fractions of datasheet peaks that eager PyTorch reaches on large kernels (cuBLAS GEMMs reach
# 60-80% of dense peak, elementwise kernels ~80% of bandwidth).
_GPU_COMPUTE_EFFICIENCY = 0.65
_GPU_BANDWIDTH_EFFICIENCY = 0.8
_GPU_OP_OVERHEAD_S = 8e-6  # launch + eager dispatch, per op


@dataclass(frozen=True, slots=True)
class DeviceRates:
    name: str
    flops_per_s: dict[str, float]
    """Achievable FLOP/s of compute-bound ops per input dtype (float32, bfloat16, float16)."""
    bandwidth_bytes_per_s: float
    op_overhead_s: float


def gpu_rates(spec: GPUSpec) -> DeviceRates:
    tf = spec.tflops
    # PyTorch runs fp32 matmuls in full fp32 by default (allow_tf32 is off), so fp32 uses the
    # CUDA-core rate.
    flops = {
        "float32": tf["fp32"] * 1e12 * _GPU_COMPUTE_EFFICIENCY,
        "bfloat16": (tf["bf16"] or tf["fp32"]) * 1e12 * _GPU_COMPUTE_EFFICIENCY,
        "float16": (tf["fp16"] or tf["fp32"]) * 1e12 * _GPU_COMPUTE_EFFICIENCY,
    }
    return DeviceRates(spec.name, flops, spec.bandwidth_bytes_per_s * _GPU_BANDWIDTH_EFFICIENCY, _GPU_OP_OVERHEAD_S)


def _cache_dir() -> Path:
    root = os.environ.get("MEMPLAN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "memplan")
    return Path(root)


def _machine_key() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    text = f"{cpu}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _best_time(fn, repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs: other work on the machine only ever slows a run down,
    so the minimum is the machine's rate (a median would cache a busy moment for good)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(min(times))


def cpu_rates(*, refresh: bool = False) -> DeviceRates:
    """This machine's CPU rates, measured once (~1 s) and cached per machine."""
    path = _cache_dir() / f"cpu-rates-v2-{_machine_key()}.json"
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            return DeviceRates(**data)
        except (ValueError, TypeError):
            pass
    n = 384
    flops = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        reps = 1 if dtype == torch.float16 else 4  # fp16 GEMMs are emulated (slow) on most CPUs
        t = _best_time(lambda: [a @ b for _ in range(reps)], repeats=3) / reps
        flops[name] = 2 * n**3 / t
    big = torch.empty(8 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(big)
    t = _best_time(lambda: dst.copy_(big))
    bandwidth = 2 * big.numel() * 4 / t
    x = torch.ones(8)
    overhead = _best_time(lambda: [x.add(1.0) for _ in range(200)]) / 200
    rates = DeviceRates("cpu", flops, bandwidth, overhead)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(rates)))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return rates


@dataclass(frozen=True)
class OpCosts:
    """The kernel-running ops of a trace as arrays (one entry per op)."""

    flops: np.ndarray
    bytes_moved: np.ndarray
    dtype: list[str]
    phase: np.ndarray
    names: list[str] = field(default_factory=list)


def op_costs(ops: Sequence, keep: Sequence[bool] | None = None) -> OpCosts:
    chosen = [op for op in ops if op.moves_data]
    return OpCosts(
        flops=np.asarray([op.flops for op in chosen], dtype=np.float64),
        bytes_moved=np.asarray([op.bytes_moved for op in chosen], dtype=np.float64),
        dtype=[op.dtype for op in chosen],
        phase=np.asarray([op.phase for op in chosen], dtype=np.int64),
        names=[op.name for op in chosen],
    )


def step_time(costs: OpCosts, phase_labels: Sequence[str], grad_accum_steps: int, rates: DeviceRates) -> float:
    """Seconds per optimizer step: one traced steady-state micro-batch (forward + backward)
    times the accumulation steps, plus the steady-state optimizer step and zero_grad."""
    rate = np.asarray([rates.flops_per_s.get(d, rates.flops_per_s["float32"]) for d in costs.dtype])
    per_op = np.maximum(costs.flops / rate, costs.bytes_moved / rates.bandwidth_bytes_per_s) + rates.op_overhead_s
    labels = list(phase_labels)
    # Steady state: the last traced micro-batch of step 2 and step 2's optimizer.
    micro_phases = [i for i, l in enumerate(labels) if l.startswith("step 2") and ("forward" in l or "backward" in l)]
    if any("micro" in labels[i] for i in micro_phases):
        last_micro = labels[micro_phases[-1]].split(" forward")[0].split(" backward")[0]
        micro_phases = [i for i in micro_phases if labels[i].startswith(last_micro + " ")]
    opt_phases = [i for i, l in enumerate(labels) if l in ("step 2 optimizer", "step 2 zero_grad")]
    micro = float(per_op[np.isin(costs.phase, micro_phases)].sum())
    opt = float(per_op[np.isin(costs.phase, opt_phases)].sum())
    return micro * grad_accum_steps + opt


@dataclass
class TimeCalibration:
    """Measured/predicted step-time ratios of probed configurations of one model and device.

    The factor applied to new predictions is the geometric mean of the ratios, so one slow or
    fast probe cannot dominate.
    """

    ratios: list[float] = field(default_factory=list)

    def add(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s > 0 and measured_s > 0 and math.isfinite(measured_s):
            self.ratios.append(measured_s / predicted_s)

    @property
    def factor(self) -> float:
        if not self.ratios:
            return 1.0
        return float(math.exp(sum(math.log(r) for r in self.ratios) / len(self.ratios)))
