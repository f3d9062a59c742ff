"""A pipeline's step: its busiest stage's compute, the bubble the schedule leaves, and the
transfers between stages on the fill and drain path."""

from __future__ import annotations

import pytest
from helpers.lm import ATTENTION_LM_SOURCE

from estimators import Estimator, TrainConfig, load_task
from estimators.hardware._gpus import get_gpu
from estimators.timing._comm import pipeline_time, ring_bandwidth


def test_the_bubble_is_the_schedules_and_the_transfers_hide_but_for_fill_and_drain() -> None:
    link = ring_bandwidth(get_gpu("H100-80GB"), 1)
    one = 2**20 / link[0] + link[1]  # one micro-batch's activations, one way
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
        config = TrainConfig(micro_batch_size=4, pp=4, pp_schedule=schedule, pp_microbatches=8)
        t = pipeline_time(1.0, config, 2**20, link)
        bubble = 3 / (v * 8)
        assert t.exposed_s == pytest.approx(bubble + 2 * 3 * one)
        assert t.total_s == pytest.approx(bubble + 2 * 8 * v * one)
    # More micro-batches, a smaller bubble.
    few = pipeline_time(1.0, TrainConfig(micro_batch_size=4, pp=4, pp_microbatches=4), 0, link)
    many = pipeline_time(1.0, TrainConfig(micro_batch_size=4, pp=4, pp_microbatches=16), 0, link)
    assert few.exposed_s == pytest.approx(0.75) and many.exposed_s == pytest.approx(3 / 16)


@pytest.mark.timeout(120)
def test_a_pipeline_estimate_runs_at_its_stages_pace_plus_the_bubble(write_model) -> None:
    path = write_model(ATTENTION_LM_SOURCE.replace("layers=3", "layers=4").replace("d=64, n_heads=4",
                                                                                    "d=128, n_heads=8"))
    est = Estimator(load_task(path), gpu="H100-80GB")
    whole = est.estimate(TrainConfig(micro_batch_size=4, grad_accum_steps=8, precision="bf16-mixed"), exact=True)
    piped = {s: est.estimate(TrainConfig(micro_batch_size=4, pp=2, pp_schedule=s, pp_microbatches=8,
                                         precision="bf16-mixed"), exact=True)
             for s in ("gpipe", "1f1b", "interleaved-1f1b")}
    for s, e in piped.items():
        note = next(n for n in e.notes if n.startswith("pipeline: 2 stages"))
        assert "8 micro-batches" in note and "MB sent each way" in note
        assert e.time_parts is not None and e.time_parts["fixed"] > 0  # the bubble and the imbalance
        # Each stage computes about half the model (this small one's ops are launch-bound), and
        # waits in the bubble: well below the one-device step, well above a third of it.
        assert 0.4 * whole.step_time_s < e.step_time_s < 0.8 * whole.step_time_s, s
    # Two stages a process halve the bubble.
    assert piped["interleaved-1f1b"].time_parts["fixed"] < piped["1f1b"].time_parts["fixed"]
