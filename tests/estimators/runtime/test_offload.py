"""Activation offloading (``TrainConfig.offload_activations``): saved tensors in host memory
between forward and backward; on a CPU device nothing moves, on a CUDA target the trace holds
the host copies in host memory and prices their transfers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from estimators import ConfigError, Estimator, Task, TrainConfig, get_gpu
from estimators._step_options import StepOptions
from estimators.memory._replay import replay_sizes
from estimators.probing._measure import measure_cpu_peak
from estimators.runtime._activation_offload import MIN_OFFLOAD_BYTES, simulated_transfers
from estimators.runtime._build import build_for_training
from estimators.runtime._planned import PlannedSteps
from estimators.task._task import load_task
from estimators.timing._activation_offload_time import LINK_EFFICIENCY, host_link_bytes_per_s
from estimators.tracing._recorder import Category

from helpers.models import lm_task

ROOT = Path(__file__).resolve().parents[3]


def wide_task() -> Task:
    """Small weights, many activations: what offloading takes off the device dominates."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        hidden = [m for _ in range(6) for m in (nn.Linear(128, 128), nn.GELU())]
        return nn.Sequential(nn.Linear(32, 128), nn.GELU(), *hidden, nn.LayerNorm(128), nn.Linear(128, 10))

    def sample(b: int):
        g = torch.Generator().manual_seed(b)
        return torch.randn(b, 32, generator=g), torch.randint(0, 10, (b,), generator=g)
    return Task(name="wide", build_model=build, sample_fn=sample).with_step(StepOptions(clip="off"))


def _tasks() -> dict[str, Task]:
    return {"digits": load_task(str(ROOT / "examples/digits.py")),
            "gpt_tied": load_task(str(ROOT / "benchmarks/models/gpt_tied.py")), "lm": lm_task()}


@pytest.mark.parametrize("which", ["digits", "gpt_tied", "lm"])
def test_on_cpu_the_estimate_is_within_1_percent_of_the_measured_peak_and_unchanged(which: str) -> None:
    task = _tasks()[which]
    estimator = Estimator(task, device="cpu")
    config = TrainConfig(micro_batch_size=8, offload_activations=True)
    est = estimator.estimate(config)
    assert est.method in ("traced", "scaled"), est.method
    ref = measure_cpu_peak(task, config).peak_bytes
    assert abs(est.peak_allocated_bytes - ref) / ref < 0.01, (est.peak_allocated_bytes, ref, dict(est.breakdown))
    # Host memory is a CPU's device memory: nothing moves, the step holds what it held.
    plain = estimator.estimate(config.replace(offload_activations=False))
    assert est.peak_allocated_bytes == plain.peak_allocated_bytes and est.host_bytes == 0
    assert measure_cpu_peak(task, config.replace(offload_activations=False)).peak_bytes == ref


def _offloaded_bytes(task: Task, config: TrainConfig) -> int:
    """Bytes of the tensors autograd saves in one real forward that offloading moves (at least
    MIN_OFFLOAD_BYTES, not a parameter, a view of one or the batch), counted with hooks of our own."""
    built = build_for_training(task, config, "cpu")
    x, y = task.sample_fn(config.micro_batch_size)
    params = set(built.model.parameters())
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        nbytes = t.numel() * t.element_size()
        if nbytes >= MIN_OFFLOAD_BYTES and t not in params and t._base not in params and t is not x and t is not y:
            total += nbytes
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = task.compute_loss(built.model, (x, y))
    loss.backward()
    return total


def test_a_cuda_target_moves_the_saved_activations_to_host_memory() -> None:
    task = wide_task()
    estimator = Estimator(task, gpu="A100-80GB")
    config = TrainConfig(micro_batch_size=2048)
    plain = estimator.estimate(config, exact=True)
    off = estimator.estimate(config.replace(offload_activations=True), exact=True)
    saved = _offloaded_bytes(task, config)
    assert saved > 13 * 2**20  # fourteen 1 MiB activations
    assert off.host_bytes == saved  # one micro-batch's saved tensors, all in host memory at forward's end
    assert plain.host_bytes == 0
    # Not scaled from small anchor batches, where per-sample-tiny tensors (LayerNorm's mean and
    # rstd, the loss over 10 classes) fall under MIN_OFFLOAD_BYTES and would stay on the device.
    fresh = Estimator(task, gpu="A100-80GB")
    try:
        fresh.expect([config.replace(offload_activations=True, micro_batch_size=b) for b in (512, 1024, 2048)])
        unscaled = fresh.estimate(config.replace(offload_activations=True))
    finally:
        fresh.close()  # its trace worker, which would outlive the test (and trip the probe tests' check)
    assert unscaled.method == "traced" and unscaled.host_bytes == saved
    # The device no longer holds them: its peak falls by about the saved activations (backward
    # brings them back one node at a time).
    assert plain.peak_allocated_bytes - off.peak_allocated_bytes >= 0.8 * saved, (plain.breakdown, off.breakdown)
    assert off.breakdown["offloaded"] == 0  # host copies count nothing on the device
    prepared, _ = estimator._events(config.replace(offload_activations=True), exact=True)
    host = prepared.alloc_category == int(Category.OFFLOADED)
    assert prepared.alloc_bytes[host].sum() >= saved and set(np.flatnonzero(host)) <= set(prepared.host_allocs)
    assert not replay_sizes(prepared, "cuda")[host].any()
    assert off.peak_allocated_bytes < plain.peak_allocated_bytes - plain.breakdown["activations"] // 2


def test_transfers_that_compute_cannot_hide_lengthen_the_step() -> None:
    task = wide_task()
    spec = get_gpu("A100-80GB")
    estimator = Estimator(task, gpu=spec.name)
    config = TrainConfig(micro_batch_size=4096)
    plain = estimator.estimate(config)
    off = estimator.estimate(config.replace(offload_activations=True))
    link = host_link_bytes_per_s(spec)
    transfers = 2 * off.host_bytes / link  # device -> host in forward, back in backward
    assert plain.step_time_s is not None and off.step_time_s is not None
    # A tiny MLP on an A100: the passes' compute is far shorter than the copies, which set the
    # time (the step is at least its transfers; at most the plain step plus all of them).
    assert transfers > 3 * plain.step_time_s
    assert off.step_time_s >= transfers
    assert off.step_time_s - plain.step_time_s <= transfers + 1e-12
    assert any(n.startswith("activation offload:") for n in off.notes)
    # Accumulating micro-batches transfers each one's activations.
    acc = estimator.estimate(config.replace(offload_activations=True, grad_accum_steps=3))
    acc_plain = estimator.estimate(config.replace(grad_accum_steps=3))
    assert acc.step_time_s - acc_plain.step_time_s > 2.5 * (off.step_time_s - plain.step_time_s)


def test_the_host_link_is_the_cards_pcie_link() -> None:
    # NVLink cards reach the host over PCIe of their generation; PCIe cards over their own link.
    assert host_link_bytes_per_s(get_gpu("A100-80GB")) == pytest.approx(32e9 * LINK_EFFICIENCY)
    assert host_link_bytes_per_s(get_gpu("A100-80GB-PCIE")) == pytest.approx(32e9 * LINK_EFFICIENCY)
    assert host_link_bytes_per_s(get_gpu("T4")) == pytest.approx(16e9 * LINK_EFFICIENCY)
    assert host_link_bytes_per_s(get_gpu("H100-80GB")) == pytest.approx(64e9 * LINK_EFFICIENCY)


def test_with_checkpointing_the_blocks_inputs_are_offloaded() -> None:
    task = load_task(str(ROOT / "benchmarks/models/gpt_tied.py"))
    estimator = Estimator(task, gpu="A100-80GB")
    config = TrainConfig(micro_batch_size=8, checkpoint_segments=2)
    ckpt = estimator.estimate(config)
    both = estimator.estimate(config.replace(offload_activations=True))
    alone = estimator.estimate(TrainConfig(micro_batch_size=8, offload_activations=True))
    assert 0 < both.host_bytes < alone.host_bytes  # fewer saved tensors: the blocks' insides recompute
    assert both.peak_allocated_bytes < ckpt.peak_allocated_bytes


def _losses(task: Task, config: TrainConfig, steps: int, simulate: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)  # the same initial weights for every run
    built = build_for_training(task, config, "cpu")
    run = PlannedSteps(task, config, built)
    losses = []
    with simulated_transfers() if simulate else _nothing():
        for i in range(1, steps + 1):
            result = run(i)
            assert result.loss_sum is not None and result.applied
            losses.append(float(result.loss_sum))
    return losses, {k: v.detach().clone() for k, v in built.model.state_dict().items()}


class _nothing:
    def __enter__(self) -> None: ...
    def __exit__(self, *exc: object) -> None: ...


@pytest.mark.parametrize("which", ["digits", "lm"])
def test_training_with_the_copies_gives_the_plain_runs_losses_exactly(which: str) -> None:
    # The copies a GPU makes (host copy in forward, device copy in backward), made for real on
    # CPU tensors: the same bits come back, so training is unchanged.
    task = _tasks()[which]
    config = TrainConfig(micro_batch_size=16, grad_accum_steps=2)
    plain, plain_weights = _losses(task, config, 6, simulate=False)
    off, off_weights = _losses(task, config.replace(offload_activations=True), 6, simulate=True)
    assert off == plain
    assert plain[-1] < plain[0]  # it did train
    for name, w in plain_weights.items():
        assert torch.equal(off_weights[name], w), name
    # And on a CPU device (no copies) the run is the plain one too.
    assert _losses(task, config.replace(offload_activations=True), 6, simulate=False)[0] == plain


def test_the_field_round_trips_is_described_and_checked() -> None:
    config = TrainConfig(micro_batch_size=8, offload_activations=True, checkpoint_segments=1, precision="bf16-true")
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert "offload_activations" not in TrainConfig(micro_batch_size=8).to_dict()
    assert "activations offloaded" in config.describe()
    TrainConfig(micro_batch_size=8, offload_activations=True, strategy="fsdp", world_size=2)  # any strategy
    with pytest.raises(ConfigError, match="True or False") as info:
        TrainConfig(micro_batch_size=8, offload_activations=1)
    assert "\n" not in str(info.value)
