"""Step time from a trace: a per-op roofline over the device's rates, refitted by probes.

Each op that runs a kernel costs ``max(flops / compute rate, bytes moved / bandwidth)`` of
work plus a fixed per-op overhead (eager dispatch, autograd bookkeeping, kernel launch). FLOPs
come from ``torch.utils.flop_counter``'s formulas (matmul, convolution, attention); elementwise
ops count only their bytes. Recomputation under checkpointing, the optimizer step and the
GradScaler's extra kernels are ops of the trace like any other, so they are priced too.

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

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from .._gpus import GPUSpec

__all__ = [
    "DeviceRates", "gpu_rates", "cpu_rates", "OP_CLASSES", "op_class", "OpCosts", "op_costs",
    "StepTimeParts", "step_time", "step_time_parts", "TimeCalibration",
]

# Fractions of datasheet peaks that eager PyTorch reaches on large kernels (cuBLAS GEMMs reach
# 60-80% of dense peak, elementwise kernels ~80% of bandwidth).
_GPU_COMPUTE_EFFICIENCY = 0.65
_GPU_BANDWIDTH_EFFICIENCY = 0.8
_GPU_OP_OVERHEAD_S = 8e-6  # launch + eager dispatch, per op

_CPU_RATES_VERSION = 3
"""Cache file version: bump when what ``cpu_rates`` measures changes, so old files are ignored."""


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
        def _fwd(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                 **kwargs: Any) -> int:
            return sdpa_flop_count(query_shape, key_shape, value_shape)
    if bwd is not None and bwd not in flop_registry:
        @register_flop_formula(bwd)
        def _bwd(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                 out_shape: Any = None, **kwargs: Any) -> int:
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


def _cache_dir() -> Path:
    root = os.environ.get("MEMPLAN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "memplan")
    return Path(root)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def _machine_key() -> str:
    text = f"{cpu_name()}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cpu_rates_path() -> Path:
    """The cache file of this machine's (and thread count's) CPU rates."""
    return _cache_dir() / f"cpu-rates-v{_CPU_RATES_VERSION}-{_machine_key()}.json"


def _clock() -> Callable[[], float]:
    """With one intra-op thread, the process's CPU time: on a shared machine the wall clock
    also counts other processes' time slices, the CPU time only what our ops cost. With more
    threads CPU time sums the threads (and their spin-waits), so the wall clock it is."""
    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def _best_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs: other work on the machine only ever slows a run down,
    so the minimum is the machine's rate (a median would cache a busy moment for good)."""
    clock = _clock()
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return float(min(times))


class _Tally(TorchDispatchMode):
    """Counts ops, FLOPs and bytes moved per op class, by the trace's own rules (an op counts
    when it returns a tensor that is not a view; bytes = inputs + outputs; FLOPs from
    ``flop_registry``), so that measured rates divide the same quantities the trace records."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}
        self.flops: dict[str, float] = {}
        self.bytes: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outs and not func.is_view:
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            packet = func._overloadpacket
            cls = op_class(str(packet))
            flops = 0
            if packet in flop_registry:
                try:
                    flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
                except Exception:  # noqa: BLE001 - counted as the trace counts: zero
                    flops = 0
            self.ops[cls] = self.ops.get(cls, 0) + 1
            self.flops[cls] = self.flops.get(cls, 0.0) + flops
            self.bytes[cls] = self.bytes.get(cls, 0.0) + sum(t.numel() * t.element_size() for t in ins + outs)
        return out

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())


def _tally(fn: Callable[[], Any]) -> _Tally:
    with _Tally() as tally:
        fn()
    return tally


def _overhead_step() -> Callable[[], None]:
    """One training step of a tiny model: every op's work is negligible, so its time per op is
    the fixed cost an op pays in a real step (Python, module calls, dispatch, autograd, the
    optimizer's per-parameter loop)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(2, 16), torch.tensor([0, 1])

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the optimizer state: later steps are the steady state
    return step


def _class_benchmarks(dtype: torch.dtype) -> dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]:
    """Per op class: (forward + backward, forward alone) at sizes like a small model's layers
    (the forward alone only for the compute-bound classes, whose backward kernels differ). Working sets
    of 0.5-4 MB: the caches matter on a CPU, a 100 MB copy would understate small tensors.
    GEMMs as a linear layer runs them (``x @ W.T`` forward; ``g @ W``, ``g.T @ x`` backward):
    a CPU's bf16 GEMM speed depends on the operands' layouts (2-5x), and the trace does not
    record layouts, so the rate is that of the mix models have."""
    g = torch.Generator().manual_seed(0)
    f = torch.nn.functional

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    def fwd_bwd(fwd: Callable[[], torch.Tensor], *leaves: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """(forward + backward, forward alone)."""
        grad = torch.ones_like(fwd())

        def run() -> None:
            # autograd.grad, not backward: no .grad accumulates, so every run is the same ops.
            torch.autograd.grad(fwd(), leaves, grad)
        return run, fwd  # the forward with grad enabled, as in training (no_grad may pick other kernels)

    x_mm, w_mm, b_mm = leaf(256, 256), leaf(256, 256), leaf(256)
    x_conv, w_conv = leaf(4, 32, 16, 16), leaf(32, 32, 3, 3)
    q, k, v = leaf(4, 4, 64, 32), leaf(4, 4, 64, 32), leaf(4, 4, 64, 32)
    x_norm, w_norm, b_norm = leaf(256, 512), leaf(512), leaf(512)
    x_bn, w_bn, b_bn = leaf(16, 32, 16, 16), leaf(32), leaf(32)
    x_act = leaf(256, 1024)
    a_el, b_el = leaf(256, 1024), leaf(256, 1024)
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    x_cast = torch.randn(256, 1024, generator=g).to(dtype)
    return {
        "matmul": fwd_bwd(lambda: f.linear(x_mm, w_mm, b_mm), x_mm, w_mm, b_mm),
        "conv": fwd_bwd(lambda: f.conv2d(x_conv, w_conv, padding=1), x_conv, w_conv),
        "attention": fwd_bwd(lambda: f.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v),
        "norm": fwd_bwd(lambda: f.layer_norm(x_norm, (512,), w_norm, b_norm)
                        + f.batch_norm(x_bn, None, None, w_bn, b_bn, training=True).view(256, 512),
                        x_norm, w_norm, b_norm, x_bn, w_bn, b_bn),
        "activation": fwd_bwd(lambda: f.gelu(x_act), x_act),
        "cast": (lambda: x_cast.to(other), None),
        "elementwise": fwd_bwd(lambda: a_el * b_el + a_el, a_el, b_el),
    }


def _measure_cpu_rates() -> DeviceRates:
    step = _overhead_step()
    n_ops = _tally(step).total_ops
    overhead = _best_time(step, repeats=10) / max(n_ops, 1)
    def work_s(fn: Callable[[], Any], repeats: int) -> tuple[float, _Tally]:
        tally = _tally(fn)
        seconds = _best_time(fn, repeats=repeats)
        # What is left after the ops' fixed costs is the work (at these sizes, mostly).
        return max(seconds - tally.total_ops * overhead, 0.25 * seconds), tally

    class_rates: dict[str, float] = {}
    for dname, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        for cls, (both, forward) in _class_benchmarks(dtype).items():
            # Slow kernels (bf16 GEMMs and convolutions: ~0.05 s a run) need fewer repeats.
            repeats = 2 if (cls in _COMPUTE_CLASSES and dtype != torch.float32) else 3
            seconds, tally = work_s(both, repeats)
            if cls not in _COMPUTE_CLASSES or forward is None:
                class_rates[f"{cls}:{dname}"] = sum(tally.bytes.values()) / seconds
                continue
            fwd_s, fwd_tally = work_s(forward, repeats)
            fwd_flops = fwd_tally.flops.get(cls, 0.0)
            bwd_flops = tally.flops.get(cls, 0.0) - fwd_flops
            # The backward is the difference; the floor only guards against a noisy forward
            # that took longer than forward + backward.
            bwd_s = max(seconds - fwd_s, 0.1 * seconds)
            class_rates[f"{cls}:{dname}"] = fwd_flops / fwd_s
            class_rates[f"{cls}_backward:{dname}"] = bwd_flops / bwd_s
    # fp16 GEMMs are emulated (slow) on most CPUs; CPU probes and tests avoid fp16 (see
    # FACTS.md), so one small matmul is enough to rank it.
    a16 = torch.randn(128, 128).half()
    t16 = _best_time(lambda: a16 @ a16, repeats=2)
    flops = {
        "float32": class_rates["matmul:float32"],
        "bfloat16": class_rates["matmul:bfloat16"],
        "float16": 2 * 128**3 / t16,
    }
    return DeviceRates("cpu", flops, class_rates["elementwise:float32"], overhead, class_rates)


def cpu_rates(*, refresh: bool = False) -> DeviceRates:
    """This machine's CPU rates at the current thread count, measured once (a few seconds)
    and cached in ``cpu_rates_path()``.

    Example:
        >>> rates = cpu_rates()                                    # doctest: +SKIP
        >>> rates.compute_rate("matmul", "float32") > rates.compute_rate("matmul", "bfloat16")  # doctest: +SKIP
        True
    """
    path = cpu_rates_path()
    if not refresh and path.is_file():
        try:
            return DeviceRates(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass
    rates = _measure_cpu_rates()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(rates)))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return rates


# -- pricing a trace ---------------------------------------------------------------------------

@dataclass(frozen=True)
class OpCosts:
    """The kernel-running ops of a trace as arrays (one entry per op)."""

    flops: np.ndarray
    bytes_moved: np.ndarray
    dtype: list[str]
    phase: np.ndarray
    names: list[str] = field(default_factory=list)


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


def _steady_state_weights(costs: OpCosts, phase_labels: Sequence[str], grad_accum_steps: int) -> np.ndarray:
    """How many times each traced op runs in one steady-state optimizer step.

    Step 2's ops are the steady state (step 1 creates the optimizer state). With
    accumulation the trace holds two micro-batches per step: the first creates the
    gradients, the second accumulates into them (one more add per parameter); a window of
    A micro-batches runs the first once and the accumulating one A - 1 times. The optimizer
    step and zero_grad run once."""
    labels = list(phase_labels)
    micro_phases = [i for i, l in enumerate(labels) if l.startswith("step 2") and ("forward" in l or "backward" in l)]
    weights = np.zeros(len(labels), dtype=np.float64)
    if any("micro" in labels[i] for i in micro_phases):
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
    for i, l in enumerate(labels):
        if l in ("step 2 optimizer", "step 2 zero_grad"):
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
                    rates: DeviceRates) -> StepTimeParts:
    """Seconds per optimizer step, in parts: the steady state's micro-batches (forward +
    backward) as many times as the window runs them, plus the optimizer step and zero_grad."""
    weight = _steady_state_weights(costs, phase_labels, grad_accum_steps)
    work = _work_per_op(costs, phase_labels, rates) * weight
    by_dtype: dict[str, float] = {}
    for dtype in set(costs.dtype):
        mask = np.asarray([d == dtype for d in costs.dtype])
        key = "float32" if dtype == "none" else dtype
        by_dtype[key] = by_dtype.get(key, 0.0) + float(work[mask].sum())
    return StepTimeParts(float(weight.sum()) * rates.op_overhead_s, by_dtype)


def step_time(costs: OpCosts, phase_labels: Sequence[str], grad_accum_steps: int, rates: DeviceRates) -> float:
    """Seconds per optimizer step (uncalibrated); see :func:`step_time_parts`."""
    return step_time_parts(costs, phase_labels, grad_accum_steps, rates).total_s


# -- calibration -------------------------------------------------------------------------------

_MIN_SHARE = 0.02
"""A part below this share of every probe's predicted time is not refitted: the probes
cannot see it."""

_RIDGE = 1e-4
"""Pull of each coefficient towards 1 (the measured rates), relative to the probes' own
weight: decides only what the probes leave undetermined (one probe, two parts; two probes
with nearly the same mix of parts), where it spreads the correction in proportion to each
part's share instead of letting noise pick an extreme split."""


@dataclass
class TimeCalibration:
    """Probe measurements of one task on one device and the step-time model they refit.

    Calibrated step time = ``a * overhead + sum over dtypes d of b_d * work_d``
    (:class:`StepTimeParts`), the coefficients minimising the probes' squared *relative* errors
    (a 0.05 s and a 5 s probe count alike), all ``>= 0``:

    * the per-op overhead is the same at every batch size and the work grows with it, so
      probes at a small and a large batch tell ``a`` and ``b`` apart; one probe (or probes
      with the same mix) moves each part in proportion to its share, the smallest change
      that explains the measurement (a ridge towards 1);
    * work is refitted per dtype, and a dtype no probe ran keeps ``b = 1`` (its measured
      rates): kernels of different dtypes are different code (on an AVX2 CPU, fp32 GEMMs run
      in oneDNN, bf16 ones in a fallback 20-40x slower), and a correction learnt on fp32
      steps made bf16 predictions 25-60% worse in benchmarks/time_accuracy.py.

    Example:
        >>> cal = TimeCalibration()
        >>> cal.add(StepTimeParts(0.01, {"float32": 0.01}), 0.03)   # a=1, b=2 ...
        >>> cal.add(StepTimeParts(0.01, {"float32": 0.10}), 0.21)   # ... fit both
        >>> {k: round(v, 2) for k, v in cal.coefficients().items()}
        {'overhead': 1.0, 'float32': 2.0}
    """

    points: list[tuple[StepTimeParts, float]] = field(default_factory=list)
    """(uncalibrated parts, measured seconds) of each probe."""

    def add(self, parts: StepTimeParts, measured_s: float) -> None:
        if parts.total_s > 0 and measured_s > 0 and math.isfinite(measured_s):
            self.points.append((parts, float(measured_s)))

    def __len__(self) -> int:
        return len(self.points)

    def coefficients(self) -> dict[str, float]:
        """``{"overhead": a, dtype: b_dtype, ...}`` for the parts the probes saw; any other
        part's coefficient is 1."""
        if not self.points:
            return {}
        rows = [{"overhead": p.overhead_s, **p.work_s} for p, _ in self.points]
        measured = np.asarray([m for _, m in self.points])
        names = sorted({k for r in rows for k, v in r.items()
                        if v > 0 and any(r2.get(k, 0.0) >= _MIN_SHARE * sum(r2.values()) for r2 in rows)})
        names = [n for n in ("overhead",) if n in names] + [n for n in names if n != "overhead"]
        # Relative errors: each row divided by its measurement, fitted to 1. Parts not
        # refitted keep coefficient 1: their time moves to the right-hand side.
        full = np.asarray([[r.get(k, 0.0) for k in names] for r in rows]) / measured[:, None]
        rest = np.asarray([sum(v for k, v in r.items() if k not in names) for r in rows]) / measured
        target = 1.0 - rest
        coef = dict.fromkeys(names, 1.0)
        free = list(names)
        while free:
            cols = [names.index(n) for n in free]
            fixed = [names.index(n) for n in names if n not in free]
            x = full[:, cols]
            y = target - (full[:, fixed] @ np.asarray([coef[names[j]] for j in fixed]) if fixed else 0.0)
            # Ridge towards 1: solve for the change d in (x^T x + lam I) d = x^T (y - x 1).
            lam = _RIDGE * float(np.trace(x.T @ x)) / len(cols)
            d = np.linalg.solve(x.T @ x + lam * np.eye(len(cols)), x.T @ (y - x.sum(axis=1)))
            values = 1.0 + d
            if (values >= 0).all():
                coef.update(zip(free, map(float, values)))
                break
            # The most negative one is pinned at its bound 0 and the others refitted.
            worst = free[int(np.argmin(values))]
            coef[worst] = 0.0
            free.remove(worst)
        return coef

    def apply(self, parts: StepTimeParts) -> float:
        coef = self.coefficients()
        return coef.get("overhead", 1.0) * parts.overhead_s + sum(
            coef.get(k, 1.0) * v for k, v in parts.work_s.items())

    def correction(self, parts: StepTimeParts) -> float:
        """Calibrated minus uncalibrated seconds (0 without probes): added to the model's
        step time, so that other terms of it (communication) are left as they are."""
        return self.apply(parts) - parts.total_s if self.points else 0.0
