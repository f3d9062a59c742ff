"""Per-rank memory of the 2-D layouts -- tensor parallelism (alone and under FSDP2) and HSDP --:
the one-process fake trace against real gloo ranks, and fake traces at degrees no test machine
runs."""

from __future__ import annotations

import pytest
from helpers.lm import ATTENTION_LM_SOURCE

from estimators import ConfigError, Estimator, TrainConfig, load_task
from estimators.probing._measure import measure_distributed_peaks
from estimators.runtime._checkpoint import find_block_stack

pytestmark = pytest.mark.distributed

TP = [
    TrainConfig(micro_batch_size=16, tp=2),
    TrainConfig(micro_batch_size=16, tp=2, precision="bf16-mixed", grad_accum_steps=3, checkpoint_segments=2),
    # Sequence parallel: fp32 ranks measured the prediction to the byte, checkpointed or not,
    # while the head was replicated; its split adds collectives whose buffers a gloo rank may
    # hold (see _in_flight). With accumulation a gloo rank also holds the inputs of the gathers and reduce-scatters
    # it has not waited for yet, more of them the busier the machine (+6% on an idle one, +24%
    # on one running the suite: benchmarks/results/tensor_parallel_memory.md); NCCL frees them
    # as the trace does. The bf16 accumulating case is bounded under FSDP2 x TP below.
    TrainConfig(micro_batch_size=16, tp=2, sequence_parallel=True),
    TrainConfig(micro_batch_size=16, tp=2, sequence_parallel=True, checkpoint_segments=2),
]
FSDP_TP = [
    TrainConfig(micro_batch_size=16, tp=2, strategy="fsdp", world_size=2),
    TrainConfig(micro_batch_size=16, tp=2, strategy="fsdp", world_size=2, precision="bf16-mixed", grad_accum_steps=3,
                checkpoint_segments=2, sequence_parallel=True),
]


# HSDP: 2 groups of 2 FSDP2 ranks, on the same 4 processes as FSDP2 x TP.
HSDP = [
    TrainConfig(micro_batch_size=16, strategy="fsdp", world_size=4, dp_replicate=2),
    TrainConfig(micro_batch_size=16, strategy="fsdp", world_size=4, dp_replicate=2, precision="bf16-mixed",
                grad_accum_steps=3, checkpoint_segments=2),
]


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tp") / "lm.py"
    path.write_text(ATTENTION_LM_SOURCE)
    return str(path)


@pytest.fixture(scope="module")
def estimator(lm_path: str) -> Estimator:
    return Estimator(load_task(lm_path), device="cpu")


@pytest.fixture(scope="module")
def measured(lm_path: str):
    # One set of processes per number of ranks: spawning costs more than the steps.
    return {**dict(zip(TP, measure_distributed_peaks(lm_path, TP))),
            **dict(zip(FSDP_TP + HSDP, measure_distributed_peaks(lm_path, FSDP_TP + HSDP)))}


def _activation_bytes(config: TrainConfig) -> int:
    """One all-reduced activation of the model: micro-batch x 64 tokens x width 64, fp32."""
    return config.micro_batch_size * 64 * 64 * 4


def _logits_bytes(config: TrainConfig) -> int:
    """The whole logits: micro-batch x 64 tokens x vocabulary 256, fp32."""
    return config.micro_batch_size * 64 * 256 * 4


def _in_flight(model, config: TrainConfig) -> int:
    """What a gloo rank may still hold of the collectives it is finishing on its own thread
    (NCCL holds none): one fp32 copy of the gradients, two all-reduced activations, and, since
    the head is split over the vocabulary, the buffers of its collectives (the loss's
    reductions over the shards, its input's gradient summed over the ranks), up to twice the
    whole logits: measured up to 1.57 MB on an idle machine and 2.36 MB beside the suite, with
    sequence parallelism (benchmarks/results/tensor_parallel_memory.md)."""
    return 4 * sum(p.numel() for p in model.parameters()) + 2 * _activation_bytes(config) + 2 * _logits_bytes(config)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("config", TP, ids=[c.describe() for c in TP])
def test_tensor_parallel_rank_peak_matches_real_gloo_ranks(config, estimator, measured):
    est = estimator.estimate(config, exact=True)
    assert est.method == "traced"
    peaks = [m.peak_bytes for m in measured[config]]
    # A rank's peak is the trace's to the byte unless gloo still holds the buffers of the
    # collectives it is finishing on its own thread (NCCL holds none): bounded by _in_flight.
    model = estimator.task.build_model()
    in_flight = _in_flight(model, config)
    for peak in peaks:
        assert est.peak_allocated_bytes * 0.99 <= peak <= est.peak_allocated_bytes + in_flight


@pytest.mark.timeout(180)
@pytest.mark.parametrize("config", FSDP_TP, ids=[c.describe() for c in FSDP_TP])
def test_fsdp_and_tensor_parallel_rank_peak_matches_real_gloo_ranks(config, estimator, measured):
    est = estimator.estimate(config, exact=True)
    assert est.method == "traced"
    # As for FSDP2 alone (test_distributed_estimate): a gloo rank may also hold the gradients
    # its reduce-scatters are working on and one unit's gathered parameters and gradients.
    model = estimator.task.build_model()
    in_flight = _in_flight(model, config)
    unit = max(sum(p.numel() for p in b.parameters()) for b in find_block_stack(model))
    in_flight += unit * (4 + (2 if config.precision != "fp32" else 4))
    for m in measured[config]:
        assert est.peak_allocated_bytes * 0.99 <= m.peak_bytes <= est.peak_allocated_bytes + in_flight


@pytest.mark.timeout(180)
@pytest.mark.parametrize("config", HSDP, ids=[c.describe() for c in HSDP])
def test_hsdp_rank_peak_matches_real_gloo_ranks(config, estimator, measured):
    est = estimator.estimate(config, exact=True)
    assert est.method == "traced"
    # A rank holds what FSDP2 over its group of 2 holds (the states are halved, not quartered)...
    plain = estimator.estimate(config.replace(world_size=2, dp_replicate=1), exact=True)
    assert est.breakdown["params"] == plain.breakdown["params"]
    assert est.breakdown["optimizer"] == plain.breakdown["optimizer"]
    # ... and, on gloo, what FSDP2 may hold in flight (test_distributed_estimate): one fp32 copy
    # of the gradients, one unit's gathered parameters and gradients.
    model = estimator.task.build_model()
    in_flight = 4 * sum(p.numel() for p in model.parameters())
    unit = max(sum(p.numel() for p in b.parameters()) for b in find_block_stack(model))
    in_flight += unit * (4 + (2 if config.precision != "fp32" else 4))
    for m in measured[config]:
        assert est.peak_allocated_bytes * 0.99 <= m.peak_bytes <= est.peak_allocated_bytes + in_flight


@pytest.mark.timeout(120)
def test_a_rank_holds_less_as_the_degree_grows(tmp_path):
    # Fake traces at degrees 1, 2 and 8, in this one process (8 heads, 128 wide).
    path = tmp_path / "lm8.py"
    path.write_text(ATTENTION_LM_SOURCE.replace("d=64, n_heads=4", "d=128, n_heads=8"))
    est = Estimator(load_task(path), device="cpu")
    model = est.task.build_model()
    # The block linears and the head (split over the vocabulary).
    split = sum(p.numel() for n, p in model.named_parameters() if "proj" in n or n.startswith("head."))
    rest = sum(p.numel() for p in model.parameters()) - split
    peaks = []
    for tp in (1, 2, 8):
        e = est.estimate(TrainConfig(micro_batch_size=16, tp=tp), exact=True)
        assert e.method == "traced"
        # Each rank holds 1/tp of the split linears and the head, and all of the rest.
        assert e.breakdown["params"] == 4 * (split // tp + rest)
        peaks.append(e.peak_allocated_bytes)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < 0.6 * peaks[0]
    with pytest.raises(ConfigError, match="n_heads is 8, which tp 16 does not divide"):
        est.estimate(TrainConfig(micro_batch_size=16, tp=16), exact=True)


def test_the_split_heads_logits_are_a_ranks_share_unless_the_loss_needs_them_whole(tmp_path):
    # The default cross entropy runs on the vocabulary's shards (loss_parallel): no rank makes
    # the whole logits. With label smoothing (which loss_parallel does not do) the head's output
    # is gathered, as a replicated head's: the same split weights, the whole logits.
    from estimators.tracing._trace import trace_step

    sharded, smoothed = tmp_path / "lm.py", tmp_path / "smoothed.py"
    sharded.write_text(ATTENTION_LM_SOURCE)
    smoothed.write_text(ATTENTION_LM_SOURCE + "\nsettings = {'label_smoothing': 0.1}\n")
    config = TrainConfig(micro_batch_size=16, tp=2)
    logits = 16 * 64 * 256 * 4  # micro-batch x sequence x vocabulary, fp32
    split, whole = (set(trace_step(load_task(p), config, target="cuda").alloc_bytes.tolist())
                    for p in (sharded, smoothed))
    assert logits // 2 in split and logits not in split
    assert logits in whole
    peaks = [Estimator(load_task(p), gpu="H100-80GB").estimate(config, exact=True).peak_allocated_bytes
             for p in (sharded, smoothed)]
    assert peaks[0] < peaks[1] - logits // 2, peaks
