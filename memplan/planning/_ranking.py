"""Ranking the configurations, and the Plan that holds them.

Before any probe, by predicted speed (equal predictions rank the simpler configuration
first); after probes and races, measured figures first, the unprobed configurations' times
refitted by what was measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from estimators import Estimate, Estimator, Task, TrainConfig

from ._failures import summarize_failures
from ._plan import Plan, PlanEntry, provenance

__all__ = ["rank_predicted", "rank_measured", "build_plan"]


def rank_predicted(feasible: list[Estimate]) -> list[PlanEntry]:
    """The feasible configurations, fastest predicted first."""
    # Equal predictions (checkpointing a block whose backward needs only its inputs costs
    # nothing) rank the simpler configuration first: fewer checkpoints, fewer micro-batches.
    feasible = sorted(feasible, key=lambda e: (-(e.samples_per_s or 0.0), e.config.checkpoint_segments,
                                               e.config.grad_accum_steps))
    return [PlanEntry(config=e.config, predicted=e) for e in feasible]


def rank_measured(estimator: Estimator, probed: list[PlanEntry], raced: list[PlanEntry], rest: list[PlanEntry],
                  kept: tuple[TrainConfig, TrainConfig] | None) -> list[PlanEntry]:
    """The ranking after the probes: ``probed`` (measured), ``raced`` (timed by a race, memory
    unmeasured) and ``rest`` (not measured); ``kept`` is a pair (upper, lower) whose predicted
    order the confirmation kept against figures that could not tell the two apart."""
    rest = raced + rest
    # Unprobed configurations get the time model refitted by the probes and races (from
    # their predictions' stored parts: a resumed study's configurations are not traced again).
    timed_by_race = {e.config for e in raced if e.source == "raced"}
    refreshed = [e if e.config in timed_by_race else
                 PlanEntry(config=e.config, predicted=estimator.recalibrated(e.predicted), probe_status=e.probe_status)
                 for e in rest]
    measured_sorted = sorted(probed, key=lambda e: -e.samples_per_s)
    if kept is not None:
        # The confirmation kept the predicted order against figures that could not tell the
        # two apart: the first goes just above the second, and no further (the figures shown
        # stay as measured).
        upper, lower = (next(e for e in measured_sorted if e.config == c) for c in kept)
        if measured_sorted.index(upper) > measured_sorted.index(lower):
            measured_sorted.remove(upper)
            measured_sorted.insert(measured_sorted.index(lower), upper)
    best_measured = measured_sorted[0].samples_per_s if measured_sorted else 0.0
    # Measured figures come first; an unmeasured configuration ranks above them only if its
    # (calibrated) prediction beats the best measurement.
    ahead = [e for e in refreshed if e.samples_per_s > best_measured and not measured_sorted]
    behind = [e for e in refreshed if e not in ahead]
    return ahead + measured_sorted + sorted(behind, key=lambda e: -e.samples_per_s)


def build_plan(task: Task, estimator: Estimator, entries: Sequence[PlanEntry], *, budget: int, margin: float,
               global_batch: int | None, tried: int, failed: Mapping[TrainConfig, str],
               notes: Sequence[str], compile: bool | None = None) -> Plan:
    """The Plan of the ranked ``entries``, its notes closed by one line on the failures."""
    summary = summarize_failures(failed)
    gpu = estimator.spec.name if estimator.spec else None
    return Plan(
        entries=tuple(entries),
        budget_bytes=budget,
        margin=margin,
        device=estimator.device,
        gpu=gpu,
        global_batch=global_batch,
        trials=tried,
        failures=failed,
        provenance=provenance(device=estimator.device, gpu=gpu,
                              source_hash=task.source_hash, source_path=task.source_path),
        notes=(*notes, *((summary,) if summary else ())),
        compile=compile,
    )
