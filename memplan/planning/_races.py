"""Confirming the predicted best by races: two configurations timed step against step.

The two best predicted are raced (``race_best``); a race won clearly along one axis (the
micro-batch size, the checkpoint segments) is followed a step or two further
(``_follow_trend``); then the memory of the one put first is probed (``_check_memory``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from estimators import Estimate, Estimator, Task, TrainConfig, format_size

from ._plan import RACED_NOTE, PlanEntry, needed_bytes

__all__ = ["ProbeFn", "RaceFn", "race_best", "fit_together"]

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


def race_best(task: Task, estimator: Estimator, rest: list[PlanEntry], limit: int, memory_fn: ProbeFn,
              race_fn: RaceFn, notes: list[str],
              failed: dict[TrainConfig, str]) -> tuple[list[PlanEntry], list[PlanEntry], list[PlanEntry]] | None:
    """Race the two best predicted configurations (``rest[0]``, ``rest[1]``); follow a clear
    win along its axis (``_follow_trend``); probe the memory of the one put first. Returns the
    measured entry (none when each raced one failed its memory probe), the raced ones left
    unmeasured, and the rest, or None when the race did not finish (the caller then probes them instead).

    Why a race rather than a probe of each: a probe's few steps run in one fresh process,
    and on a shared machine the same configuration measures 20-40% apart from one probe to
    the next (its speed drifts over seconds), while the predicted best and its runner-up are
    often predicted within a few percent of each other. A race (``estimators.race``) times
    their steps alternately in one process, so each pair of steps sees the same machine, and
    the median ratio over the rounds decides; a tie (under ``_RACE_TIE``) keeps the
    prediction's order. Each raced configuration takes the race's median step time as its
    figure (and refits the time model with it). The memory only the one that will be
    trained needs measured, by a probe of one step.
    """
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
    timed: dict[TrainConfig, tuple[float, int, TrainConfig]] = {}  # step s, rounds, raced against
    for i, (entry, other) in enumerate(((first, rival), (rival, first))):
        step = float(result.median_step_s(i))
        estimator.calibrate(entry.config, step, predicted=entry.predicted)
        timed[entry.config] = (step, rounds, other.config)
    wins = int(result.second_wins)
    if ratio > 1 + _RACE_TIE:
        notes.append(
            f"raced step against step, {rival.config.describe()} was faster than the predicted best "
            f"({first.config.describe()}) in {wins} of {rounds} rounds (by {ratio - 1:.0%} on the median): "
            "it goes above the predicted best"
        )
        order = [rival, first]
        if ratio >= 1 + _TREND_MIN:
            rest = _follow_trend(task, estimator, order, rest, timed, race_fn, notes)
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
    probed, unmeasured = _check_memory(task, order, timed, limit, memory_fn, notes, failed)
    return probed, unmeasured, rest


def _check_memory(
    task: Task,
    order: list[PlanEntry],
    timed: dict[TrainConfig, tuple[float, int, TrainConfig]],
    limit: int,
    memory_fn: ProbeFn,
    notes: list[str],
    failed: dict[TrainConfig, str],
) -> tuple[list[PlanEntry], list[PlanEntry]]:
    """Probe the memory of the raced configurations, fastest first, until one fits: it is
    measured (its time the race's), one that runs out of memory or over the budget is
    dropped, and the others stay unmeasured (their races refitted their predictions)."""
    for i, entry in enumerate(order):
        result = memory_fn(task, entry.config, limit)
        status = getattr(result, "status", "error")
        measured = getattr(result, "estimate", None)
        if status == "ok" and measured is not None and needed_bytes(measured) <= limit:
            step, rounds, other = timed[entry.config]
            entry = replace(entry, measured=_raced(measured, entry.config, step, rounds, other), probe_status="ok")
            # The others were timed by the race too: that is their figure, not the time model's.
            losers = [replace(e, predicted=_raced(e.predicted, e.config, *timed[e.config])) for e in order[i + 1 :]]
            return [entry], losers
        if status == "oom":
            notes.append(f"{entry.config.describe()} raced fastest but ran out of memory when probed; dropped")
        elif status == "ok" and measured is not None:
            notes.append(
                f"{entry.config.describe()} raced fastest but measured {format_size(measured.peak_bytes)}, "
                "over the budget; dropped"
            )
        elif getattr(result, "raised", False):
            failed[entry.config] = str(getattr(result, "message", ""))
            notes.append(
                f"{entry.config.describe()} raced fastest but failed when probed ({failed[entry.config]}); dropped"
            )
        else:
            notes.append(
                f"{entry.config.describe()}: memory probe {status} ({getattr(result, 'message', '')}); kept unmeasured"
            )
            return [], [replace(entry, probe_status=status), *order[i + 1 :]]
    return [], []


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
    return replace(
        measured,
        step_time_s=step,
        samples_per_s=config.global_batch / step,
        notes=(
            *measured.notes,
            f"{RACED_NOTE} {rounds} steps raced step against step with {other.describe()} in one process",
        ),
    )


def _follow_trend(
    task: Task,
    estimator: Estimator,
    order: list[PlanEntry],
    rest: list[PlanEntry],
    timed: dict[TrainConfig, tuple[float, int, TrainConfig]],
    race_fn: RaceFn,
    notes: list[str],
) -> list[PlanEntry]:
    """A race put ``order[0]`` above the predicted best ``order[1]`` by ``_TREND_MIN`` or
    more, and if the two differ along one axis (the micro-batch size, or the checkpoint
    segments) the time model misjudged that axis, and the same misjudgement likely holds one
    step further. So the next feasible configuration beyond the winner along that axis is
    raced against it; if it wins, it goes first in ``order`` (and ``timed`` gets its figure),
    and the search looks one step further again (at most ``_TREND_STEPS``) if this step too
    won by ``_TREND_MIN``. The first race it loses, a win by less, or a configuration that is
    not there, ends the walk. Returns ``rest`` without the configurations put in ``order``.

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
        if ratio <= 1 + _RACE_TIE:
            notes.append(
                f"one step further, {candidate.config.describe()} raced {winner.config.describe()} and was "
                f"not faster (median ratio {ratio:.2f}): the walk stops"
            )
            break
        notes.append(
            f"one step further, {candidate.config.describe()} raced {winner.config.describe()}: faster in "
            f"{int(result.second_wins)} of {rounds} rounds (by {ratio - 1:.0%} on the median): it goes above"
        )
        rest = [e for e in rest if e is not candidate]
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
