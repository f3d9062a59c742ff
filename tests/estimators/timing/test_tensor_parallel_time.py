"""Tensor parallelism's collectives are priced from the trace's own collective ops, on the
node's link, and none of them is hidden by compute."""

from __future__ import annotations

import re

import pytest
from helpers.lm import ATTENTION_LM_SOURCE

from estimators import Estimator, TrainConfig, load_task
from estimators.hardware._gpus import get_gpu
from estimators.timing._comm import all_gather_s, all_reduce_s, ring_bandwidth, tensor_parallel_comm


def test_each_collective_is_priced_by_its_volume_and_runs() -> None:
    link = ring_bandwidth(get_gpu("H100-80GB"), 1)
    n = 8 * 2**20
    comm = tensor_parallel_comm(
        ["_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default",
         "_c10d_functional.all_gather_into_tensor.default"],
        [2.0 * n, float(n), n / 4 + n], [3.0, 3.0, 2.0], 4, link)
    assert comm.total_s == pytest.approx(3 * all_reduce_s(n, 4, link) + 2 * all_gather_s(n, 4, link))
    assert comm.exposed_s == comm.total_s


@pytest.mark.timeout(120)
def test_a_tensor_parallel_estimate_adds_its_collectives_to_the_step(write_model) -> None:
    path = write_model(ATTENTION_LM_SOURCE.replace("d=64, n_heads=4", "d=256, n_heads=8"))
    est = Estimator(load_task(path), gpu="H100-80GB")
    one = est.estimate(TrainConfig(micro_batch_size=8, precision="bf16-mixed"), exact=True)
    assert one.time_parts is not None and one.time_parts["fixed"] == 0
    ms = []
    for tp in (2, 4):
        e = est.estimate(TrainConfig(micro_batch_size=8, precision="bf16-mixed", tp=tp), exact=True)
        note = next(n for n in e.notes if n.startswith("communication"))
        total, exposed = map(float, re.findall(r"([\d.]+) ms", note))
        assert total == exposed > 0  # eager tensor parallelism waits for every collective
        assert e.time_parts is not None and e.time_parts["fixed"] == pytest.approx(exposed / 1e3, rel=0.01)
        ms.append(total)
    # Per layer, two all-reduces of one activation forward and two backward: the volume per
    # rank grows with (tp - 1) / tp, the ring steps with tp.
    assert ms[1] > ms[0]
