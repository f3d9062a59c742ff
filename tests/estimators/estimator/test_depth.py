"""Estimates of a deep block stack composed from cut traces against estimates of the whole model's
trace (``Estimator(compose_blocks=False)``, or ``MEMPLAN_FULL_TRACE=1``): the same peaks, allocated
and reserved, and the same step time."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from estimators import Estimate, Estimator, Task, TrainConfig

ROOT = Path(__file__).resolve().parents[3]


def _llama(layers: int) -> Task:
    spec = importlib.util.spec_from_file_location("models_large", ROOT / "benchmarks" / "models_large.py")
    assert spec is not None and spec.loader is not None
    large = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(large)
    vocab, seq = 256, 32

    def data() -> TensorDataset:
        tokens = torch.randint(0, vocab, (16, seq + 1), generator=torch.Generator().manual_seed(0))
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    return Task(name=f"llama{layers}", build_model=lambda: large.Llama3(layers, 64, 4, 2, 128, vocab, False, 1e4, seq),
                train_data=data, checkpoint_blocks=lambda m: list(m.layers))


def _same(composed: Estimate, whole: Estimate) -> None:
    assert composed.peak_allocated_bytes == whole.peak_allocated_bytes
    assert composed.peak_reserved_bytes == whole.peak_reserved_bytes
    assert composed.host_bytes == whole.host_bytes
    assert dict(composed.breakdown) == dict(whole.breakdown) and composed.peak_phase == whole.peak_phase
    assert composed.step_time_s == pytest.approx(whole.step_time_s, rel=1e-12)


@pytest.fixture(scope="module")
def deep() -> Task:
    return _llama(12)  # deep enough that the cuts (4 and 3, or 6 and 5 blocks) gain


@pytest.mark.parametrize("config", [
    TrainConfig(micro_batch_size=2),
    TrainConfig(micro_batch_size=2, precision="bf16-mixed", checkpoint_segments=4),
    pytest.param(TrainConfig(micro_batch_size=2, precision="bf16-mixed", strategy="fsdp", world_size=2,
                             checkpoint_segments=12), marks=pytest.mark.slow),
], ids=["fp32", "bf16-mixed-4-checkpointed", "fsdp2-checkpointed"])
def test_a_cuda_estimate_is_the_whole_traces(deep: Task, config: TrainConfig) -> None:
    composed = Estimator(deep, gpu="A100-80GB").estimate(config, exact=True)
    whole = Estimator(deep, gpu="A100-80GB", compose_blocks=False).estimate(config, exact=True)
    assert any(n.startswith("block stack: 12 blocks composed") for n in composed.notes)
    assert not any(n.startswith("block stack") for n in whole.notes)
    _same(composed, whole)


@pytest.mark.slow
def test_a_cpu_estimate_is_the_whole_traces(deep: Task) -> None:
    # Slow: a CPU target measures its kernels' workspaces with real runs of the model.
    config = TrainConfig(micro_batch_size=4, checkpoint_segments=2)
    composed = Estimator(deep, device="cpu").estimate(config, exact=True)
    whole = Estimator(deep, device="cpu", compose_blocks=False).estimate(config, exact=True)
    assert any(n.startswith("block stack: 12 blocks composed") for n in composed.notes)
    _same(composed, whole)


def test_scaled_batches_compose_too(deep: Task) -> None:
    # Batch scaling fits its anchors, each composed; the scaled estimate is the whole trace's.
    config = TrainConfig(micro_batch_size=5, precision="bf16-mixed")
    composed = Estimator(deep, gpu="H100-80GB").estimate(config)
    whole = Estimator(deep, gpu="H100-80GB", compose_blocks=False).estimate(config, exact=True)
    assert composed.method == "scaled"
    _same(composed, whole)


def test_the_environment_turns_composition_off(deep: Task, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMPLAN_FULL_TRACE", "1")
    est = Estimator(deep, gpu="A100-80GB").estimate(TrainConfig(micro_batch_size=2), exact=True)
    assert not any(n.startswith("block stack") for n in est.notes)


@pytest.mark.slow
def test_a_hugging_face_decoder_composes() -> None:
    from helpers.hf import write_tiny

    from estimators import hf_task

    with tempfile.TemporaryDirectory() as folder:
        task = hf_task(str(write_tiny(Path(folder) / "llama", "llama", num_hidden_layers=12)), seq_len=16)
        config = TrainConfig(micro_batch_size=2, precision="bf16-mixed", checkpoint_segments=2)
        composed = Estimator(task, gpu="A100-80GB").estimate(config, exact=True)
        whole = Estimator(task, gpu="A100-80GB", compose_blocks=False).estimate(config, exact=True)
    assert any(n.startswith("block stack: 12 blocks composed") for n in composed.notes)
    _same(composed, whole)


@pytest.mark.slow
def test_the_benchmarks_deep_model_composes() -> None:
    # bert_large: 24 encoder blocks, 335M parameters (the only benchmark model deep enough).
    from estimators import load_task

    task = load_task(str(ROOT / "benchmarks/models/bert_large.py"))
    config = TrainConfig(micro_batch_size=2, precision="bf16-mixed", checkpoint_segments=8)
    composed = Estimator(task, gpu="A100-80GB").estimate(config, exact=True)
    whole = Estimator(task, gpu="A100-80GB", compose_blocks=False).estimate(config, exact=True)
    assert any(n.startswith("block stack: 24 blocks composed") for n in composed.notes)
    _same(composed, whole)


def test_stacks_checkpointed_alike_share_their_cuts(deep: Task, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 and 4 of 12 blocks checkpointed (C P P P P P C P P P P P and C P P C P P C P P C P P)
    # compose from the same cuts, C P P C P P and C P C P P: traced once.
    from estimators.estimator import _traces

    cuts: list[object] = []
    original = _traces.trace_step
    monkeypatch.setattr(_traces, "trace_step",
                        lambda task, config, **kw: cuts.append(kw.get("cut")) or original(task, config, **kw))
    estimator = Estimator(deep, gpu="A100-80GB")
    two, four = (estimator.estimate(TrainConfig(micro_batch_size=2, checkpoint_segments=s), exact=True) for s in (2, 4))
    assert len(cuts) == 2 and all(c is not None for c in cuts)
    whole = Estimator(deep, gpu="A100-80GB", compose_blocks=False)
    _same(four, whole.estimate(TrainConfig(micro_batch_size=2, checkpoint_segments=4), exact=True))
    assert two.host_bytes < four.host_bytes  # more checkpointed blocks save more RNG states: not one estimate twice
