"""Confirming the predicted best by probes: a few real steps of each in its own process.

The two best are raced (``._races``) when a race can run, and any further ``probe_top``
raced against the measured best; otherwise each is probed (a few timed steps and its memory),
in an order that spends probes on configurations the estimator tells apart. Measured times
refit the time model, an OOM drops the configuration, a step that raises joins the failures;
separate probes that overturn the predicted order are checked by probing both again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from estimators import Estimate, Estimator, Task, TrainConfig, format_size, probe, race

from ._plan import PlanEntry, needed_bytes
from ._races import ProbeFn, RaceFn, RaceLog, fit_together, race_best, race_challenger
from ._ranking import rank_measured

__all__ = ["probe_best"]


# How many unmeasured configurations the refitted time model may put above the measured best
# before the plan stops racing them (each race costs seconds; more is rarely seen).
_CHALLENGES = 2


def probe_best(task: Task, estimator: Estimator, entries: list[PlanEntry], top: int, limit: int,
               probe_fn: ProbeFn | None, race_fn: RaceFn | None,
               failed: dict[TrainConfig, str]) -> tuple[list[PlanEntry], list[str]]:
    """Measure the best ``top`` feasible configurations; re-rank with what was measured.

    The two best are raced (``race_best``) when a race can run: their times come from the
    race, and only the one it puts first has its memory probed; each further ``top`` is raced
    against the measured best (``race_challenger``). Otherwise each is probed (a few timed
    steps and its memory) in its own process. Every figure is then on one basis
    (``rank_measured``); an unmeasured configuration the refitted time model puts above the
    measured best is raced (or, without races, probed) before the plan believes it, up to
    ``_CHALLENGES`` of them.
    """
    probe_fn, memory_fn, race_fn = _probe_fns(estimator, probe_fn, race_fn)
    notes: list[str] = []
    probed: list[PlanEntry] = []
    rest = _probe_order(entries)
    wanted = top
    raced: list[PlanEntry] | None = None  # raced, left unmeasured (not probed again)
    log = RaceLog()
    if top >= 2 and race_fn is not None and len(rest) >= 2 and fit_together(estimator.device, rest[0], rest[1]):
        outcome = race_best(task, estimator, rest, limit, memory_fn, race_fn, notes, failed, log)
        if outcome is not None:
            probed, raced, rest = outcome
            # The race measured two. Should both be dropped, the next are probed in their place;
            # a memory probe that failed (not for lack of memory) stops the probing, as below.
            failed_probe = any(e.probe_status is not None for e in raced)
            wanted = top - 2 + len(probed) if probed or failed_probe else top
    racing = race_fn is not None and raced is not None and len(probed) == 1
    if racing:
        assert race_fn is not None and raced is not None
        # Further configurations race the measured best: a probe of its own, in another
        # process at another moment, would not compare with the races' figures.
        for _ in range(wanted - 1):
            if not rest:
                break
            candidate = rest.pop(0)
            outcome_ = race_challenger(task, estimator, probed[0], candidate, raced, log, limit, memory_fn,
                                       race_fn, notes, failed)
            if outcome_ is None:
                rest.insert(0, candidate)
                break
            best, raced = outcome_
            probed = [best]
    else:
        _probe_in_turn(task, estimator, rest, probed, wanted, limit, probe_fn, notes, failed)
    kept: tuple[TrainConfig, TrainConfig] | None = None
    if len(probed) >= 2 and raced is None:
        probed, kept = _confirm_overturn(task, estimator, probed, limit, probe_fn, notes)
    ranked = rank_measured(estimator, probed, raced or [], rest, kept)
    for _ in range(_CHALLENGES):
        leader = ranked[0]
        best_measured = next((e for e in ranked if e.source in ("measured", "probed")), None)
        if best_measured is None or leader.source != "predicted" or leader.probe_status is not None:
            break
        notes.append(f"the time model, refitted by the measurements, put {leader.config.describe()} above the "
                     f"measured best ({best_measured.config.describe()}): it is measured too")
        rest = [e for e in rest if e.config != leader.config]
        candidate = next(e for e in entries if e.config == leader.config)
        if racing:
            assert race_fn is not None and raced is not None
            outcome_ = race_challenger(task, estimator, probed[0], candidate, raced, log, limit, memory_fn,
                                       race_fn, notes, failed)
            if outcome_ is None:  # the race did not run: the prediction stands, as the note says
                rest.insert(0, candidate)
                ranked = rank_measured(estimator, probed, raced, rest, kept)
                break
            best, raced = outcome_
            probed = [best]
        else:
            before = len(probed)
            queue = [candidate]
            _probe_in_turn(task, estimator, queue, probed, before + 1, limit, probe_fn, notes, failed)
            rest = queue + rest
        ranked = rank_measured(estimator, probed, raced or [], rest, kept)
    return ranked, notes


def _probe_fns(estimator: Estimator, probe_fn: ProbeFn | None,
               race_fn: RaceFn | None) -> tuple[ProbeFn, ProbeFn, RaceFn | None]:
    """(probe, memory probe, race): the real ones on the estimator's device, unless a test
    gives its own probe (then it probes the memory too, and races only with its own race)."""
    if probe_fn is not None:
        return probe_fn, probe_fn, race_fn

    def real_probe(t: Task, c: TrainConfig, budget: int) -> Any:
        return probe(t, c, device=estimator.device, budget_bytes=budget)

    def memory_fn(t: Task, c: TrainConfig, budget: int) -> Any:
        # Its time comes from a race: one timed step after the memory steps is enough.
        return probe(t, c, device=estimator.device, budget_bytes=budget, steps=1, warmup=0)

    if race_fn is None:
        def race_fn(t: Task, pair: tuple[TrainConfig, TrainConfig]) -> Any:
            return race(t, pair, device=estimator.device)
    return real_probe, memory_fn, race_fn


def _probe_in_turn(task: Task, estimator: Estimator, rest: list[PlanEntry], probed: list[PlanEntry], wanted: int,
                   limit: int, probe_fn: ProbeFn, notes: list[str], failed: dict[TrainConfig, str]) -> None:
    """Probe ``rest`` in turn (taking them out of it) until ``probed`` holds ``wanted``: one that
    fits joins ``probed``, one over the budget or out of memory is dropped, one whose step raised
    joins ``failed``; a probe that could not run stops the probing, its configuration kept
    unmeasured at the head of ``rest``."""
    while rest and len(probed) < wanted:
        entry = rest.pop(0)
        result = probe_fn(task, entry.config, limit)
        status = getattr(result, "status", "error")
        if status == "ok" and result.estimate is not None:
            measured: Estimate = result.estimate
            if measured.step_time_s:
                estimator.calibrate(entry.config, measured.step_time_s, predicted=entry.predicted)
            if needed_bytes(measured) > limit:
                notes.append(
                    f"{entry.config.describe()}: measured {format_size(measured.peak_bytes)} is over the budget; dropped"
                )
                continue
            probed.append(
                PlanEntry(config=entry.config, predicted=entry.predicted, measured=measured, probe_status="ok")
            )
        elif status == "oom":
            notes.append(f"{entry.config.describe()}: ran out of memory when probed; dropped")
        elif getattr(result, "raised", False):
            # Its step raised when run for real: it cannot run, as one that cannot be traced.
            failed[entry.config] = str(getattr(result, "message", ""))
            notes.append(f"{entry.config.describe()}: failed when probed ({failed[entry.config]}); dropped")
        else:
            notes.append(
                f"{entry.config.describe()}: probe {status} ({getattr(result, 'message', '')}); kept unmeasured"
            )
            rest.insert(0, PlanEntry(config=entry.config, predicted=entry.predicted, probe_status=status))
            break


def _confirm_overturn(
    task: Task, estimator: Estimator, probed: list[PlanEntry], limit: int, probe_fn: ProbeFn, notes: list[str]
) -> tuple[list[PlanEntry], tuple[TrainConfig, TrainConfig] | None]:
    """When separate probes overturn the predicted order of the top configuration (no race
    could be run), probe the two again before believing them.

    Both are probed again in the other order and each keeps the mean of its two
    measurements; the lead then stands only if it is larger than either configuration's two
    probes differ. Returns the entries, and the pair (upper, lower) when the figures alone
    would not order the two as decided.
    """
    predicted_first = probed[0]  # probes run in predicted order
    rival = max(probed[1:], key=lambda e: e.samples_per_s)
    if predicted_first.samples_per_s >= rival.samples_per_s:
        return probed, None
    notes.append(
        f"the probes put {rival.config.describe()} ahead of the predicted best ({predicted_first.config.describe()})"
    )
    return _reprobe(task, estimator, probed, predicted_first, rival, limit, probe_fn, notes)


def _reprobe(
    task: Task,
    estimator: Estimator,
    probed: list[PlanEntry],
    predicted_first: PlanEntry,
    leader: PlanEntry,
    limit: int,
    probe_fn: ProbeFn,
    notes: list[str],
) -> tuple[list[PlanEntry], tuple[TrainConfig, TrainConfig] | None]:
    steps: dict[TrainConfig, tuple[float, float]] = {}
    confirmed: dict[TrainConfig, PlanEntry | None] = {}  # None: dropped
    for entry in (leader, predicted_first):
        first = entry.measured
        if first is None or not first.step_time_s:
            continue
        result = probe_fn(task, entry.config, limit)
        status = getattr(result, "status", "error")
        second: Estimate | None = result.estimate if status == "ok" else None
        if status == "oom":
            notes.append(f"{entry.config.describe()}: ran out of memory when probed again; dropped")
            confirmed[entry.config] = None
            continue
        if second is None or not second.step_time_s:
            notes.append(f"{entry.config.describe()}: second probe {status}; the first kept")
            continue
        estimator.calibrate(entry.config, second.step_time_s, predicted=entry.predicted)
        steps[entry.config] = (first.step_time_s, second.step_time_s)
        step = (first.step_time_s + second.step_time_s) / 2
        higher = max((first, second), key=needed_bytes)
        if needed_bytes(higher) > limit:
            notes.append(
                f"{entry.config.describe()}: measured {format_size(higher.peak_bytes)} is over the budget; dropped"
            )
            confirmed[entry.config] = None
            continue
        merged = replace(
            higher,
            step_time_s=step,
            samples_per_s=entry.config.global_batch / step,
            notes=(*higher.notes, f"time: mean of two probes ({first.step_time_s:.4g} s, {second.step_time_s:.4g} s)"),
        )
        confirmed[entry.config] = replace(entry, measured=merged)
    notes.append("both were probed again")
    out = [confirmed[e.config] if e.config in confirmed else e for e in probed]
    kept = None
    # Both kept (not dropped) means both were measured twice.
    if confirmed.get(leader.config) and confirmed.get(predicted_first.config):
        mean = {c: (a + b) / 2 for c, (a, b) in steps.items()}
        spread = max(abs(a - b) / mean[c] for c, (a, b) in steps.items())
        lead = mean[predicted_first.config] / mean[leader.config] - 1
        if 0 < lead <= spread:
            kept = (predicted_first.config, leader.config)
            notes.append(
                f"{leader.config.describe()} led by {lead:.0%} on the means, less than one "
                f"configuration's two probes differ ({spread:.0%}): the predicted order is kept"
            )
    return [e for e in out if e is not None], kept


def _probe_order(entries: list[PlanEntry]) -> list[PlanEntry]:
    """The best configuration first, then the best of each other precision, then the rest;
    a configuration predicted exactly like one before it goes last.

    Probes calibrate the time model per precision: a bf16 step's speed on a CPU depends on
    kernels an fp32 probe says nothing about, so one probe of each precision keeps the
    unprobed configurations' predictions honest. A configuration the estimator cannot tell
    from one already probed (same step time, same peak) would measure only the machine's
    noise: a probe is better spent on a configuration that differs.
    """
    if not entries:
        return []
    seen_estimates: set[tuple[float | None, int]] = set()
    distinct: list[PlanEntry] = []
    twins: list[PlanEntry] = []
    for e in entries:
        key = (e.predicted.step_time_s, needed_bytes(e.predicted))
        (twins if key in seen_estimates else distinct).append(e)
        seen_estimates.add(key)
    first: list[PlanEntry] = [distinct[0]]
    seen = {distinct[0].config.precision}
    for e in distinct[1:]:
        if e.config.precision not in seen:
            first.append(e)
            seen.add(e.config.precision)
    return first + [e for e in distinct if e not in first] + twins
