"""Step time from a trace: a per-op roofline over the device's rates, refitted by probes.

Each op that runs a kernel costs ``max(flops / compute rate, bytes moved / bandwidth)`` of
work plus a fixed per-op overhead (eager dispatch, autograd bookkeeping, kernel launch). FLOPs
come from ``torch.utils.flop_counter``'s formulas (matmul, convolution, attention); elementwise
ops count only their bytes. Recomputation under checkpointing, the optimizer step and the
GradScaler's extra kernels are ops of the trace like any other, so they are priced too.

The CPU's rates are measured in ``_cpu_rates``, the probes' refit is ``_calibration``.

Rates. For a GPU: the spec table's dense TFLOP/s per dtype and memory bandwidth times
efficiency factors. For the CPU: measured once per machine and thread count (3-9 s at one
thread on a shared 2-core machine) and cached in ``~/.cache/memplan``, per op class and dtype
(:data:`OP_CLASSES`): a CPU's speed differs far more between classes than inside one. On an
AVX2 core without native bf16 instructions, bf16 GEMMs run 15-35x slower than fp32 ones, while
a bf16 add is about as fast as an fp32 one; one FLOP/s figure and one bandwidth cannot price
both. Compute-bound classes have a forward and a backward rate (ops in a "backward" phase),
since the backward runs other kernels: on that core a bf16 convolution's backward is ~6x faster
than its forward, a bf16 GEMM's backward ~3x slower. The per-op overhead is measured on a tiny
training step (forward, backward, optimizer), whose time is all overhead. With one torch thread
the rates are timed in process CPU time, so a busy machine's time slices do not end up in the
cache (its cache and memory contention still do).

Calibration (:class:`TimeCalibration`). A probe's measured step time refits the model per
task and device: ``a * overhead + sum of b_d * work_d`` over the ops' dtypes d, non-negative
coefficients, because the parts scale differently: the overhead is the same at every batch
size (it dominates small batches), the work grows with the batch, and each dtype's kernels are
their own code. A dtype no probe ran keeps its measured rates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from ..hardware._gpus import GPUSpec
from ..memory._prepare import Prepared

__all__ = [
    "steady_state_weights",
    "DeviceRates", "gpu_rates", "OP_CLASSES", "op_class", "OpCosts", "op_costs",
    "StepTimeParts", "step_time", "step_time_parts",
]

# Fractions of datasheet peaks that eager PyTorch reaches on large kernels (cuBLAS GEMMs reach
# 60-80% of dense peak, elementwise kernels ~80% of bandwidth).
_GPU_COMPUTE_EFFICIENCY = 0.65
_GPU_BANDWIDTH_EFFICIENCY = 0.8
_GPU_OP_OVERHEAD_S = 8e-6  # launch + eager dispatch, per op

# -- op classes --------------------------------------------------------------------------------

OP_CLASSES = ("matmul", "conv", "attention", "norm", "activation", "cast", "elementwise")
"""Op classes priced with rates of their own. matmul, conv and attention are compute-bound
(FLOP/s); the others memory-bound (bytes/s): normalisations, softmax and losses (reductions);
activations with transcendental functions (gelu, silu, tanh, ...); dtype casts (autocast's
fp32 <-> bf16 copies); every other elementwise, copy, pooling and optimizer op."""

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "_addmm_activation", "linear", "dot", "mv",
           "addmv", "_scaled_mm", "_int_mm"}
_ACTIVATION = {"gelu", "silu", "sigmoid", "tanh", "exp", "log", "erf", "softplus", "mish", "elu", "selu",
               "log_sigmoid_forward", "pow", "rsqrt", "sin", "cos", "logit", "hardswish", "glu"}
_NORM = ("norm", "softmax", "nll_loss", "cross_entropy", "var_mean", "std_mean")


def op_class(name: str) -> str:
    """The class of an aten op by its overload packet's name (``"aten.mm"`` → ``"matmul"``)."""
    base = name.rsplit(".", 1)[-1] if name.startswith("aten.") else name
    stem = base.removesuffix("_").removesuffix("_backward").removesuffix("_forward")
    if base in _MATMUL or stem in _MATMUL:
        return "matmul"
    if "convolution" in base or base.startswith(("_slow_conv", "conv", "mkldnn_conv", "thnn_conv", "slow_conv")):
        return "conv"
    if "attention" in base:
        return "attention"
    if any(k in base for k in _NORM):
        return "norm"
    if stem in _ACTIVATION or base.removesuffix("_backward") in _ACTIVATION:
        return "activation"
    if base in ("_to_copy", "to", "_autocast_to_reduced_precision", "_autocast_to_full_precision"):
        return "cast"
    return "elementwise"


# The CPU's fused attention kernel has no FLOP formula in torch.utils.flop_counter (only the
# CUDA ones do), so traces would price CPU attention by its bytes alone, blind to the T^2 work.
# Same count as the CUDA variants (causal masking ignored, as there).
def _register_cpu_attention_flops() -> None:
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in flop_registry:
        @register_flop_formula(fwd)
        def _fwd(query_shape: torch.Size, key_shape: torch.Size, value_shape: torch.Size, *args: object,
                 out_shape: object = None, **kwargs: object) -> int:
            return sdpa_flop_count(query_shape, key_shape, value_shape)
    if bwd is not None and bwd not in flop_registry:
        @register_flop_formula(bwd)
        def _bwd(grad_out_shape: torch.Size, query_shape: torch.Size, key_shape: torch.Size,
                 value_shape: torch.Size, *args: object, out_shape: object = None, **kwargs: object) -> int:
            return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_register_cpu_attention_flops()


# -- rates -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DeviceRates:
    name: str
    flops_per_s: dict[str, float]
    """Achievable FLOP/s of compute-bound ops per input dtype (float32, bfloat16, float16)."""
    bandwidth_bytes_per_s: float
    op_overhead_s: float
    """Fixed cost of one op: dispatch, autograd bookkeeping, kernel launch."""
    class_rates: dict[str, float] = field(default_factory=dict)
    """Per ``"class:dtype"`` (``"matmul:bfloat16"``, ``"norm:float32"``): FLOP/s for the
    compute-bound classes, bytes/s for the others. Missing entries fall back to
    ``flops_per_s``/``bandwidth_bytes_per_s`` (GPUs have none: their spec table has no
    per-class figures)."""

    def compute_rate(self, cls: str, dtype: str, *, backward: bool = False) -> float:
        """FLOP/s of ``cls`` ops in ``dtype``; ``backward``: of the backward pass's ops, which
        run other kernels (on an AVX2 CPU a bf16 convolution's backward runs 2x faster than its
        forward, a bf16 GEMM's 3x slower)."""
        rate = None
        if cls in _COMPUTE_CLASSES:
            if backward:
                rate = self.class_rates.get(f"{cls}_backward:{dtype}")
            rate = rate or self.class_rates.get(f"{cls}:{dtype}")
        return rate or self.flops_per_s.get(dtype) or self.flops_per_s["float32"]

    def bandwidth(self, cls: str, dtype: str) -> float:
        if cls in _COMPUTE_CLASSES:
            return self.bandwidth_bytes_per_s
        rate = self.class_rates.get(f"{cls}:{dtype}") or self.class_rates.get(f"{cls}:float32")
        return rate or self.bandwidth_bytes_per_s


_COMPUTE_CLASSES = ("matmul", "conv", "attention")


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


# -- pricing a trace ---------------------------------------------------------------------------

@dataclass(frozen=True)
class OpCosts:
    """The kernel-running ops of a trace as arrays (one entry per op)."""

    flops: np.ndarray
    bytes_moved: np.ndarray
    dtype: list[str]
    phase: np.ndarray
    names: list[str] = field(default_factory=list)


def costs_of(prepared: Prepared) -> OpCosts:
    """The op costs of a prepared trace, computed once and kept on it."""
    if prepared.costs is None:
        prepared.costs = op_costs(prepared.ops)
    costs: OpCosts = prepared.costs
    return costs


def op_costs(ops: Sequence) -> OpCosts:
    chosen = [op for op in ops if op.moves_data]
    return OpCosts(
        flops=np.asarray([op.flops for op in chosen], dtype=np.float64),
        bytes_moved=np.asarray([op.bytes_moved for op in chosen], dtype=np.float64),
        dtype=[op.dtype for op in chosen],
        phase=np.asarray([op.phase for op in chosen], dtype=np.int64),
        names=[op.name for op in chosen],
    )


@dataclass(frozen=True)
class StepTimeParts:
    """A predicted step time in the parts that probes refit separately."""

    overhead_s: float
    """Number of ops times the per-op fixed cost: the same at every batch size."""
    work_s: dict[str, float]
    """The ops' roofline time (FLOPs and bytes over the rates) per op dtype ("float32",
    "bfloat16", ...; ops without a floating input count as float32): grows with the batch."""

    @property
    def total_s(self) -> float:
        return self.overhead_s + sum(self.work_s.values())


def _steady_state_weights(costs: OpCosts, phase_labels: Sequence[str], grad_accum_steps: int, *,
                          every_micro: bool = False) -> np.ndarray:
    """How many times each traced op runs in one steady-state optimizer step.

    Step 2's ops are the steady state (step 1 creates the optimizer state). With
    accumulation the trace holds two micro-batches per step: the first creates the
    gradients, the second accumulates into them (one more add per parameter); a window of
    A micro-batches runs the first once and the accumulating one A - 1 times. The optimizer
    step and zero_grad run once. ``every_micro``: the trace holds every micro-batch of the
    step (a pipeline's), each run once."""
    labels = list(phase_labels)
    micro_phases = [
        i for i, lab in enumerate(labels) if lab.startswith("step 2") and ("forward" in lab or "backward" in lab)
    ]
    weights = np.zeros(len(labels), dtype=np.float64)
    if every_micro:
        weights[micro_phases] = 1.0
    elif any("micro" in labels[i] for i in micro_phases):
        def micro_of(i: int) -> str:
            return labels[i].split(" forward")[0].split(" backward")[0]
        first, last = micro_of(micro_phases[0]), micro_of(micro_phases[-1])
        for i in micro_phases:
            if micro_of(i) == first:
                weights[i] = 1.0
            elif micro_of(i) == last:
                weights[i] = float(max(grad_accum_steps - 1, 0))
    else:
        # One micro-batch traced per step: every micro-batch of the window runs like it.
        weights[micro_phases] = float(grad_accum_steps)
    for i, lab in enumerate(labels):
        if lab in ("step 2 optimizer", "step 2 zero_grad"):
            weights[i] = 1.0
    return weights[costs.phase] if len(costs.phase) else np.zeros(0)


def _work_per_op(costs: OpCosts, phase_labels: Sequence[str], rates: DeviceRates) -> np.ndarray:
    backward_phase = ["backward" in label for label in phase_labels]
    names = costs.names or ["elementwise"] * len(costs.dtype)
    keys = [(op_class(n), d, backward_phase[p]) for n, d, p in zip(names, costs.dtype, costs.phase)]
    if not keys:
        return np.zeros(0)
    lookup = {k: (rates.compute_rate(k[0], k[1], backward=k[2]), rates.bandwidth(k[0], k[1])) for k in set(keys)}
    compute = np.asarray([lookup[k][0] for k in keys], dtype=np.float64)
    bandwidth = np.asarray([lookup[k][1] for k in keys], dtype=np.float64)
    return np.maximum(costs.flops / compute, costs.bytes_moved / bandwidth)


def step_time_parts(costs: OpCosts, phase_labels: Sequence[str], grad_accum_steps: int,
                    rates: DeviceRates, *, every_micro: bool = False) -> StepTimeParts:
    """Seconds per optimizer step, in parts: the steady state's micro-batches (forward +
    backward) as many times as the window runs them, plus the optimizer step and zero_grad
    (``every_micro``: see :func:`steady_state_weights`)."""
    weight = _steady_state_weights(costs, phase_labels, grad_accum_steps, every_micro=every_micro)
    work = _work_per_op(costs, phase_labels, rates) * weight
    by_dtype: dict[str, float] = {}
    for dtype in set(costs.dtype):
        mask = np.asarray([d == dtype for d in costs.dtype])
        key = "float32" if dtype == "none" else dtype
        by_dtype[key] = by_dtype.get(key, 0.0) + float(work[mask].sum())
    return StepTimeParts(float(weight.sum()) * rates.op_overhead_s, by_dtype)


def steady_state_weights(costs: OpCosts, phase_labels: Sequence[str], grad_accum_steps: int) -> np.ndarray:
    """How many times each traced op runs in one steady-state optimizer step."""
    return _steady_state_weights(costs, phase_labels, grad_accum_steps)


def step_time(costs: OpCosts, phase_labels: Sequence[str], grad_accum_steps: int, rates: DeviceRates) -> float:
    """Seconds per optimizer step (uncalibrated); see :func:`step_time_parts`."""
    return step_time_parts(costs, phase_labels, grad_accum_steps, rates).total_s
