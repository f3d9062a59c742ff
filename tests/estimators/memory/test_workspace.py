"""Kernel workspaces (estimators.memory._workspace) against real, profiled runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers.models import lm_task, rel_error

from estimators import Estimator, Task, TrainConfig
from estimators.memory import _workspace
from estimators.probing._measure import measure_cpu_peak
from estimators.tracing._trace import trace_step


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


class RecomputedApart(nn.Module):
    """A block whose recomputation inside the backward runs other kernels than its forward
    (oneDNN off: the same ops, sizes and FLOPs, other scratch)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass
            return x + torch.relu(self.conv(x))
        enabled = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return x + torch.relu(self.conv(x))
        finally:
            torch._C._set_mkldnn_enabled(enabled)


def recompute_apart_task() -> Task:
    def build() -> nn.Module:
        model = ConvStack()
        model.blocks = nn.ModuleList(RecomputedApart(16) for _ in range(3))
        return model
    return Task(name="recompute_apart", build_model=build,
                sample_fn=lambda b: (torch.randn(b, 3, 16, 16), torch.randint(0, 10, (b,))))


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


@pytest.mark.parametrize("factory", [conv_task, lm_task], ids=["conv", "lm"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_fit_holds_at_batch_sizes_it_did_not_run(factory, precision, one_thread):
    # Kernels switch algorithms as the batch grows and pad a dimension that grows with it to
    # their block (native-bf16 GEMMs): a line through two batch sizes misses them in between.
    task = factory()
    fit = _workspace.measure_fit(task, TrainConfig(micro_batch_size=2, precision=precision))
    assert fit is not None
    for b in (5, 6, 7, 12):
        real = trace_step(task, TrainConfig(micro_batch_size=b, precision=precision), real=True, profile=True, steps=1)
        truth, real.op_workspace = real.op_workspace, None
        got = _workspace.aligned_workspaces(real, fit)
        assert got is not None
        miss = sum(abs(g - t) for g, t in zip(_significant(real, got), _significant(real, truth)))
        assert miss <= 0.01 * sum(_significant(real, truth)), (b, miss)


def test_a_borrowed_fit_that_does_not_hold_is_noticed(one_thread):
    task = recompute_apart_task()
    config = TrainConfig(micro_batch_size=5, checkpoint_segments=3)
    got = Estimator(task, device="cpu").estimate(config).peak_allocated_bytes
    ref = measure_cpu_peak(task, config).peak_bytes
    assert rel_error(got, ref) < 0.01, (got, ref)
    # The fake trace finds every recomputed op in the plain fit; only a real run tells.
    plain = _workspace.measure_fit(task, config.replace(checkpoint_segments=0))
    assert plain is not None and _workspace.borrowed_workspaces(trace_step(task, config, steps=1), plain) is not None
    assert not _workspace.borrow_holds(task, config, plain)
    conv = conv_task()
    assert _workspace.borrow_holds(conv, config, _workspace.measure_fit(conv, config.replace(checkpoint_segments=0)))


def test_a_fit_of_other_kernels_is_not_borrowed(one_thread):
    conv = _workspace.measure_fit(conv_task(), TrainConfig(micro_batch_size=2))
    lm = trace_step(lm_task(), TrainConfig(micro_batch_size=4, checkpoint_segments=2), steps=1)
    assert conv is not None and _workspace.borrowed_workspaces(lm, conv) is None


def test_one_fit_per_precision_serves_every_checkpoint_setting(monkeypatch):
    import estimators.memory._workspace_cache as est_mod
    fitted = []
    original = est_mod.measure_fit

    def counted(task, config, **kwargs):
        fitted.append((config.precision, config.checkpoint_segments))
        return original(task, config, **kwargs)

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


def test_scaled_estimates_size_workspaces_from_the_fit(one_thread):
    # Batch scaling is affine in the batch size, kernel workspaces are not: the scaled
    # estimate takes them from the fit at its own size (a step missed there costs ~0.4%).
    task = lm_task()
    estimator = Estimator(task, device="cpu")
    for config in (TrainConfig(micro_batch_size=5, precision="bf16-mixed"),
                   TrainConfig(micro_batch_size=7, precision="bf16-mixed", checkpoint_segments=2)):
        got = estimator.estimate(config)
        assert got.method == "scaled"
        ref = measure_cpu_peak(task, config).peak_bytes
        assert rel_error(got.peak_allocated_bytes, ref) < 0.001, (config, got.peak_allocated_bytes, ref)


def small_mlp_task(dims: tuple[int, ...] = (16, 64, 4)) -> Task:
    """GEMMs of at most 16³ multiply-adds at batch 4: torch runs such bf16/fp16 GEMMs on its
    reference kernel and larger ones on oneDNN's (with scratch), so at batch 32 kernels run
    that no workspace anchor ran."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.GELU()]
        return nn.Sequential(*layers[:-1])
    return Task(name="mlp_" + "_".join(map(str, dims)), build_model=build,
                sample_fn=lambda b: (torch.randn(b, dims[0]), torch.randint(0, dims[-1], (b,))))


@pytest.mark.parametrize("dims", [(16, 64, 4), (16, 64, 64, 4)], ids=["all-small", "one-large"])
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed", "fp16-true"])
def test_gemms_that_switch_kernels_past_the_anchors_get_their_scratch(dims, precision, one_thread):
    # Measured here (AMD EPYC, native bf16): with the line of 2 to 4 alone, bf16-true's
    # estimate of the all-small MLP at batch 32 was 36% low (every GEMM on oneDNN there, none
    # at the anchors); the one-large MLP had five GEMMs without their 6.5-13 KB of scratch.
    # fp16 GEMMs go to oneDNN on CPUs with avx512_fp16 only: the same switch, no dtype named.
    task = small_mlp_task(dims)
    fit = _workspace.measure_fit(task, TrainConfig(micro_batch_size=2, precision=precision))
    assert fit is not None
    for b in (5, 17, 32):
        config = TrainConfig(micro_batch_size=b, precision=precision)
        real = trace_step(task, config, real=True, profile=True, steps=1)
        truth, real.op_workspace = real.op_workspace, None
        got = _workspace.aligned_workspaces(real, fit)
        assert got is not None
        miss = sum(abs(g - t) for g, t in zip(_significant(real, got), _significant(real, truth)))
        assert miss <= 0.01 * max(sum(_significant(real, truth)), 1), (b, _significant(real, got),
                                                                        _significant(real, truth))
    config = TrainConfig(micro_batch_size=32, precision=precision)
    got = Estimator(task, device="cpu").estimate(config, exact=True).peak_allocated_bytes
    ref = measure_cpu_peak(task, config).peak_bytes
    assert rel_error(got, ref) < 0.01, (got, ref)


def test_a_kind_of_op_without_scratch_is_probed_once_and_replayed_only_where_it_allocates(monkeypatch, one_thread):
    # Whatever the CPU: stand-ins for the single-op runs say what a CPU with native kernels
    # for this precision would show. A kind of op without scratch at the anchors is run once,
    # larger; its ops are run at the batch asked only when that probe shows scratch.
    task = small_mlp_task()
    fit = _workspace.measure_fit(task, TrainConfig(micro_batch_size=2, precision="fp16-true"))
    assert fit is not None
    gemms = {(kind, row) for kind, (names, _i, _s) in fit.kinds.items()
             for row, name in enumerate(names) if name in ("aten.mm", "aten.addmm")}
    assert gemms and all(not fit.measured[k][r].any() for k, r in gemms)  # fp16 here: no scratch
    assert gemms <= {(k, r) for k, rows in fit.replays.items() for r in rows}
    runs: list[list[tuple[tuple[str, int], int]]] = []

    def flops(src, b):
        _names, intercept, slope = fit.kinds[src[0]]
        return intercept[src[1], 2] + slope[src[1], 2] * b

    def native(fit_, calls):  # oneDNN's rule: scratch past 16³ multiply-adds
        runs.append(calls)
        return {src: 1000 if flops(src, b) > 2 * 16 ** 3 else 0 for src, b in calls}

    monkeypatch.setattr(_workspace, "_replayed", native)
    at32 = _workspace.switched_workspaces(fit, 32)
    assert {src for src, w in at32.items() if w} == {src for src in gemms if flops(src, 32) > 2 * 16 ** 3}
    assert len(runs) == 2 and all(b > 32 for _src, b in runs[0])  # the probes, then batch 32's ops
    _workspace.switched_workspaces(fit, 8)
    assert len(runs) == 3  # probed once per fit

    quiet = _workspace.measure_fit(task, TrainConfig(micro_batch_size=2, precision="fp16-true"))
    assert quiet is not None
    runs.clear()
    monkeypatch.setattr(_workspace, "_replayed", lambda fit_, calls: runs.append(calls) or {})
    assert _workspace.switched_workspaces(quiet, 32) == {} and _workspace.switched_workspaces(quiet, 64) == {}
    assert len(runs) == 1  # nothing run past the probes


def test_ops_with_scratch_at_the_anchors_are_run_at_the_batch_asked_where_running_alone_is_faithful(
        monkeypatch, one_thread):
    # Kernels with scratch at the anchors change algorithm past them too, by rules of each CPU.
    # Stand-ins for the single-op runs: at the largest anchor one op alone gives what the step
    # measured there and the other does not; past the anchors each shows 7 bytes per sample.
    task = conv_task()
    fit = _workspace.measure_fit(task, TrainConfig(micro_batch_size=2, precision="fp32"))
    assert fit is not None
    loud = [(kind, row) for kind, rows in fit.replays.items() for row in rows if fit.measured[kind][row].any()]
    assert len(loud) >= 2
    faithful, unfaithful = loud[0], loud[1]
    runs: list[list[tuple[tuple[str, int], int]]] = []

    def alone(fit_, calls):
        runs.append(calls)
        a4 = _workspace.WORKSPACE_ANCHORS[-1]
        return {src: (int(fit.measured[src[0]][src[1], -1]) + (src == unfaithful)) if b == a4 else 7 * b
                for src, b in calls}

    monkeypatch.setattr(_workspace, "_replayed", alone)
    lines = {src: int(_workspace.workspace_at(fit.measured[src[0]], 24)[src[1]]) for src in loud}
    at24 = {src: int(fit.workspace(src[0], 24)[src[1]]) for src in loud}
    assert at24[faithful] == 7 * 24 != lines[faithful]
    assert at24[unfaithful] == lines[unfaithful]  # the line through the anchors stays
    assert fit.faithful[faithful] and not fit.faithful[unfaithful]
    checks = len(runs)
    fit.workspace(loud[0][0], 40)
    assert len(runs) == checks + 1  # checked once per fit: one run, of batch 40's ops
