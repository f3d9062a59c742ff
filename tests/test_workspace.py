"""Kernel workspaces (estimators._workspace) against real, profiled runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from estimators import Estimator, Task, TrainConfig
from estimators import _workspace
from estimators._measure import measure_cpu_peak
from estimators._trace import trace_step

from test_estimator import lm_task, rel_error


class ConvBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class ConvStack(nn.Module):
    """oneDNN convolutions allocate scratch no tensor shows: workspaces worth measuring."""

    def __init__(self, c: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(c) for _ in range(layers))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))


def conv_task() -> Task:
    return Task(name="convstack", build_model=ConvStack,
                sample_fn=lambda b: (torch.randn(b, 3, 16, 16), torch.randint(0, 10, (b,))))


def _significant(trace, values):
    return [v for op, v in zip(trace.ops, values) if op.significant]


@pytest.mark.parametrize("factory", [conv_task, lm_task], ids=["conv", "lm"])
@pytest.mark.parametrize("config", [
    TrainConfig(micro_batch_size=5, checkpoint_segments=2),
    TrainConfig(micro_batch_size=3, checkpoint_segments=3, grad_accum_steps=2, precision="bf16-mixed"),
], ids=["fp32", "bf16-accum"])
def test_checkpointed_ops_borrow_the_fit_without_checkpointing(factory, config, one_thread):
    task = factory()
    real = trace_step(task, config, real=True, profile=True, steps=1)
    truth = real.op_workspace
    assert truth is not None and sum(truth) > 0
    real.op_workspace = None
    reference = _workspace.reference_config(config)
    assert reference == config.replace(checkpoint_segments=0)
    fit = _workspace.measure_fit(task, reference)
    assert fit is not None
    borrowed = _workspace.borrowed_workspaces(real, fit)
    assert borrowed is not None
    # The recomputed forward inside the backward finds its kernels in the plain forward.
    assert _significant(real, borrowed) == _significant(real, truth)


def test_a_fit_of_other_kernels_is_not_borrowed(one_thread):
    conv = _workspace.measure_fit(conv_task(), TrainConfig(micro_batch_size=2))
    lm = trace_step(lm_task(), TrainConfig(micro_batch_size=4, checkpoint_segments=2), steps=1)
    assert conv is not None and _workspace.borrowed_workspaces(lm, conv) is None


def test_one_fit_per_precision_serves_every_checkpoint_setting(monkeypatch):
    import estimators._estimate as est_mod
    fitted = []
    original = est_mod.measure_fit

    def counted(task, config):
        fitted.append((config.precision, config.checkpoint_segments))
        return original(task, config)

    monkeypatch.setattr(est_mod, "measure_fit", counted)
    task = conv_task()
    estimator = Estimator(task, device="cpu")
    configs = [TrainConfig(micro_batch_size=6, checkpoint_segments=s) for s in (3, 1, 0, 2)]
    got = {c: estimator.estimate(c) for c in configs}
    assert fitted == [("fp32", 0)]
    # The checkpointed estimates stay those of the CPU allocator.
    for config in (configs[0], configs[1]):
        ref = measure_cpu_peak(task, config).peak_bytes
        assert rel_error(got[config].peak_allocated_bytes, ref) < 0.01, (config, got[config].peak_allocated_bytes, ref)
