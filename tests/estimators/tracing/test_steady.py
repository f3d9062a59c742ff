"""The derived second step (estimators.tracing._steady) against a traced one."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers.models import cnn_task, lm_task

from estimators import Task, TrainConfig
from estimators._step_options import StepOptions
from estimators.tracing._steady import RawEvents, drop_second_micro, repeat_first_step
from estimators.tracing._trace import Trace, trace_step


class LazyCache(nn.Module):
    """Fills a cache on its first forward and keeps it (rotary tables, masks)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.ones(64, 16)
        return self.fc(self.frozen(x)) + self.cache[: x.shape[1]].sum()


def lazy_task() -> Task:
    return Task(name="lazy", build_model=LazyCache,
                sample_fn=lambda b: (torch.randn(b, 16), torch.randn(b, 16)),
                loss_fn=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]))


def _events(trace: Trace) -> list[tuple[int, int, int, str]]:
    """(sign, bytes, category, phase) per event, each run of frees in a fixed order."""
    rows = [(int(s), int(trace.alloc_bytes[a]), int(trace.alloc_category[a]), trace.phase_labels[p])
            for a, s, p in zip(trace.event_alloc, trace.event_sign, trace.event_phase)]
    out, i = [], 0
    while i < len(rows):
        j = i + 1
        if rows[i][0] < 0:
            while j < len(rows) and rows[j][0] < 0 and rows[j][3] == rows[i][3]:
                j += 1
        out.extend(sorted(rows[i:j]))
        i = j
    return out


def _assert_same_step(derived: Trace, traced: Trace) -> None:
    """A derived trace against a traced one: phases, events, ops and where each op ends."""
    assert derived.phase_labels == traced.phase_labels
    assert _events(derived) == _events(traced)
    assert [(op.name, op.phase, op.flops, op.bytes_moved) for op in derived.ops] == \
        [(op.name, op.phase, op.flops, op.bytes_moved) for op in traced.ops]
    # Each op's position: the same count of events before it.
    assert derived.op_positions == traced.op_positions
    assert len(derived.host_allocs) == len(traced.host_allocs)


@pytest.mark.parametrize("factory", [lm_task, cnn_task, lazy_task], ids=["lm", "cnn", "lazy"])
@pytest.mark.parametrize("config", [
    TrainConfig(micro_batch_size=4),
    TrainConfig(micro_batch_size=3, grad_accum_steps=3, precision="bf16-mixed"),
    TrainConfig(micro_batch_size=4, checkpoint_segments=2),
], ids=["fp32", "bf16-accum", "ckpt"])
def test_derived_second_step_equals_a_traced_one(factory, config, one_thread):
    task = factory()
    if config.checkpoint_segments and factory is lazy_task:
        config = config.replace(checkpoint_segments=0)
    traced = trace_step(task, config, synthesize=False)
    derived = trace_step(task, config)
    _assert_same_step(derived, traced)


@pytest.mark.parametrize("factory", [lm_task, cnn_task, lazy_task], ids=["lm", "cnn", "lazy"])
@pytest.mark.parametrize("config", [
    TrainConfig(micro_batch_size=3, grad_accum_steps=2),
    TrainConfig(micro_batch_size=2, grad_accum_steps=4, precision="bf16-mixed"),
    TrainConfig(micro_batch_size=4, grad_accum_steps=2, checkpoint_segments=2),
], ids=["fp32", "bf16", "ckpt"])
def test_step_without_accumulation_derived_from_an_accumulating_one(factory, config, one_thread):
    task = factory()
    if config.checkpoint_segments and factory is lazy_task:
        config = config.replace(checkpoint_segments=0)
    accumulating = trace_step(task, config)
    derived = accumulating.single_micro
    traced = trace_step(task, config.replace(grad_accum_steps=1))
    assert derived is not None and derived.config == traced.config and derived.batch_size == traced.batch_size
    _assert_same_step(derived, traced)
    assert len(derived.alloc_bytes) == len(traced.alloc_bytes)
    # Nothing is derived where the first micro-batch is all there is, or from real runs.
    assert traced.single_micro is None
    assert trace_step(task, config, real=True).single_micro is None


@pytest.mark.parametrize("factory", [lm_task, cnn_task, lazy_task], ids=["lm", "cnn", "lazy"])
@pytest.mark.parametrize("config", [
    TrainConfig(micro_batch_size=1, grad_accum_steps=4),
    TrainConfig(micro_batch_size=1, precision="bf16-mixed", checkpoint_segments=2),
], ids=["accum", "bf16-ckpt"])
def test_a_real_run_told_its_shapes_are_static_derives_its_second_step(factory, config, one_thread):
    task = factory()
    if config.checkpoint_segments and factory is lazy_task:
        config = config.replace(checkpoint_segments=0)
    ran = trace_step(task, config, real=True, profile=True)
    derived = trace_step(task, config, real=True, profile=True, derive_real=True)
    assert derived.method == ran.method == "measured-cpu"
    _assert_same_step(derived, ran)
    # Each op keeps its measured scratch bytes through the derivation.
    assert derived.op_workspace is not None and ran.op_workspace is not None
    assert [w for op, w in zip(derived.ops, derived.op_workspace) if op.significant] == \
        [w for op, w in zip(ran.ops, ran.op_workspace) if op.significant]
    if config.grad_accum_steps > 1:
        single = derived.single_micro
        assert single is not None and single.op_workspace is not None
        _assert_same_step(single, trace_step(task, config.replace(grad_accum_steps=1), real=True))


def test_second_micro_batch_that_leaks_is_not_dropped():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class R:
        name: str
        phase: int
        new_bytes: int

    labels = ["setup", "step 1 micro 1 forward", "step 1 micro 2 forward", "step 1 optimizer", "end"]
    # An activation (1) of micro 1 and one (2) of micro 2, each born and freed in its phase.
    raw = RawEvents(alloc_bytes=[100, 10, 10], alloc_category=[0, 1, 1],
                    event_alloc=[0, 1, 1, 2, 2], event_sign=[1, 1, -1, 1, -1], event_phase=[0, 1, 1, 2, 2],
                    phase_labels=labels, ops=[R("a", 1, 10), R("b", 2, 10)], op_positions=[2, 4], host=[2])
    out = drop_second_micro(raw)
    assert out is not None and out.phase_labels == ["setup", "step 1 forward", "step 1 optimizer", "end"]
    assert out.alloc_bytes == [100, 10] and out.host == []
    assert list(zip(out.event_alloc, out.event_sign, out.event_phase)) == [(0, 1, 0), (1, 1, 1), (1, -1, 1)]
    assert [(op.name, op.phase) for op in out.ops] == [("a", 1)] and out.op_positions == [2]
    # Micro 2 frees what micro 1 made: the two are not independent, nothing is derived.
    leaky = dataclasses.replace(raw, event_alloc=[0, 1, 2, 1, 2], event_phase=[0, 1, 2, 2, 2],
                                event_sign=[1, 1, 1, -1, -1])
    assert drop_second_micro(leaky) is None


def test_repeat_first_step_keeps_survivors_once():
    # setup: a param (0); step 1: an activation (1) born and freed, state (2) born and kept,
    # an op that only made the state; end: the state freed.
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class R:
        name: str
        phase: int
        new_bytes: int

    raw = RawEvents(alloc_bytes=[100, 10, 7], alloc_category=[0, 1, 2],
                    event_alloc=[0, 1, 2, 1, 2], event_sign=[1, 1, 1, -1, -1], event_phase=[0, 1, 1, 1, 2],
                    phase_labels=["setup", "step 1 forward", "end"],
                    ops=[R("act", 1, 10), R("state", 1, 7)], op_positions=[2, 3], host=[1])
    out = repeat_first_step(raw)
    assert out.phase_labels == ["setup", "step 1 forward", "step 2 forward", "end"]
    assert out.alloc_bytes == [100, 10, 7, 10]
    assert list(zip(out.event_alloc, out.event_sign, out.event_phase)) == [
        (0, 1, 0), (1, 1, 1), (2, 1, 1), (1, -1, 1), (3, 1, 2), (3, -1, 2), (2, -1, 3)]
    assert [(op.name, op.phase) for op in out.ops] == [("act", 1), ("state", 1), ("act", 2)]
    assert out.op_positions == [2, 3, 5]
    assert out.host == [1, 3]
    with pytest.raises(ValueError):
        repeat_first_step(dataclasses.replace(raw, phase_labels=["setup", "forward", "end"]))


def _phase_peak(trace: Trace, label: str) -> int:
    live = peak = 0
    for a, s, p in zip(trace.event_alloc, trace.event_sign, trace.event_phase):
        live += int(s) * int(trace.alloc_bytes[a])
        if trace.phase_labels[p] == label:
            peak = max(peak, live)
    return peak


def test_cuda_targets_trace_the_multi_tensor_optimizer(one_thread):
    # PyTorch's Adam on CUDA defaults to foreach kernels: sqrt(exp_avg_sq) of every
    # parameter is alive at once, where the CPU loop holds one parameter's.
    task = Task(name="mlp", build_model=lambda: nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]),
                sample_fn=lambda b: (torch.randn(b, 256), torch.randn(b, 256)),
                loss_fn=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]))
    # Without clipping, which asks for multi-tensor norms on every device: the optimizer's own kernels.
    task = task.with_step(StepOptions(clip="off"))
    config = TrainConfig(micro_batch_size=2)
    cpu = trace_step(task, config)
    cuda = trace_step(task, config, target="cuda")
    weights = 4 * 256 * 256 * 4
    step2 = [op for op in cuda.ops if cuda.phase_labels[op.phase] == "step 2 optimizer"]
    assert max(op.new_bytes for op in step2 if op.name.startswith("aten._foreach")) >= weights
    assert not any(op.name.startswith("aten._foreach") for op in cpu.ops)
    # The CPU loop holds a few weights' temporaries at a time (sqrt, its quotient, the
    # previous parameter's quotient until the loop reassigns it), foreach all four.
    assert _phase_peak(cuda, "step 2 optimizer") > _phase_peak(cpu, "step 2 optimizer")
    # A choice the model file made is kept.
    task_loop = Task(name="mlp", build_model=task.build_model, sample_fn=task.sample_fn, loss_fn=task.loss_fn,
                     build_optimizer=lambda ps: torch.optim.AdamW(ps, foreach=False), step=task.step)
    assert _events(trace_step(task_loop, config, target="cuda")) == _events(trace_step(task_loop, config))
