"""The static estimator against the CPU allocator's real peak, and its bookkeeping."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers.models import Block, TinyLM, cnn_task, lm_task, rel_error  # noqa: F401 - shared builders

from estimators import ConfigError, Estimator, ModelFileError, Task, TrainConfig, estimate
from estimators.probing._measure import measure_cpu_peak, storage_bytes
from estimators.runtime._checkpoint import apply_checkpointing, find_block_stack, select_blocks


@pytest.mark.parametrize("factory", [lm_task, cnn_task], ids=["lm", "cnn"])
@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(micro_batch_size=6),
        TrainConfig(micro_batch_size=6, precision="bf16-mixed"),
        TrainConfig(micro_batch_size=5, grad_accum_steps=3),
    ],
    ids=["fp32", "bf16", "accum3"],
)
def test_prediction_matches_cpu_allocator(factory, config):
    task = factory()
    est = Estimator(task, device="cpu").estimate(config)
    ref = measure_cpu_peak(task, config).peak_bytes
    assert rel_error(est.peak_allocated_bytes, ref) < 0.01, (est.peak_allocated_bytes, ref, est.method)


def test_checkpointing_lowers_activations_and_stays_accurate():
    task = lm_task()
    estimator = Estimator(task, device="cpu")
    plain = estimator.estimate(TrainConfig(micro_batch_size=8))
    ckpt_config = TrainConfig(micro_batch_size=8, checkpoint_segments=4)
    ckpt = estimator.estimate(ckpt_config)
    assert ckpt.breakdown["activations"] < plain.breakdown["activations"]
    ref = measure_cpu_peak(task, ckpt_config).peak_bytes
    assert rel_error(ckpt.peak_allocated_bytes, ref) < 0.01


def test_batch_scaling_equals_a_fresh_trace():
    task = lm_task()
    scaled = Estimator(task, device="cpu").estimate(TrainConfig(micro_batch_size=11))
    traced = Estimator(task, device="cpu").estimate(TrainConfig(micro_batch_size=11), exact=True)
    assert scaled.method == "scaled" and traced.method == "traced"
    assert scaled.peak_allocated_bytes == traced.peak_allocated_bytes
    assert scaled.breakdown == traced.breakdown


def test_breakdown_counts_tied_weights_once_and_adamw_state():
    task = lm_task()
    est = Estimator(task, device="cpu").estimate(TrainConfig(micro_batch_size=4))
    model = TinyLM()
    param_bytes = storage_bytes(model.parameters())
    assert est.breakdown["params"] == param_bytes
    # AdamW keeps exp_avg and exp_avg_sq per parameter (plus a 4-byte step each).
    n_params = len(list(model.parameters()))
    assert est.breakdown["optimizer"] == 2 * param_bytes + 4 * n_params
    assert est.params == sum(p.numel() for p in model.parameters())
    assert sum(est.breakdown.values()) == est.peak_allocated_bytes


def test_frozen_parameters_get_no_optimizer_state():
    def build() -> nn.Module:
        m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        for p in m[0].parameters():
            p.requires_grad_(False)
        return m
    task = Task(name="frozen", build_model=build,
                sample_fn=lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))))
    est = Estimator(task, device="cpu").estimate(TrainConfig(micro_batch_size=4))
    trainable_bytes = (64 * 4 + 4) * 4
    assert est.breakdown["optimizer"] == 2 * trainable_bytes + 4 * 2
    assert est.trainable_params == 64 * 4 + 4


def test_data_dependent_shapes_get_a_measured_estimate():
    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 2)
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            choice = self.gate(x).argmax(-1)
            out = torch.zeros_like(x)
            for i, expert in enumerate(self.experts):
                idx = torch.nonzero(choice == i).squeeze(-1)
                out = out.index_add(0, idx, expert(x[idx]))
            return self.head(out)
    task = Task(name="router", build_model=Router,
                sample_fn=lambda b: (torch.randn(b, 8), torch.randint(0, 3, (b,))))
    config = TrainConfig(micro_batch_size=16)
    est = Estimator(task, device="cpu").estimate(config)
    assert est.method == "measured-cpu"
    ref = measure_cpu_peak(task, config).peak_bytes
    assert rel_error(est.peak_allocated_bytes, ref) < 0.03


def test_cuda_target_rounds_and_simulates_the_caching_allocator():
    est = estimate(lm_task(), batch_size=4, gpu="A100-80GB")
    assert est.device == "cuda" and est.modelled
    assert est.peak_allocated_bytes % 512 == 0
    assert est.peak_reserved_bytes is not None and est.peak_reserved_bytes >= est.peak_allocated_bytes
    # cuBLAS workspace is one allocation through the caching allocator, alive from the first GEMM.
    assert est.breakdown["workspace"] == est.workspace_bytes == 8_519_680
    assert est.context_bytes > 0
    hopper = estimate(lm_task(), batch_size=4, gpu="H100-80GB")
    assert hopper.breakdown["workspace"] == 32 * 2**20


def test_bf16_refused_on_a_card_without_it():
    with pytest.raises(ConfigError, match="bf16"):
        estimate(lm_task(), batch_size=4, precision="bf16", gpu="V100-32GB")


def test_block_stack_and_segment_selection():
    model = TinyLM(layers=6)
    assert find_block_stack(model) == list(model.blocks)
    assert select_blocks(6, 0) == []
    assert select_blocks(6, 6) == list(range(6))
    assert select_blocks(6, 3) == [0, 2, 4]
    assert apply_checkpointing(model, 3) == 3
    keys = set(model.state_dict())
    assert "blocks.0.fc1.weight" in keys  # names unchanged by checkpointing
    with pytest.raises(ConfigError, match="blocks"):
        apply_checkpointing(TinyLM(layers=2), 3)


def test_batch_one_below_the_anchors_is_exact():
    # oneDNN picks other convolution algorithms at batch 1 than at the measured anchors.
    task = cnn_task()
    config = TrainConfig(micro_batch_size=1, grad_accum_steps=2)
    est = Estimator(task, device="cpu").estimate(config)
    ref = measure_cpu_peak(task, config).peak_bytes
    assert rel_error(est.peak_allocated_bytes, ref) < 0.01, (est.peak_allocated_bytes, ref)


def test_checkpointing_rng_states_are_counted():
    # torch.utils.checkpoint saves the CPU RNG state (5,056 bytes) per checkpointed block,
    # built outside the dispatcher; the trace records it, so the prediction is exact.
    task = lm_task()
    config = TrainConfig(micro_batch_size=8, checkpoint_segments=4)
    est = Estimator(task, device="cpu").estimate(config, exact=True)
    ref = measure_cpu_peak(task, config).peak_bytes
    assert abs(est.peak_allocated_bytes - ref) < 5056, (est.peak_allocated_bytes, ref)


def test_a_kernel_missing_for_a_precision_says_so():
    class NoBf16(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled("cpu"):
                raise RuntimeError("could not create a primitive descriptor for an LSTM forward propagation primitive")
            return self.fc(x)
    task = Task(name="nobf16", build_model=NoBf16,
                sample_fn=lambda b: (torch.randn(b, 4), torch.randint(0, 3, (b,))))
    with pytest.raises(ModelFileError, match="not supported on this device in bf16-mixed.*another precision") as info:
        Estimator(task, device="cpu").estimate(TrainConfig(micro_batch_size=4, precision="bf16-mixed"), exact=True)
    assert "\n" not in str(info.value)
    assert "train_data()" not in str(info.value)


def _count_traces(monkeypatch) -> list[int]:
    import estimators.estimator._traces as est_mod
    seen: list[int] = []
    original = est_mod.trace_step

    def counted(task, config, **kwargs):
        seen.append(kwargs.get("batch_size") or config.micro_batch_size)
        return original(task, config, **kwargs)

    monkeypatch.setattr(est_mod, "trace_step", counted)
    return seen


def test_cuda_targets_anchor_at_batch_one(monkeypatch):
    seen = _count_traces(monkeypatch)
    estimator = Estimator(lm_task(), gpu="A100-80GB")
    one = estimator.estimate(TrainConfig(micro_batch_size=1))
    seven = estimator.estimate(TrainConfig(micro_batch_size=7))
    assert sorted(seen) == [1, 2, 3]  # batch 1 is an anchor, 7 is scaled from them
    assert seven.method == "scaled"
    exact = Estimator(lm_task(), gpu="A100-80GB")
    assert exact.estimate(TrainConfig(micro_batch_size=1), exact=True).peak_bytes == one.peak_bytes
    assert exact.estimate(TrainConfig(micro_batch_size=7), exact=True).peak_bytes == seven.peak_bytes


def test_a_model_refusing_batch_one_anchors_at_two(monkeypatch):
    # BatchNorm1d cannot train on one sample: the anchors move to 2, 3, 4.
    task = Task(name="bn", build_model=lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)),
                sample_fn=lambda b: (torch.randn(b, 8), torch.randint(0, 2, (b,))))
    seen = _count_traces(monkeypatch)
    estimator = Estimator(task, gpu="A100-80GB")
    six = estimator.estimate(TrainConfig(micro_batch_size=6))
    assert six.method == "scaled" and {2, 3, 4} <= set(seen)
    assert six.peak_bytes == Estimator(task, gpu="A100-80GB").estimate(TrainConfig(micro_batch_size=6), exact=True).peak_bytes


def test_slow_traces_share_anchors_with_a_worker_process(monkeypatch):
    import estimators.estimator._prefetch as est_mod
    from estimators.tracing._trace_worker import worker_available
    assert worker_available()  # Linux: the path CI and users take
    monkeypatch.setattr(est_mod, "PARALLEL_TRACE_S", 0.0)  # every model counts as large
    started = []
    original = est_mod.TraceWorker

    class Counted(original):  # type: ignore[misc, valid-type]
        def __init__(self, task):
            started.append(task.name)
            super().__init__(task)

    monkeypatch.setattr(est_mod, "TraceWorker", Counted)
    parallel = Estimator(lm_task(), gpu="A100-80GB")
    configs = [TrainConfig(micro_batch_size=5), TrainConfig(micro_batch_size=9, precision="bf16-mixed"),
               TrainConfig(micro_batch_size=6, checkpoint_segments=2)]
    got = [parallel.estimate(c) for c in configs]
    assert started == ["tinylm"] and parallel._traces._worker is not None
    proc = parallel._traces._worker._proc
    parallel.close()
    assert parallel._traces._worker is None and not proc.is_alive()
    monkeypatch.setattr(est_mod, "PARALLEL_TRACE_S", float("inf"))
    alone = Estimator(lm_task(), gpu="A100-80GB")
    for config, estimate in zip(configs, got):
        ref = alone.estimate(config)
        assert (estimate.peak_bytes, estimate.breakdown, estimate.step_time_s) == \
            (ref.peak_bytes, ref.breakdown, ref.step_time_s)
    # A model refusing batch 1 fails in the worker as here: the anchors still move to 2, 3, 4.
    monkeypatch.setattr(est_mod, "PARALLEL_TRACE_S", 0.0)
    bn = Task(name="bn", build_model=lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2)),
              sample_fn=lambda b: (torch.randn(b, 8), torch.randint(0, 2, (b,))))
    estimator = Estimator(bn, gpu="A100-80GB")
    assert estimator.estimate(TrainConfig(micro_batch_size=6)).method == "scaled"
    estimator.close()


def test_a_dying_trace_worker_leaves_the_estimate_to_this_process(monkeypatch):
    import estimators.estimator._prefetch as est_mod
    monkeypatch.setattr(est_mod, "PARALLEL_TRACE_S", 0.0)
    original_submit = est_mod.TraceWorker.submit

    def submit_then_die(self, config, batch_size, target, *rest):
        original_submit(self, config, batch_size, target, *rest)
        self._proc.kill()

    monkeypatch.setattr(est_mod.TraceWorker, "submit", submit_then_die)
    estimator = Estimator(lm_task(), gpu="A100-80GB")
    got = estimator.estimate(TrainConfig(micro_batch_size=6))
    assert estimator._traces._worker is None and estimator._traces._worker_failed
    ref = Estimator(lm_task(), gpu="A100-80GB").estimate(TrainConfig(micro_batch_size=6), exact=True)
    assert got.method == "scaled" and got.peak_bytes == ref.peak_bytes


@pytest.mark.parametrize("device,gpu", [("cuda", "A100-80GB"), ("cpu", None)])
def test_expected_space_traces_each_shape_once(monkeypatch, device, gpu):
    # Under a fixed global batch, accumulation 1 is asked at one micro-batch size: its anchors
    # are derived from the accumulating anchors' traces instead of traced.
    import estimators.estimator._prefetch
    import estimators.estimator._traces as est_mod
    calls = []
    original = est_mod.trace_step

    def counted(task, config, **kwargs):
        if not kwargs.get("real"):
            calls.append((config.grad_accum_steps, kwargs.get("batch_size")))
        return original(task, config, **kwargs)

    monkeypatch.setattr(est_mod, "trace_step", counted)
    monkeypatch.setattr(estimators.estimator._prefetch, "PARALLEL_TRACE_S", float("inf"))  # every trace in this process
    space = [TrainConfig(micro_batch_size=m, grad_accum_steps=12 // m) for m in (1, 2, 3, 4, 6, 12)]
    estimator = Estimator(lm_task(), device=device, gpu=gpu)
    estimator.expect(space)
    got = {c: estimator.estimate(c) for c in space}
    assert all(accum >= 2 for accum, _ in calls) and len(calls) == 3  # the anchors, once
    assert got[space[-1]].method == "scaled"
    exact = Estimator(lm_task(), device=device, gpu=gpu).estimate(space[-1], exact=True)
    assert (got[space[-1]].peak_bytes, got[space[-1]].peak_reserved_bytes, got[space[-1]].breakdown) == \
        (exact.peak_bytes, exact.peak_reserved_bytes, exact.breakdown)
    # Without the accumulating shapes to share, a shape asked at one size is traced exactly.
    alone = Estimator(lm_task(), device=device, gpu=gpu)
    alone.expect(space[-1:])
    calls.clear()
    assert alone.estimate(space[-1]).method == "traced" and calls == [(1, 12)]


@pytest.mark.parametrize("device,gpu", [("cuda", "A100-80GB"), ("cpu", None)])
def test_prefetched_space_estimates_as_traced_alone(device, gpu):
    from estimators.tracing._trace_worker import worker_available
    assert worker_available()
    space = [TrainConfig(micro_batch_size=m, grad_accum_steps=8 // m, precision=p, checkpoint_segments=s)
             for m in (1, 2, 4, 8) for p in ("fp32", "bf16-mixed") for s in (0, 2)]
    prefetched = Estimator(lm_task(), device=device, gpu=gpu)
    prefetched.expect(space, prefetch=True)
    assert prefetched._traces._pending and prefetched._traces._worker is not None  # the worker has a queue
    got = [prefetched.estimate(c) for c in space]
    assert not prefetched._traces._pending
    prefetched.close()
    alone = Estimator(lm_task(), device=device, gpu=gpu)
    alone.expect(space)
    for config, estimate in zip(space, got):
        ref = alone.estimate(config)
        assert (estimate.peak_bytes, estimate.breakdown, estimate.step_time_s, estimate.method) == \
            (ref.peak_bytes, ref.breakdown, ref.step_time_s, ref.method), config


def test_prefetch_survives_its_worker_dying():
    space = [TrainConfig(micro_batch_size=m, grad_accum_steps=8 // m, checkpoint_segments=s)
             for m in (1, 2, 4, 8) for s in (0, 2)]
    estimator = Estimator(lm_task(), gpu="A100-80GB")
    estimator.expect(space, prefetch=True)
    assert estimator._traces._worker is not None
    estimator._traces._worker._proc.kill()
    got = [estimator.estimate(c) for c in space]
    assert estimator._traces._worker is None and estimator._traces._worker_failed and not estimator._traces._pending
    alone = Estimator(lm_task(), gpu="A100-80GB")
    assert [g.peak_bytes for g in got] == [alone.estimate(c).peak_bytes for c in space]


def _count_prefetch(monkeypatch) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Fake traces run in this process and traces handed to the worker, as
    (accumulation, checkpoint segments, batch)."""
    import estimators.estimator._traces as est_mod
    from estimators.tracing._trace_worker import TraceWorker
    local, remote = [], []
    original_trace, original_submit = est_mod.trace_step, TraceWorker.submit

    def traced(task, config, **kwargs):
        if not kwargs.get("real"):
            local.append((min(config.grad_accum_steps, 2), config.checkpoint_segments, kwargs.get("batch_size")))
        return original_trace(task, config, **kwargs)

    def submitted(self, config, batch_size, target, *rest):
        remote.append((min(config.grad_accum_steps, 2), config.checkpoint_segments, batch_size))
        return original_submit(self, config, batch_size, target, *rest)

    monkeypatch.setattr(est_mod, "trace_step", traced)
    monkeypatch.setattr(TraceWorker, "submit", submitted)
    return local, remote


def test_prefetch_queue_is_shared_by_both_processes(monkeypatch):
    # A GPU target has no real runs: this process takes traces from the queue's end while
    # the worker takes them from its front, and no trace is done twice.
    local, remote = _count_prefetch(monkeypatch)
    space = [TrainConfig(micro_batch_size=m, grad_accum_steps=8 // m, checkpoint_segments=s)
             for m in (1, 2, 4, 8) for s in (0, 1, 2, 4)]
    estimator = Estimator(lm_task(), gpu="A100-80GB")
    estimator.expect(space, prefetch=True)
    planned = len(estimator._traces._queue) + len(estimator._traces._pending)
    assert len(estimator._traces._pending) == 2 and remote  # the worker is kept two traces ahead
    got = [estimator.estimate(c) for c in space]
    estimator.close()
    assert local and remote and len(local) + len(remote) == planned
    assert len(set(local + remote)) == planned
    alone = Estimator(lm_task(), gpu="A100-80GB")
    assert [g.peak_bytes for g in got] == [alone.estimate(c).peak_bytes for c in space]


def test_prefetch_checks_affinity_on_one_shape_whatever_is_asked_first(monkeypatch):
    # The prefetch traces three anchors for one shape; asking another shape first must not
    # trace a third anchor for it too.
    local, remote = _count_prefetch(monkeypatch)
    space = [TrainConfig(micro_batch_size=m, grad_accum_steps=16 // m, checkpoint_segments=s)
             for s in (0, 2) for m in (2, 4, 8, 16)]
    estimator = Estimator(lm_task(), device="cpu")
    estimator.expect(space, prefetch=True)
    for config in reversed(space):  # the other shape first
        estimator.estimate(config)
    estimator.close()
    middle = [t for t in local + remote if t[2] == 3]
    assert len(middle) == 1 and middle[0][1] == 0
    assert estimator._scaler._affine is True
