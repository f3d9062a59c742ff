"""What the search's tests share: the CPU's rates pinned, and a fake probe that answers the
estimate (one estimator per task, kept for the session)."""

from __future__ import annotations

from typing import Any

from estimators import Task, TrainConfig
from estimators.timing._timing import DeviceRates

__all__ = ["PINNED_RATES", "probe_estimator", "measured_probe"]

# The CPU's rates, pinned: measured ones move with the machine's load, and with them the
# predicted order of near ties (lm()'s micro-batch 8 with one checkpoint segment against
# 4 x2), which the tests of races and walks start from. These are this machine's, rounded,
# without the per-op-class rates.
PINNED_RATES = DeviceRates("pinned-cpu", {"float32": 8e10, "bfloat16": 1e10, "float16": 3e9}, 2e10, 1.5e-5, {})


# The fake probes' estimators, one per task for the module: an estimate is a function of the task
# and the configuration alone, and a fresh estimator for each probe traced the task and measured
# its kernel workspaces again (two thirds of this module's time).
PROBE_ESTIMATORS: dict[int, tuple[Task, Any]] = {}


def probe_estimator(task: Task):
    from estimators import Estimator

    hit = PROBE_ESTIMATORS.get(id(task))
    if hit is None or hit[0] is not task:
        hit = PROBE_ESTIMATORS[id(task)] = (task, Estimator(task, device="cpu"))
    return hit[1]


def measured_probe(calls: list[TrainConfig], speedup: dict[int, float]):
    """A probe answering the estimate, the n-th call's step divided by ``speedup[n]``."""
    from dataclasses import replace

    from estimators.probing._probe import ProbeResult

    def fake_probe(task, config: TrainConfig, budget: int):
        calls.append(config)
        est = probe_estimator(task).estimate(config)
        step = est.step_time_s / speedup.get(len(calls), 1.0)
        measured = replace(est, method="measured", step_time_s=step, samples_per_s=config.global_batch / step)
        return ProbeResult(status="ok", estimate=measured, message="", overhead_s=0.0, wall_s=0.0)
    return fake_probe
