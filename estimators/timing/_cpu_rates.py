"""This machine's CPU rates, measured once per machine and thread count and cached.

Per op class and dtype (``_timing.OP_CLASSES``), forward and backward apart for the
compute-bound classes, and the per-op overhead from a tiny training step whose time is all
overhead (see ``_timing``'s docstring for why). With one torch thread the rates are timed in
process CPU time, so a busy machine's time slices do not end up in the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ._timing import _COMPUTE_CLASSES, DeviceRates, op_class

__all__ = ["cpu_name", "cpu_rates", "cpu_rates_path"]

_CPU_RATES_VERSION = 3
"""Cache file version: bump when what ``cpu_rates`` measures changes, so old files are ignored."""


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


def _kernel_set() -> str:
    """Which kernels torch and oneDNN pick here: torch's vector ISA and oneDNN's ceiling, which
    ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA`` lower (bf16 GEMMs run 15-35x slower on
    AVX2 kernels than on native-bf16 ones: the same CPU's rates under another ceiling differ)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "native"
    return f"{torch.backends.cpu.get_cpu_capability()}|{isa.upper()}"


def _machine_key() -> str:
    text = f"{cpu_name()}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}|{_kernel_set()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cpu_rates_path() -> Path:
    """The cache file of this machine's (and thread count's) CPU rates."""
    return _cache_dir() / f"cpu-rates-v{_CPU_RATES_VERSION}-{_machine_key()}.json"


def _clock() -> Callable[[], float]:
    """With one intra-op thread, the process's CPU time: on a shared machine the wall clock
    also counts other processes' time slices, the CPU time only what our ops cost. With more
    threads CPU time sums the threads (and their spin-waits), so the wall clock it is."""
    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def _best_time(fn: Callable[[], object], repeats: int = 5) -> float:
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

    def __torch_dispatch__(self, func: OpOverload, types: Sequence[type], args: Sequence[object] = (),
                           kwargs: Mapping[str, object] | None = None) -> object:
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


def _tally(fn: Callable[[], object]) -> _Tally:
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


def _class_benchmarks(dtype: torch.dtype) -> dict[str, tuple[Callable[[], object], Callable[[], object] | None]]:
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

    def fwd_bwd(fwd: Callable[[], torch.Tensor], *leaves: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object]]:
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
    def work_s(fn: Callable[[], object], repeats: int) -> tuple[float, _Tally]:
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
