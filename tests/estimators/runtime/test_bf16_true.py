"""Pure low precision (``bf16-true``): weights, gradients and optimizer state in bf16, no
autocast, no scaler. The estimate against the CPU allocator's real peak, the saving against
bf16-mixed, and a short real training against fp32's loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from estimators import ConfigError, Estimator, Task, TrainConfig, load_task, normalize_precision
from estimators.probing._measure import measure_cpu_peak
from estimators.runtime import _precision
from estimators.runtime._build import build_for_training
from estimators.runtime._ema import EMA
from estimators.runtime._planned import PlannedSteps

pytestmark = pytest.mark.usefixtures("one_thread")

from helpers.models import teacher_task  # noqa: E402 - shared with benchmarks/bf16_true.py


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(8))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)) * self.scale)


def test_names_and_round_trip():
    assert normalize_precision("bf16-true") == "bf16-true"
    assert normalize_precision("16-true") == normalize_precision("FP16-true") == "fp16-true"
    assert normalize_precision("bf16") == "bf16-mixed"  # the short name stays mixed precision
    config = TrainConfig(micro_batch_size=4, precision="bf16-true")
    assert "bf16-true" in config.describe()
    assert TrainConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="bf16-true"):
        normalize_precision("bf16-pure")


@pytest.mark.parametrize("precision,dtype", [("bf16-true", torch.bfloat16), ("fp16-true", torch.float16)])
def test_no_autocast_no_scaler_and_low_precision_default_dtype(precision, dtype):
    assert _precision.autocast_dtype(precision) is None
    assert _precision.make_grad_scaler(precision, "cpu") is None
    assert _precision.weight_dtype(precision) is dtype
    with _precision.forward_context(precision, "cpu"):
        assert not torch.is_autocast_enabled("cpu")
        assert torch.zeros(1).dtype is dtype  # tensors the forward creates follow the weights
    assert torch.get_default_dtype() is torch.float32
    x, y = torch.rand(2, 3), torch.arange(2)
    cx, cy = _precision.convert_input((x, y), precision)
    assert cx.dtype is dtype and cy.dtype is torch.long
    assert _precision.convert_input((x, y), "bf16-mixed")[0] is x
    # The step's precision object does the same, chosen once.
    p = _precision.StepPrecision(precision, "cpu")
    assert p.scaler is None and p.weight_dtype is dtype and p.state_dict() is None
    with p.forward_context():
        assert not torch.is_autocast_enabled("cpu") and torch.zeros(1).dtype is dtype
    assert p.convert_input((x, y))[0].dtype is dtype
    assert _precision.StepPrecision("bf16-mixed", "cpu").convert_input((x, y))[0] is x


def test_build_casts_weights_and_buffers_but_not_batch_norm_and_keeps_ties():
    task = Task(name="tied", build_model=Tied, sample_fn=lambda b: (torch.randint(0, 32, (b,)),))
    built = build_for_training(task, TrainConfig(micro_batch_size=2, precision="bf16-true"), "cpu")
    m = built.model
    assert m.head.weight is m.emb.weight and m.emb.weight.dtype is torch.bfloat16
    assert m.scale.dtype is torch.bfloat16 and m.count.dtype is torch.long
    assert all(t.dtype is torch.float32 for t in (m.norm.weight, m.norm.bias, m.norm.running_mean, m.norm.running_var))
    fp32 = build_for_training(task, TrainConfig(micro_batch_size=2, precision="bf16-mixed"), "cpu").model
    assert all(p.dtype is torch.float32 for p in fp32.parameters())


def _models() -> list[tuple[str, Any, TrainConfig]]:
    return [
        ("digits", lambda: load_task("examples/digits.py"), TrainConfig(micro_batch_size=16, precision="bf16-true")),
        ("gpt_tied", lambda: load_task("benchmarks/models/gpt_tied.py"),
         TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_segments=2, precision="bf16-true")),
        ("teacher", teacher_task, TrainConfig(micro_batch_size=32, precision="bf16-true")),
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name,make,config", _models(), ids=[m[0] for m in _models()])
def test_estimate_within_1pct_of_the_real_peak_and_below_bf16_mixed(name, make, config):
    task = make()
    estimator = Estimator(task, device="cpu")
    est = estimator.estimate(config, exact=True)
    real = measure_cpu_peak(task, config)
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes, (est.peak_bytes, real.peak_bytes)
    mixed = config.replace(precision="bf16-mixed")
    assert real.peak_bytes < measure_cpu_peak(task, mixed).peak_bytes
    assert est.peak_bytes < estimator.estimate(mixed, exact=True).peak_bytes


def _train(task: Task, precision: str, steps: int) -> tuple[list[float], nn.Module]:
    config = TrainConfig(micro_batch_size=32, precision=precision)
    built = build_for_training(task, config, "cpu")
    run = PlannedSteps(task, config, built)
    return [float(run(i).loss_sum) for i in range(steps)], built.model


@pytest.mark.timeout(120)
def test_training_reaches_fp32_loss_within_5pct():
    # Tolerance: the mean loss of the last 10 of 100 AdamW steps within 5% of fp32's (measured:
    # 0.2625 against 0.2642, 0.7%, on AVX-512-BF16 and on AVX2), both far below the first.
    task = teacher_task()
    ref, _ = _train(task, "fp32", 100)
    low, model = _train(task, "bf16-true", 100)
    assert model[0].weight.dtype is torch.bfloat16 and model[1].weight.dtype is torch.float32
    ref_end, low_end = sum(ref[-10:]) / 10, sum(low[-10:]) / 10
    assert low_end < 0.3 * low[0] and ref_end < 0.3 * ref[0]
    assert abs(low_end - ref_end) <= 0.05 * ref_end, (low_end, ref_end)


def test_ema_shadow_stays_fp32_and_moves():
    model = nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    ema = EMA(model, 0.999)
    assert ema.shadow["weight"].dtype is torch.float32
    start = ema.shadow["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    for _ in range(10):
        ema.update(model)
    # 10 steps at decay 0.999 move the average by ~1% of the gap; a bf16 shadow would not move.
    assert torch.allclose(ema.shadow["weight"] - start, torch.full_like(start, 1 - 0.999 ** 10), atol=1e-3)


@pytest.mark.timeout(180)
def test_cuda_target_and_distributed_traces():
    task = load_task("benchmarks/models/gpt_tied.py")
    a100 = Estimator(task, gpu="A100-80GB")
    true = a100.estimate(TrainConfig(micro_batch_size=8, precision="bf16-true"))
    mixed = a100.estimate(TrainConfig(micro_batch_size=8, precision="bf16-mixed"))
    assert true.peak_bytes < mixed.peak_bytes
    with pytest.raises(ConfigError, match="no bf16"):
        Estimator(task, gpu="V100-16GB").estimate(TrainConfig(micro_batch_size=8, precision="bf16-true"))
    # DDP all-reduces 2-byte gradients: half the buckets' bytes of bf16-mixed's fp32 ones.
    ddp = {p: a100.estimate(TrainConfig(micro_batch_size=8, precision=p, strategy="ddp", world_size=8))
           for p in ("bf16-mixed", "bf16-true")}
    assert ddp["bf16-true"].time_parts["fixed"] < ddp["bf16-mixed"].time_parts["fixed"]
    # FSDP2 over fp32 batch-norm layers inside bf16 blocks: one dtype per unit.
    digits = Estimator(load_task("examples/digits.py"), device="cpu")
    fsdp = TrainConfig(micro_batch_size=8, precision="bf16-true", strategy="fsdp", world_size=2)
    assert digits.estimate(fsdp, exact=True).peak_bytes < digits.estimate(
        fsdp.replace(precision="bf16-mixed"), exact=True).peak_bytes


@pytest.mark.timeout(60)
def test_fp16_true_when_asked_estimates_within_1pct_and_runs_on_a_card_without_bf16():
    task = teacher_task()
    config = TrainConfig(micro_batch_size=32, precision="fp16-true")
    est = Estimator(task, device="cpu").estimate(config, exact=True)
    real = measure_cpu_peak(task, config)
    assert abs(est.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes, (est.peak_bytes, real.peak_bytes)
    v100 = Estimator(task, gpu="V100-16GB")
    # Allocated, not reserved: a model this small fits one 20 MB segment either way.
    assert v100.estimate(config).peak_allocated_bytes < v100.estimate(
        config.replace(precision="fp16-mixed")).peak_allocated_bytes
