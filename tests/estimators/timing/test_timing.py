"""The step-time model: per-class roofline pricing of traced ops and probe calibration.

No assertion here depends on how fast this machine is: timing claims live in
benchmarks/time_accuracy.py. Rates are fixed by hand wherever a test checks arithmetic.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.models import TinyLM, lm_task

from estimators import Estimator, Task, TrainConfig
from estimators.timing import _cpu_rates
from estimators.timing._calibration import TimeCalibration
from estimators.timing._cpu_rates import cpu_rates, cpu_rates_path
from estimators.timing._timing import (
    OP_CLASSES,
    DeviceRates,
    OpCosts,
    StepTimeParts,
    costs_of,
    op_class,
    step_time_parts,
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))


def fixed_rates(**class_rates: float) -> DeviceRates:
    return DeviceRates("test", {"float32": 1e10, "bfloat16": 1e9, "float16": 1e9}, 1e9, 1e-5,
                       {k.replace("__", ":"): v for k, v in class_rates.items()})


def test_more_work_costs_more_time():
    est = Estimator(lm_task(), gpu="A100-80GB")
    small = est.estimate(TrainConfig(micro_batch_size=4))
    big = est.estimate(TrainConfig(micro_batch_size=64))
    accum2 = est.estimate(TrainConfig(micro_batch_size=4, grad_accum_steps=2))
    accum = est.estimate(TrainConfig(micro_batch_size=4, grad_accum_steps=4))
    ckpt = est.estimate(TrainConfig(micro_batch_size=64, checkpoint_segments=4))
    assert big.step_time_s > small.step_time_s
    # Accumulation repeats forward+backward (the later micro-batches also add into the
    # gradients), not the optimizer step: each micro-batch after the first costs the same.
    assert 2 * small.step_time_s < accum.step_time_s
    one_more = accum2.step_time_s - small.step_time_s
    assert one_more > 0.5 * small.step_time_s  # forward + backward: most of a small step
    assert accum.step_time_s - accum2.step_time_s == pytest.approx(2 * one_more, rel=1e-9)
    assert ckpt.step_time_s > big.step_time_s  # recomputation is priced
    assert big.samples_per_s == pytest.approx(64 / big.step_time_s)


def test_bf16_is_faster_than_fp32_on_a_tensor_core_gpu():
    # Wide layers: GEMM-bound, where tensor cores matter (tiny layers are launch-bound and
    # autocast's extra casts make bf16 slower there, on a real GPU too).
    task = Task(name="wide", build_model=lambda: TinyLM(vocab=512, d=512, layers=2),
                sample_fn=lm_task().sample_fn)
    est = Estimator(task, gpu="A100-80GB")
    fp32 = est.estimate(TrainConfig(micro_batch_size=64))
    bf16 = est.estimate(TrainConfig(micro_batch_size=64, precision="bf16-mixed"))
    assert bf16.step_time_s < 0.75 * fp32.step_time_s


# -- op classes and per-class rates -------------------------------------------------------------

@pytest.mark.parametrize("name, cls", [
    ("aten.mm", "matmul"), ("aten.addmm", "matmul"), ("aten.bmm", "matmul"),
    ("aten.convolution", "conv"), ("aten.convolution_backward", "conv"),
    ("aten._scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten._scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten.native_layer_norm", "norm"), ("aten.native_batch_norm_backward", "norm"),
    ("aten._log_softmax", "norm"), ("aten.nll_loss_forward", "norm"),
    ("aten.gelu", "activation"), ("aten.gelu_backward", "activation"), ("aten.tanh_backward", "activation"),
    ("aten._to_copy", "cast"),
    ("aten.add_", "elementwise"), ("aten.addcdiv_", "elementwise"), ("aten.max_pool2d_with_indices", "elementwise"),
    ("aten.embedding", "elementwise"), ("aten.threshold_backward", "elementwise"),
])
def test_op_classes(name, cls):
    assert op_class(name) == cls
    assert cls in OP_CLASSES


def test_each_op_is_priced_at_its_class_and_dtype_rate():
    rates = fixed_rates(matmul__bfloat16=2e9, matmul__float32=4e10, activation__bfloat16=1e8,
                        elementwise__float32=5e9)
    # Phase 0 is step 2's forward: every op counts once.
    costs = OpCosts(
        flops=np.array([4e9, 4e9, 0.0, 0.0]), bytes_moved=np.array([1e6, 1e6, 2e8, 1e9]),
        dtype=["bfloat16", "float32", "bfloat16", "float32"], phase=np.zeros(4, dtype=np.int64),
        names=["aten.mm", "aten.mm", "aten.gelu", "aten.add"],
    )
    parts = step_time_parts(costs, ["step 2 forward"], 1, rates)
    assert parts.overhead_s == pytest.approx(4 * 1e-5)
    # bf16 GEMM at its own (slow) rate, fp32 GEMM at its own, the gelu at the activation
    # class's bf16 bandwidth, the add at the elementwise fp32 bandwidth; work kept per dtype.
    assert parts.work_s["bfloat16"] == pytest.approx(4e9 / 2e9 + 2e8 / 1e8)
    assert parts.work_s["float32"] == pytest.approx(4e9 / 4e10 + 1e9 / 5e9)
    assert parts.total_s == pytest.approx(4e-5 + 4e9 / 2e9 + 2e8 / 1e8 + 4e9 / 4e10 + 1e9 / 5e9)


def test_backward_ops_are_priced_at_the_backward_rate():
    rates = fixed_rates(conv__bfloat16=1e9, conv_backward__bfloat16=8e9, norm__bfloat16=1e9)
    costs = OpCosts(
        flops=np.array([8e9, 8e9, 0.0, 0.0]), bytes_moved=np.array([1e3, 1e3, 1e9, 1e9]),
        dtype=["bfloat16"] * 4, phase=np.array([0, 1, 0, 1]),
        names=["aten.convolution", "aten.convolution_backward", "aten.native_batch_norm",
               "aten.native_batch_norm_backward"],
    )
    parts = step_time_parts(costs, ["step 2 forward", "step 2 backward"], 1, rates)
    # Memory-bound classes have one rate for both passes.
    assert parts.work_s["bfloat16"] == pytest.approx(8e9 / 1e9 + 8e9 / 8e9 + 1.0 + 1.0)
    assert rates.compute_rate("matmul", "bfloat16", backward=True) == 1e9  # no class rate: the dtype's


def test_missing_class_rates_fall_back_to_the_device_wide_ones():
    rates = fixed_rates()  # a GPU's rates: no per-class figures
    assert rates.compute_rate("conv", "bfloat16") == 1e9
    assert rates.compute_rate("attention", "float64") == 1e10
    assert rates.bandwidth("norm", "bfloat16") == 1e9
    with_fp32 = fixed_rates(norm__float32=3e9)
    assert with_fp32.bandwidth("norm", "bfloat16") == 3e9  # the class's fp32 figure first


def test_cpu_attention_has_a_flop_count():
    # torch's flop counter knows only the CUDA attention kernels; without this the CPU's
    # attention would be priced by its bytes alone.
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    tally = _cpu_rates._tally(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward())
    assert tally.flops.get("attention", 0) >= 3 * 4 * 2 * 4 * 16 * 16 * 8  # fwd + bwd, >= 2 matmuls each


# -- CPU rates ------------------------------------------------------------------------------------

def test_cpu_rates_are_cached_per_version(tmp_path, monkeypatch):
    calls = []

    def fake_measure() -> DeviceRates:
        calls.append(1)
        return fixed_rates(matmul__float32=4e10, matmul__bfloat16=2e9)

    monkeypatch.setattr(_cpu_rates, "_measure_cpu_rates", fake_measure)
    first = cpu_rates()
    assert cpu_rates() == first and len(calls) == 1  # read back, not re-measured
    assert f"-v{_cpu_rates._CPU_RATES_VERSION}-" in cpu_rates_path().name
    assert json.loads(cpu_rates_path().read_text())["class_rates"]["matmul:bfloat16"] == 2e9
    cpu_rates(refresh=True)
    assert len(calls) == 2


def test_cpu_rates_measure_every_class_and_dtype():
    rates = cpu_rates()
    for cls in OP_CLASSES:
        for dtype in ("float32", "bfloat16"):
            assert rates.class_rates[f"{cls}:{dtype}"] > 0, (cls, dtype)
            if cls in ("matmul", "conv", "attention"):
                assert rates.class_rates[f"{cls}_backward:{dtype}"] > 0, (cls, dtype)
    assert 0 < rates.op_overhead_s < 1e-2
    assert rates.flops_per_s["float32"] == rates.class_rates["matmul:float32"]
    assert cpu_rates() == rates


# -- calibration ----------------------------------------------------------------------------------

def parts(overhead: float, **work: float) -> StepTimeParts:
    return StepTimeParts(overhead, work)


def test_calibration_recovers_known_coefficients():
    cal = TimeCalibration()
    truth = {"overhead": 1.7, "float32": 0.6}
    for o, w in ((0.05, 0.01), (0.05, 0.4), (0.06, 1.5)):
        cal.add(parts(o, float32=w), truth["overhead"] * o + truth["float32"] * w)
    assert cal.coefficients() == pytest.approx(truth, rel=1e-3)
    assert cal.apply(parts(0.02, float32=3.0)) == pytest.approx(1.7 * 0.02 + 0.6 * 3.0, rel=1e-3)


def test_work_is_refitted_per_dtype():
    cal = TimeCalibration()
    # fp32 work runs at 0.5x its rates, bf16 work at 3x; the overhead as predicted.
    for o, w32, w16 in ((0.01, 0.02, 0.0), (0.01, 0.2, 0.0), (0.01, 0.02, 0.3), (0.02, 0.05, 1.0)):
        cal.add(parts(o, float32=w32, bfloat16=w16), o + 0.5 * w32 + 3.0 * w16)
    assert cal.coefficients() == pytest.approx({"overhead": 1.0, "float32": 0.5, "bfloat16": 3.0}, rel=1e-3)


def test_a_dtype_no_probe_ran_keeps_its_rates():
    cal = TimeCalibration()
    cal.add(parts(0.01, float32=0.02), 0.06)
    cal.add(parts(0.01, float32=0.20), 0.42)
    assert "bfloat16" not in cal.coefficients()
    mixed = parts(0.01, float32=0.05, bfloat16=1.0)
    coef = cal.coefficients()
    assert cal.apply(mixed) == pytest.approx(coef["overhead"] * 0.01 + coef["float32"] * 0.05 + 1.0)


def test_one_probe_is_matched_by_the_smallest_change():
    cal = TimeCalibration()
    assert cal.coefficients() == {} and cal.correction(parts(1.0, float32=1.0)) == 0.0
    cal.add(parts(0.1, float32=0.3), 0.8)
    assert cal.apply(parts(0.1, float32=0.3)) == pytest.approx(0.8, rel=1e-3)
    coef = cal.coefficients()
    # The larger part takes the larger share of the correction; neither moves the wrong way.
    assert coef["float32"] > coef["overhead"] > 1.0


def test_calibration_keeps_coefficients_non_negative():
    cal = TimeCalibration()
    # Measured time falls with more overhead: the unconstrained fit wants a < 0.
    cal.add(parts(0.10, float32=0.10), 0.10)
    cal.add(parts(0.01, float32=0.50), 1.20)
    coef = cal.coefficients()
    assert coef["overhead"] == 0.0 and coef["float32"] > 0


def test_calibration_ignores_unusable_points():
    cal = TimeCalibration()
    cal.add(parts(0.0, float32=0.0), 1.0)
    cal.add(parts(0.1, float32=0.1), float("nan"))
    cal.add(parts(0.1, float32=0.1), 0.0)
    assert len(cal) == 0


def test_estimator_calibration_fits_overhead_and_work_apart():
    est = Estimator(lm_task(), device="cpu")
    est._rates = fixed_rates(matmul__float32=2e9, elementwise__float32=2e9)
    configs = [TrainConfig(micro_batch_size=b) for b in (4, 64, 16)]
    split = []
    for c in configs:
        p, _ = est._events(c)
        split.append(step_time_parts(costs_of(p), p.phase_labels, 1, est.rates()))
    before = est.estimate(configs[2]).step_time_s
    assert before == pytest.approx(split[2].total_s)

    def machine(part: StepTimeParts) -> float:
        # Ops cost 3x the fixed overhead, the work runs at half the rates.
        return 3.0 * part.overhead_s + 2.0 * sum(part.work_s.values())

    for c, part in zip(configs[:2], split[:2]):
        est.calibrate(c, machine(part))
    after = est.estimate(configs[2])
    assert after.step_time_s == pytest.approx(machine(split[2]), rel=1e-3)
    assert any("calibrated on 2 probe(s)" in n for n in after.notes)
    # One common factor could not get both ends right.
    factors = [machine(p) / p.total_s for p in split[:2]]
    assert abs(factors[0] / factors[1] - 1) > 0.05


def test_a_stored_prediction_is_recalibrated_and_calibrates_without_its_trace(monkeypatch):
    from estimators import Estimate
    from estimators.estimator import _traces

    configs = [TrainConfig(micro_batch_size=b) for b in (4, 64, 16)]
    est = Estimator(lm_task(), device="cpu")
    est._rates = fixed_rates(matmul__float32=2e9, elementwise__float32=2e9)
    predicted = [est.estimate(c) for c in configs]
    assert all(p.time_parts is not None and p.time_parts["fixed"] == 0.0 for p in predicted)
    # What a resumed study holds: the predictions' dicts, and a new estimator without traces.
    stored = [Estimate.from_dict(json.loads(json.dumps(p.to_dict()))) for p in predicted]
    fresh = Estimator(lm_task(), device="cpu")
    fresh._rates = est._rates
    traced: list[TrainConfig] = []
    original = _traces.trace_step
    monkeypatch.setattr(_traces, "trace_step", lambda task, config, **kw: traced.append(config) or original(task, config, **kw))

    def machine(p: Estimate) -> float:
        return 3.0 * p.time_parts["overhead"] + 2.0 * p.time_parts["float32"]

    for a, b in zip(stored[:2], predicted[:2]):
        fresh.calibrate(a.config, machine(a), predicted=a)
        est.calibrate(b.config, machine(b))
    again = fresh.recalibrated(stored[2])
    assert traced == []  # neither the calibration nor the refit traced anything
    # The same as a full estimate by an estimator holding the traces and the same probes.
    full = est.estimate(configs[2])
    assert again.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert again.step_time_s == pytest.approx(machine(stored[2]), rel=1e-3)
    assert again.samples_per_s == pytest.approx(configs[2].global_batch / again.step_time_s)
    assert again.notes == full.notes and any("calibrated on 2 probe(s)" in n for n in again.notes)
    assert again.peak_bytes == stored[2].peak_bytes
    # A prediction stored without parts (an older plan) is estimated again.
    old = Estimate.from_dict({k: v for k, v in stored[2].to_dict().items() if k != "time_parts"})
    assert old.time_parts is None
    assert fresh.recalibrated(old).step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert traced  # that one needed its trace


def test_cpu_rates_are_cached_per_kernel_set(monkeypatch):
    # The same CPU under a lower oneDNN ceiling runs other kernels: its own cache file.
    calls = []
    monkeypatch.setattr(_cpu_rates, "_measure_cpu_rates", lambda: calls.append(1) or fixed_rates())
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    native = cpu_rates_path()
    cpu_rates()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_rates_path() != native
    cpu_rates()
    assert len(calls) == 2
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")  # oneDNN reads it in any case
    cpu_rates()
    assert len(calls) == 2
