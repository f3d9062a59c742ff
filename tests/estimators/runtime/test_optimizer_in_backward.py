"""The optimizer step in backward (``TrainConfig.optimizer_in_backward``): each parameter
stepped by its own optimizer in a post-accumulate-grad hook, its gradient freed at once."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from estimators import ConfigError, Estimator, Task, TrainConfig
from estimators._step_options import StepOptions
from estimators.probing._measure import measure_cpu_peak
from estimators.runtime._build import build_for_training
from estimators.runtime._optim_bwd import OptimizerInBackward
from estimators.runtime._planned import PlannedSteps
from estimators.task._task import load_task

from helpers.models import TinyLM, lm_task

ROOT = Path(__file__).resolve().parents[3]
NO_CLIP = StepOptions(clip="off")


def wide_mlp_task(step: StepOptions = NO_CLIP) -> Task:
    """Big weights, small batches: the gradients are what the plain step's peak holds."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                             nn.Linear(512, 512), nn.LayerNorm(512), nn.Linear(512, 10))

    def optimizer(params):
        params = list(params)
        # Two groups with different settings: each parameter's optimizer must keep its group's.
        return torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
                                  {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}], lr=1e-2)

    def sample(b: int):
        g = torch.Generator().manual_seed(b)
        return torch.randn(b, 256, generator=g), torch.randint(0, 10, (b,), generator=g)
    return Task(name="wide_mlp", build_model=build, sample_fn=sample, build_optimizer=optimizer).with_step(step)


def seeded_lm_task(step: StepOptions = NO_CLIP) -> Task:
    """The tied-embedding LM, built the same each time (a tied weight is stepped once)."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return TinyLM()
    return Task(name="tinylm", build_model=build, sample_fn=lm_task().sample_fn).with_step(step)


def _in_bwd(b: int, **kw) -> TrainConfig:
    return TrainConfig(micro_batch_size=b, optimizer_in_backward=True, **kw)


@pytest.mark.parametrize("which", ["wide_mlp", "lm", "gpt_tied"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_estimate_is_within_1_percent_of_the_cpu_peak(which: str, precision: str) -> None:
    task = {"wide_mlp": wide_mlp_task, "lm": lambda: lm_task().with_step(NO_CLIP),
            "gpt_tied": lambda: load_task(str(ROOT / "benchmarks/models/gpt_tied.py")).with_step(NO_CLIP)}[which]()
    config = _in_bwd(4, precision=precision)
    est = Estimator(task, device="cpu").estimate(config)
    assert est.method in ("traced", "scaled"), est.method  # a fake trace, not a fallback to a real run
    ref = measure_cpu_peak(task, config).peak_bytes
    assert abs(est.peak_allocated_bytes - ref) / ref < 0.01, (est.peak_allocated_bytes, ref, dict(est.breakdown))


def test_the_peak_is_below_the_plain_steps_and_holds_one_gradient_at_a_time() -> None:
    task = wide_mlp_task()
    estimator = Estimator(task, device="cpu")
    plain = estimator.estimate(TrainConfig(micro_batch_size=4))
    in_bwd = estimator.estimate(_in_bwd(4))
    grads = sum(p.numel() * p.element_size() for p in task.build_model().parameters())
    assert plain.breakdown["gradients"] == grads  # the plain step's peak holds every gradient
    largest = max(p.numel() * p.element_size() for p in task.build_model().parameters())
    assert in_bwd.breakdown.get("gradients", 0) <= largest
    assert in_bwd.breakdown["optimizer"] == plain.breakdown["optimizer"]  # the same state, categorised so
    assert in_bwd.peak_allocated_bytes < plain.peak_allocated_bytes - grads // 2
    assert measure_cpu_peak(task, _in_bwd(4)).peak_bytes < measure_cpu_peak(task, TrainConfig(micro_batch_size=4)).peak_bytes


def test_a_cuda_target_traces_it_too() -> None:
    task = wide_mlp_task()
    estimator = Estimator(task, gpu="A100-80GB")
    plain = estimator.estimate(TrainConfig(micro_batch_size=4, precision="bf16-mixed"))
    in_bwd = estimator.estimate(_in_bwd(4, precision="bf16-mixed"))
    assert in_bwd.peak_allocated_bytes < plain.peak_allocated_bytes
    assert in_bwd.step_time_s is not None and in_bwd.step_time_s > 0


def _weights_after(task: Task, config: TrainConfig, steps: int = 3) -> dict[str, torch.Tensor]:
    built = build_for_training(task, config, "cpu")
    run = PlannedSteps(task, config, built)
    for i in range(1, steps + 1):
        result = run(i)
        assert result.applied
    assert all(p.grad is None for p in built.model.parameters())
    return {k: v.detach().clone() for k, v in built.model.state_dict().items()}


@pytest.mark.parametrize("which", ["wide_mlp", "lm"])
@pytest.mark.parametrize("step", [NO_CLIP, StepOptions(clip="value", clip_threshold=1e-3)], ids=["noclip", "value"])
def test_three_steps_give_the_plain_steps_weights(which: str, step: StepOptions) -> None:
    task = wide_mlp_task(step) if which == "wide_mlp" else seeded_lm_task(step)
    plain = _weights_after(task, TrainConfig(micro_batch_size=4))
    in_bwd = _weights_after(task, _in_bwd(4))
    initial = task.build_model().state_dict()
    for name, w in plain.items():
        assert not torch.equal(w, initial[name]), name  # the weights did move
        assert torch.allclose(in_bwd[name], w, rtol=0, atol=1e-6), (name, (in_bwd[name] - w).abs().max())


def test_the_wrapper_keeps_group_settings_and_serves_a_schedule() -> None:
    task = wide_mlp_task()
    model = task.build_model()
    opt = OptimizerInBackward(task.make_optimizer(model), model)
    assert len(opt.optimizers) == len(list(model.parameters()))
    decay = {opt.names[p]: opt.optimizers[p].param_groups[0]["weight_decay"] for p in model.parameters()}
    assert decay["0.weight"] == 0.1 and decay["0.bias"] == 0.0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    x, y = task.sample_fn(4)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    sched.step()
    assert {g["lr"] for o in opt.optimizers.values() for g in o.param_groups} == {5e-3}
    saved = copy.deepcopy(opt.state_dict())
    other_model = task.build_model()
    other = OptimizerInBackward(task.make_optimizer(other_model), other_model)
    other.load_state_dict(saved)
    p0 = next(other_model.parameters())
    assert torch.equal(other.state[p0]["exp_avg"], opt.state[next(model.parameters())]["exp_avg"])
    assert other.param_groups[0]["lr"] == 5e-3
    with pytest.raises(ConfigError, match="not optimizer_in_backward's"):
        other.load_state_dict(torch.optim.AdamW(other_model.parameters()).state_dict())


@pytest.mark.parametrize("changes, words", [
    ({"grad_accum_steps": 2}, "grad_accum_steps=1"),
    ({"precision": "fp16-mixed"}, "bf16-mixed or fp32"),
    ({"strategy": "ddp", "world_size": 2}, "strategy='single'"),
    ({"optimizer_in_backward": 1}, "True or False"),
])
def test_configurations_it_excludes_are_refused_in_one_line(changes: dict, words: str) -> None:
    kw = {"optimizer_in_backward": True, **changes}
    with pytest.raises(ConfigError, match=words) as info:
        TrainConfig(micro_batch_size=4, **kw)
    assert "\n" not in str(info.value)


def test_clipping_by_the_global_norm_is_refused() -> None:
    task = wide_mlp_task(StepOptions(clip="norm"))
    with pytest.raises(ConfigError, match="grad_clip_mode='value'"):
        Estimator(task, device="cpu").estimate(_in_bwd(4))


def test_the_field_round_trips_and_is_described() -> None:
    config = _in_bwd(8, precision="bf16-mixed")
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert "optimizer_in_backward" not in TrainConfig(micro_batch_size=8).to_dict()
    assert "optimizer in backward" in config.describe()
