"""The step-time model: roofline pricing of traced ops and probe calibration."""

from __future__ import annotations

import pytest

from estimators import Estimator, Task, TrainConfig
from estimators._timing import TimeCalibration, cpu_rates

from test_estimator import TinyLM, lm_task  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))


def test_more_work_costs_more_time():
    est = Estimator(lm_task(), gpu="A100-80GB")
    small = est.estimate(TrainConfig(micro_batch_size=4))
    big = est.estimate(TrainConfig(micro_batch_size=64))
    accum = est.estimate(TrainConfig(micro_batch_size=4, grad_accum_steps=4))
    ckpt = est.estimate(TrainConfig(micro_batch_size=64, checkpoint_segments=4))
    assert big.step_time_s > small.step_time_s
    # Accumulation repeats forward+backward, not the optimizer step.
    assert 2 * small.step_time_s < accum.step_time_s < 4 * small.step_time_s
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


def test_calibration_refits_the_scale():
    est = Estimator(lm_task(), device="cpu")
    config = TrainConfig(micro_batch_size=8)
    before = est.estimate(config).step_time_s
    est.calibrate(config, before * 3)
    assert est.estimate(config).step_time_s == pytest.approx(before * 3)
    other = TrainConfig(micro_batch_size=16)
    est2 = Estimator(lm_task(), device="cpu")
    assert est.estimate(other).step_time_s == pytest.approx(3 * est2.estimate(other).step_time_s)


def test_calibration_is_a_geometric_mean():
    cal = TimeCalibration()
    cal.add(1.0, 2.0)
    cal.add(1.0, 8.0)
    assert cal.factor == pytest.approx(4.0)
    cal.add(0.0, 1.0)  # ignored: no prediction to compare with
    assert len(cal.ratios) == 2


def test_cpu_rates_are_measured_once_and_cached(tmp_path):
    first = cpu_rates()
    assert first.flops_per_s["float32"] > 1e8 and first.bandwidth_bytes_per_s > 1e8
    assert list(tmp_path.glob("cpu-rates-*.json"))
    assert cpu_rates() == first
