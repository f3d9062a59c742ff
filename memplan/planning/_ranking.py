"""Ranking the configurations, and the Plan that holds them.

Before any probe, by predicted speed (equal predictions rank the simpler configuration
first); after probes and races, every figure on one basis (the measured best's figure, the
others' taken from it by races, or by the time model refitted with what was measured), and
the order the figures'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from estimators import Estimate, Estimator, Task, TrainConfig

from ._failures import summarize_failures
from ._plan import ANCHORED_NOTE, Plan, PlanEntry, provenance

__all__ = ["rank_predicted", "rank_measured", "build_plan"]


def rank_predicted(feasible: list[Estimate]) -> list[PlanEntry]:
    """The feasible configurations, fastest predicted first."""
    # Equal predictions (checkpointing a block whose backward needs only its inputs costs
    # nothing) rank the simpler configuration first: fewer checkpoints, fewer micro-batches.
    feasible = sorted(feasible, key=lambda e: (-(e.samples_per_s or 0.0), e.config.checkpoint_segments,
                                               e.config.grad_accum_steps))
    return [PlanEntry(config=e.config, predicted=e) for e in feasible]


_TIERS = ("measured", "raced", "probed", "predicted", "modelled")
"""Equal figures rank the better evidence first."""

_PREDICTED_TIE = 0.01
"""A prediction less than this share above the measured best's is a tie (as a race's): shown
equal to it, below it. A larger lead is raced (``._probes``) before the plan believes it."""


def rank_measured(estimator: Estimator, probed: list[PlanEntry], raced: list[PlanEntry], rest: list[PlanEntry],
                  kept: tuple[TrainConfig, TrainConfig] | None) -> list[PlanEntry]:
    """The ranking after the probes, every figure on one basis and the order theirs.

    ``probed`` are measured: the race's measured best alone (basis ``measured``), or, where
    no race ran, probes each in its own process (``probed``); ``raced`` were timed by races
    against it (their figures already taken from it: ``._races.raced_figures``); ``rest`` were
    not measured: their predictions, refitted by the measurements, are scaled so that the
    best measured configuration's prediction is its measured figure (``predicted``). ``kept``
    is a pair (upper, lower) whose predicted order the confirmation kept against probes that
    could not tell the two apart: the lower's figure is the upper's times their predictions'
    ratio. The entries are then ranked by their figures, the better evidence first at equal
    figures; an unmeasured configuration the refitted model puts above the measured best
    ranks there (``._probes`` races it first where it can)."""
    # Unprobed configurations get the time model refitted by the probes and races (from
    # their predictions' stored parts: a resumed study's configurations are not traced again).
    timed_by_race = [e for e in raced if e.source == "raced"]
    refreshed = [PlanEntry(config=e.config, predicted=estimator.recalibrated(e.predicted), probe_status=e.probe_status)
                 for e in raced + rest if e not in timed_by_race]
    measured = [e if e.basis == "measured" else replace(e, basis="probed") for e in probed]
    if kept is not None:
        measured = _kept_below(measured, *kept)
    anchor = max(measured, key=lambda e: (e.samples_per_s, e.source == "measured"), default=None)
    if anchor is not None:
        scale = _anchor_scale(estimator, anchor)
        refreshed = [_anchored(e, anchor, scale) for e in refreshed] if scale is not None else refreshed
        refreshed = [_tied(e, anchor) for e in refreshed]
    entries = [*measured, *timed_by_race, *refreshed]
    return sorted(entries, key=lambda e: (-e.samples_per_s, _tier(e), e.config.checkpoint_segments,
                                          e.config.grad_accum_steps))


def _tier(entry: PlanEntry) -> int:
    source = entry.source
    return _TIERS.index(source) if source in _TIERS else len(_TIERS)


def _kept_below(measured: list[PlanEntry], upper: TrainConfig, lower: TrainConfig) -> list[PlanEntry]:
    """``measured`` with ``lower``'s figure the ``upper``'s times their predictions' ratio: its
    probes could not tell it from ``upper``, and the prediction that ranks it lower decides."""
    up = next(e for e in measured if e.config == upper)
    assert up.measured is not None
    out = []
    for e in measured:
        if e.config == lower and e.measured is not None:
            ratio = _speed(e.predicted) / _speed(up.predicted) if _speed(up.predicted) else 1.0
            ratio = min(ratio, 1.0)
            note = (f"{ANCHORED_NOTE} ratio to {upper.describe()}, on its probes' figure: the two's probes could "
                    f"not tell them apart ({ratio:.2f}x)")
            step = float(up.measured.step_time_s or 0.0) / ratio if ratio else None
            e = replace(e, basis="predicted",
                        measured=replace(e.measured, step_time_s=step, samples_per_s=up.samples_per_s * ratio,
                                         notes=(*e.measured.notes, note)))
        out.append(e)
    return out


def _speed(estimate: Estimate) -> float:
    return float(estimate.samples_per_s or 0.0)


def _anchor_scale(estimator: Estimator, anchor: PlanEntry) -> float | None:
    """The measured best's measured step over its refitted prediction (None: no time to scale by)."""
    measured = anchor.measured
    if measured is None or not measured.step_time_s:
        return None
    predicted = estimator.recalibrated(anchor.predicted)
    if not predicted.step_time_s:
        return None
    return float(measured.step_time_s) / float(predicted.step_time_s)


def _tied(entry: PlanEntry, anchor: PlanEntry) -> PlanEntry:
    """``entry`` (predicted) shown equal to the measured best when its prediction leads by less
    than ``_PREDICTED_TIE``: within that, the measurement decides."""
    best, speed = anchor.samples_per_s, entry.samples_per_s
    if entry.source != "predicted" or not best or not best < speed <= best * (1 + _PREDICTED_TIE):
        return entry
    p = entry.predicted
    note = f"time: predicted {speed / best - 1:.1%} above {anchor.config.describe()}'s measurement: shown tied"
    return replace(entry, predicted=replace(p, samples_per_s=best, step_time_s=float(p.step_time_s or 0) * speed / best,
                                            notes=(*p.notes, note)))


def _anchored(entry: PlanEntry, anchor: PlanEntry, scale: float) -> PlanEntry:
    """An unmeasured entry's refitted prediction scaled as the measured best's is to its
    measurement: its figure is the best's times the time model's ratio of the two."""
    p = entry.predicted
    if not p.step_time_s or not p.samples_per_s:
        return entry
    note = (f"{ANCHORED_NOTE} ratio to {anchor.config.describe()} (refitted by the measurements), "
            f"on its measured time (x{1 / scale:.2f})")
    notes = tuple(n for n in p.notes if not n.startswith(ANCHORED_NOTE))
    return replace(entry, basis="predicted", predicted=replace(
        p, step_time_s=float(p.step_time_s) * scale, samples_per_s=float(p.samples_per_s) / scale,
        notes=(*notes, note)))


def build_plan(task: Task, estimator: Estimator, entries: Sequence[PlanEntry], *, budget: int, margin: float,
               global_batch: int | None, tried: int, failed: Mapping[TrainConfig, str],
               notes: Sequence[str], compile: bool | None = None,
               structure: tuple[int, str] | None = None, coverage: Mapping[str, Any] | None = None) -> Plan:
    """The Plan of the ranked ``entries``, its notes closed by one line on the failures.
    ``structure``: the model's ``structure_fingerprint`` (from the model on meta), recorded in
    the provenance for ``check_plan_model``; ``coverage``: how much of the space was estimated
    (``Coverage.to_dict``), recorded there as ``search_coverage``."""
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
                              source_hash=task.source_hash, source_path=task.source_path,
                              structure=structure, model_name=task.name, origin=task.origin)
        | ({"search_coverage": dict(coverage)} if coverage is not None else {}),
        notes=(*notes, *((summary,) if summary else ())),
        compile=compile,
    )
