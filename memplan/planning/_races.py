"""Confirming the predicted best by races: two configurations timed step against step.

The two best predicted are raced (``race_best``); a race won clearly along one axis (the
micro-batch size, the checkpoint segments) is followed a step or two further
(``_follow_trend``); then the memory of the one put first is probed (``_check_memory``).
Further candidates are raced against the measured best (``race_challenger``).

Every race is logged (``RaceLog``): a race compares its two configurations only, in one
process, and two races ran at different moments of a shared machine compare nothing across
them, so each raced configuration's figure is the measured best's time times the races'
median ratios on the way from it (``raced_figures``): the loser of a race never shows faster
than its winner, whichever race each one's own step time came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from estimators import Estimate, Estimator, Task, TrainConfig, format_size

from ._plan import RACED_NOTE, PlanEntry, needed_bytes

__all__ = ["ProbeFn", "RaceFn", "RaceLog", "race_best", "race_challenger", "raced_figures", "fit_together"]

ProbeFn = Callable[[Task, TrainConfig, int], Any]
# (task, (predicted best or a race's winner, its rival)) -> an estimators.race RaceResult
RaceFn = Callable[[Task, tuple[TrainConfig, TrainConfig]], Any]


# A race decided by less than this share is a tie; the prediction breaks it.
_RACE_TIE = 0.01


# How many configurations beyond a race's winner the search follows its trend.
_TREND_STEPS = 2
# The least lead of a race's winner over the predicted best that is followed further: a
# smaller one says the time model misjudged that axis by little, so one step further would
# likely gain less than the 5% the plan may be off anyway, for a race's cost.
_TREND_MIN = 0.05

Timed = dict[TrainConfig, tuple[float, int, TrainConfig]]
"""Each raced configuration's own median step (s), the rounds, and what it was raced against."""

Edge = tuple[TrainConfig, TrainConfig, float, int]
"""One race (a, b, speed of b / speed of a as the race decided, rounds)."""


def _edge(a: TrainConfig, b: TrainConfig, ratio: float, rounds: int) -> Edge:
    """The race of ``a`` against ``b`` (median ratio ``ratio``: a's step / b's) as decided: b's
    speed over a's is the ratio when b won, else at most 1 (a tie shows the two equal, as the
    order it keeps says)."""
    return a, b, (ratio if ratio > 1 + _RACE_TIE else min(ratio, 1.0)), rounds


@dataclass
class RaceLog:
    """What the races measured: each raced configuration's own median step (``timed``) and
    each race's decided speed ratio (``edges``), so that any two raced configurations compare
    through the races that link them, never through two races' absolute times."""

    timed: Timed = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)

    def record(self, a: TrainConfig, b: TrainConfig, ratio: float, rounds: int) -> None:
        """A race of ``a`` against ``b`` whose median ratio (a's step / b's) is ``ratio``."""
        self.edges.append(_edge(a, b, ratio, rounds))

    def relative(self, anchor: TrainConfig, config: TrainConfig) -> tuple[float, int] | None:
        """``config``'s speed over ``anchor``'s through the races that link them (the product
        of their ratios) and the fewest rounds of those races; None when no races link them."""
        if config == anchor:
            return 1.0, 0
        seen = {anchor: (1.0, 0)}
        frontier = [anchor]
        while frontier:
            nxt: list[TrainConfig] = []
            for node in frontier:
                speed, rounds = seen[node]
                for a, b, ratio, n in self.edges:
                    for here, there, factor in ((a, b, ratio), (b, a, 1.0 / ratio)):
                        if here == node and there not in seen:
                            seen[there] = (speed * factor, min(rounds, n) if rounds else n)
                            nxt.append(there)
            frontier = nxt
        return seen.get(config)

    def by_speed(self, order: list[PlanEntry]) -> list[PlanEntry]:
        """``order`` (its first the last winner) fastest first by the races, ties as given."""
        head = order[0].config

        def speed(e: PlanEntry) -> float:
            found = self.relative(head, e.config)
            return found[0] if found is not None else 0.0
        return sorted(order, key=lambda e: -speed(e))


def race_best(task: Task, estimator: Estimator, rest: list[PlanEntry], limit: int, memory_fn: ProbeFn,
              race_fn: RaceFn, notes: list[str], failed: dict[TrainConfig, str],
              log: RaceLog | None = None) -> tuple[list[PlanEntry], list[PlanEntry], list[PlanEntry]] | None:
    """Race the two best predicted configurations (``rest[0]``, ``rest[1]``); follow a clear
    win along its axis (``_follow_trend``); probe the memory of the one put first. Returns the
    measured entry (none when each raced one failed its memory probe), the raced ones left
    unmeasured, and the rest, or None when the race did not finish (the caller then probes them instead).
    ``log`` receives the races.

    Why a race rather than a probe of each: a probe's few steps run in one fresh process,
    and on a shared machine the same configuration measures 20-40% apart from one probe to
    the next (its speed drifts over seconds), while the predicted best and its runner-up are
    often predicted within a few percent of each other. A race (``estimators.race``) times
    their steps alternately in one process, so each pair of steps sees the same machine, and
    the median ratio over the rounds decides; a tie (under ``_RACE_TIE``) keeps the
    prediction's order. The one put first takes its median step time as its figure, the
    others its figure times the races' ratios (``raced_figures``); each race refits the time
    model. The memory only the one that will be trained needs measured, by a probe of one step.
    """
    log = log if log is not None else RaceLog()
    first, rival = rest[0], rest[1]
    result = race_fn(task, (first.config, rival.config))
    if not getattr(result, "ok", False):
        notes.append(
            f"the race of {first.config.describe()} against {rival.config.describe()} did not finish "
            f"({getattr(result, 'status', 'error')}: {getattr(result, 'message', '')}); both are probed instead"
        )
        return None
    rest = rest[2:]
    rounds = len(result.step_times[0])
    ratio = float(result.ratio)  # > 1: the rival's steps are the shorter
    for i, (entry, other) in enumerate(((first, rival), (rival, first))):
        step = float(result.median_step_s(i))
        estimator.calibrate(entry.config, step, predicted=entry.predicted)
        log.timed[entry.config] = (step, rounds, other.config)
    wins = int(result.second_wins)
    log.record(first.config, rival.config, ratio, rounds)
    if ratio > 1 + _RACE_TIE:
        notes.append(
            f"raced step against step, {rival.config.describe()} was faster than the predicted best "
            f"({first.config.describe()}) in {wins} of {rounds} rounds (by {ratio - 1:.0%} on the median): "
            "it goes above the predicted best"
        )
        order = [rival, first]
        if ratio >= 1 + _TREND_MIN:
            rest = _follow_trend(task, estimator, order, rest, log.timed, race_fn, notes, edges=log.edges)
    else:
        verdict = (
            f"tied with {rival.config.describe()}"
            if ratio >= 1 - _RACE_TIE
            else f"was faster than {rival.config.describe()} in {rounds - wins} of {rounds} rounds "
            f"(by {1 / ratio - 1:.0%} on the median)"
        )
        notes.append(
            f"raced step against step, the predicted best ({first.config.describe()}) {verdict}: "
            "the predicted order is kept"
        )
        order = [first, rival]
    probed, unmeasured = _check_memory(task, log.by_speed(order), log, limit, memory_fn, notes, failed)
    return probed, unmeasured, rest


def _check_memory(
    task: Task,
    order: list[PlanEntry],
    log: RaceLog,
    limit: int,
    memory_fn: ProbeFn,
    notes: list[str],
    failed: dict[TrainConfig, str],
) -> tuple[list[PlanEntry], list[PlanEntry]]:
    """Probe the memory of the raced configurations, fastest first, until one fits: it is
    measured (its time the race's), one that runs out of memory or over the budget is
    dropped, and the others stay unmeasured, their figures its own times the races' ratios."""
    for i, entry in enumerate(order):
        result = memory_fn(task, entry.config, limit)
        status = getattr(result, "status", "error")
        measured = getattr(result, "estimate", None)
        if status == "ok" and measured is not None and needed_bytes(measured) <= limit:
            anchor = _measured_by_race(entry, measured, log)
            return [anchor], raced_figures(log, anchor, order[i + 1 :])
        _memory_refused(entry, status, result, measured, notes, failed, "raced fastest but")
        if status not in ("oom", "ok") and not getattr(result, "raised", False):
            return [], [replace(entry, probe_status=status), *order[i + 1 :]]
    return [], []


def _memory_refused(entry: PlanEntry, status: str, result: Any, measured: Estimate | None, notes: list[str],
                    failed: dict[TrainConfig, str], why: str) -> None:
    """The note on a memory probe that did not measure ``entry`` within the budget (and its
    failure, when its step raised)."""
    what = entry.config.describe()
    if status == "oom":
        notes.append(f"{what} {why} ran out of memory when probed; dropped")
    elif status == "ok" and measured is not None:
        notes.append(f"{what} {why} measured {format_size(measured.peak_bytes)}, over the budget; dropped")
    elif getattr(result, "raised", False):
        failed[entry.config] = str(getattr(result, "message", ""))
        notes.append(f"{what} {why} failed when probed ({failed[entry.config]}); dropped")
    else:
        notes.append(f"{what}: memory probe {status} ({getattr(result, 'message', '')}); kept unmeasured")


def _measured_by_race(entry: PlanEntry, measured: Estimate, log: RaceLog) -> PlanEntry:
    """``entry`` measured: its memory probe's figures with its own median step of a race."""
    step, rounds, other = log.timed[entry.config]
    return replace(entry, measured=_raced(measured, entry.config, step, rounds, other), probe_status="ok",
                   basis="measured")


def raced_figures(log: RaceLog, anchor: PlanEntry, entries: list[PlanEntry]) -> list[PlanEntry]:
    """``entries`` (raced) with the figures of one basis: ``anchor``'s measured time divided by
    their speed over it through the races (``RaceLog.relative``); one no race links keeps its
    figures. A figure that was a measurement (a measured best since beaten) keeps its memory."""
    assert anchor.measured is not None and anchor.measured.step_time_s
    base_step, base_speed = float(anchor.measured.step_time_s), float(anchor.measured.samples_per_s or 0.0)
    out = []
    for e in entries:
        found = log.relative(anchor.config, e.config)
        if found is None:
            out.append(e)
            continue
        speed, rounds = found
        note = (f"{RACED_NOTE} {rounds} steps raced step against step in one process: {speed:.2f}x the speed of "
                f"{anchor.config.describe()}, on its measured time")
        source = e.measured if e.measured is not None else e.predicted
        timed = _timed(source, base_step / speed, base_speed * speed, note)
        out.append(replace(e, measured=timed, basis="raced") if e.measured is not None
                   else replace(e, predicted=timed, basis="raced"))
    return out


def race_challenger(task: Task, estimator: Estimator, anchor: PlanEntry, candidate: PlanEntry,
                    raced: list[PlanEntry], log: RaceLog, limit: int, memory_fn: ProbeFn, race_fn: RaceFn,
                    notes: list[str], failed: dict[TrainConfig, str]) -> tuple[PlanEntry, list[PlanEntry]] | None:
    """Race ``candidate`` against the measured best ``anchor`` (a further ``probe_top``, or one
    the refitted time model puts above it). Not faster: it joins ``raced``, its figure the
    anchor's times the race's ratio. Faster: its memory is probed, and if it fits it is the new
    measured best and every raced figure is taken from it again; one over the budget or out of
    memory is dropped. Returns the (new) anchor and the raced entries, or None when the race
    could not run (the candidate stays unmeasured)."""
    if not fit_together(estimator.device, anchor, candidate):
        return None
    result = race_fn(task, (anchor.config, candidate.config))
    if not getattr(result, "ok", False):
        notes.append(f"{candidate.config.describe()} was not raced against the measured best "
                     f"({getattr(result, 'status', 'error')}: {getattr(result, 'message', '')}); kept unmeasured")
        return None
    rounds = len(result.step_times[0])
    ratio = float(result.ratio)  # > 1: the candidate's steps are the shorter
    step = float(result.median_step_s(1))
    estimator.calibrate(candidate.config, step, predicted=candidate.predicted)
    won = ratio > 1 + _RACE_TIE
    log.record(anchor.config, candidate.config, ratio, rounds)
    log.timed.setdefault(candidate.config, (step, rounds, anchor.config))
    what, best = candidate.config.describe(), anchor.config.describe()
    if not won:
        notes.append(f"{what} raced the measured best ({best}) and was not faster (median ratio {ratio:.2f})")
        return anchor, [*raced, *raced_figures(log, anchor, [candidate])]
    notes.append(f"{what} raced the measured best ({best}): faster in {int(result.second_wins)} of {rounds} "
                 f"rounds (by {ratio - 1:.0%} on the median); its memory is probed")
    log.timed[candidate.config] = (step, rounds, anchor.config)
    probe = memory_fn(task, candidate.config, limit)
    status = getattr(probe, "status", "error")
    measured = getattr(probe, "estimate", None)
    if status == "ok" and measured is not None and needed_bytes(measured) <= limit:
        new = _measured_by_race(candidate, measured, log)
        return new, raced_figures(log, new, [anchor, *raced])
    _memory_refused(candidate, status, probe, measured, notes, failed, "raced faster but")
    if status not in ("oom", "ok") and not getattr(probe, "raised", False):
        # Faster by the race, its memory unknown: it shows the race's figure, and ranks by it.
        return anchor, [*raced, *(replace(e, probe_status=status) for e in raced_figures(log, anchor, [candidate]))]
    return anchor, raced


def fit_together(device: str, a: PlanEntry, b: PlanEntry) -> bool:
    """Can both configurations live on the device at once, as a race needs? On cuda their
    measured (else predicted) peaks must fit in the free memory (a race that runs out of it would
    only cost its time); a CPU's RAM holds two configurations of a budget that defaults to
    half of it."""
    if not device.startswith("cuda"):
        return True
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    need = sum((e.measured or e.predicted).peak_bytes for e in (a, b))
    return need <= free


def _raced(measured: Estimate, config: TrainConfig, step: float, rounds: int, other: TrainConfig) -> Estimate:
    """A probe's figures with the time a race measured in its place."""
    return _timed(measured, step, config.global_batch / step,
                  f"{RACED_NOTE} {rounds} steps raced step against step with {other.describe()} in one process")


def _timed(estimate: Estimate, step: float, speed: float, note: str) -> Estimate:
    """``estimate`` with a race's time in place of its own (an earlier race's note replaced)."""
    notes = tuple(n for n in estimate.notes if not n.startswith(RACED_NOTE))
    return replace(estimate, step_time_s=step, samples_per_s=speed, notes=(*notes, note))


def _follow_trend(
    task: Task,
    estimator: Estimator,
    order: list[PlanEntry],
    rest: list[PlanEntry],
    timed: Timed,
    race_fn: RaceFn,
    notes: list[str],
    *,
    edges: list[Edge] | None = None,
) -> list[PlanEntry]:
    """A race put ``order[0]`` above the predicted best ``order[1]`` by ``_TREND_MIN`` or
    more, and if the two differ along one axis (the micro-batch size, or the checkpoint
    segments) the time model misjudged that axis, and the same misjudgement likely holds one
    step further. So the next feasible configuration beyond the winner along that axis is
    raced against it; if it wins, it goes first in ``order`` (and ``timed`` gets its figure),
    and the search looks one step further again (at most ``_TREND_STEPS``) if this step too
    won by ``_TREND_MIN``. The first race it loses (the loser goes last in ``order``: it was
    raced), a win by less, or a configuration that is not there, ends the walk. Each race is
    added to ``edges``. Returns ``rest`` without the configurations put in ``order``.

    A CPU's caches, for one, make a smaller micro-batch's steps faster per sample than a
    roofline of its work predicts; one probe of a neighbour is not evidence enough (probes
    of one configuration lie 20-40% apart here), a race is.
    """
    winner, loser = order[0], order[1]
    for _ in range(_TREND_STEPS):
        candidate = _next_along(winner.config, loser.config, rest)
        if candidate is None or not fit_together(estimator.device, winner, candidate):
            break
        result = race_fn(task, (winner.config, candidate.config))
        if not getattr(result, "ok", False):
            notes.append(
                f"{candidate.config.describe()}, one step further, was not raced "
                f"({getattr(result, 'status', 'error')}: {getattr(result, 'message', '')})"
            )
            break
        rounds = len(result.step_times[0])
        ratio = float(result.ratio)  # > 1: the candidate's steps are the shorter
        step = float(result.median_step_s(1))
        estimator.calibrate(candidate.config, step, predicted=candidate.predicted)
        rest = [e for e in rest if e is not candidate]
        if edges is not None:
            edges.append(_edge(winner.config, candidate.config, ratio, rounds))
        if ratio <= 1 + _RACE_TIE:
            notes.append(
                f"one step further, {candidate.config.describe()} raced {winner.config.describe()} and was "
                f"not faster (median ratio {ratio:.2f}): the walk stops"
            )
            order.append(candidate)
            timed[candidate.config] = (step, rounds, winner.config)
            break
        notes.append(
            f"one step further, {candidate.config.describe()} raced {winner.config.describe()}: faster in "
            f"{int(result.second_wins)} of {rounds} rounds (by {ratio - 1:.0%} on the median): it goes above"
        )
        order.insert(0, candidate)
        timed[candidate.config] = (step, rounds, winner.config)
        winner, loser = candidate, winner
        if ratio < 1 + _TREND_MIN:
            break  # the gain is flattening out: a step further would likely gain less still
    return rest


def _next_along(winner: TrainConfig, loser: TrainConfig, candidates: list[PlanEntry]) -> PlanEntry | None:
    """The candidate one step beyond ``winner``, away from ``loser``, along the one axis the
    two differ in (the micro-batch size, its accumulation following it, or the checkpoint
    segments); None when they differ in more, or nothing lies beyond."""
    fixed = ("precision", "strategy", "world_size", "nodes")
    same: tuple[str, ...]
    if any(getattr(winner, f) != getattr(loser, f) for f in fixed):
        return None
    if winner.checkpoint_segments == loser.checkpoint_segments and winner.micro_batch_size != loser.micro_batch_size:
        axis, same = "micro_batch_size", ("checkpoint_segments",)
    elif winner.micro_batch_size == loser.micro_batch_size and winner.grad_accum_steps == loser.grad_accum_steps:
        axis, same = "checkpoint_segments", ("micro_batch_size", "grad_accum_steps")
    else:
        return None
    step = getattr(winner, axis) - getattr(loser, axis)
    beyond = [
        e
        for e in candidates
        if all(getattr(e.config, f) == getattr(winner, f) for f in (*fixed, *same))
        and (getattr(e.config, axis) - getattr(winner, axis)) * step > 0
        and e.config.global_batch == winner.global_batch
        and e.probe_status is None
    ]
    return min(beyond, key=lambda e: abs(getattr(e.config, axis) - getattr(winner, axis)), default=None)
