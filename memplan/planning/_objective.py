"""The study's objective: a configuration's static estimate against the memory budget.

Every trial gets the static estimate, cached per configuration (a resumed or repeated
configuration is never re-estimated). The budget is a constraint (``trial.set_constraint``,
<= 0 feasible) with a safety margin kept free, so an infeasible configuration is a
*completed* infeasible trial the sampler learns from, never a FAIL; so is a configuration
that cannot be traced, its reason kept in :class:`Failures`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial

from estimators import Estimate, Estimator, MemplanError, TrainConfig, format_size

from ._failures import Failures
from ._plan import excess_bytes
from ._refusal import StateFloor
from ._space import SearchSpace

if TYPE_CHECKING:
    from ._study import MirroredStudy

__all__ = ["Objective", "optimize", "config_from_params", "trial_params", "ROUNDS"]


class Objective:
    """Samples/s of a trial's configuration, its memory over ``limit`` the constraint."""

    def __init__(self, space: SearchSpace, estimator: Estimator, limit: int, *, floor: StateFloor | None = None,
                 host_limit: int | None = None) -> None:
        self.space = space
        self.estimator = estimator
        self.limit = limit
        self.floor = floor
        self.host_limit = host_limit
        self.cache: dict[TrainConfig, Estimate] = {}
        self.failures = Failures(space)
        self.pruned: dict[TrainConfig, str] = {}
        """Configurations known not to fit without a trace, and why."""
        self.broken = False
        """Every configuration fails alike: the study was stopped (``Failures.shared``)."""
        self.enumerated = False
        """The study asked the whole space (``_study.enumerates``), set when it is opened."""

    def fits(self, est: Estimate) -> bool:
        """Within the device's limit, and the host's for what it offloads."""
        return self.excess(est) <= 0

    def excess(self, est: Estimate) -> int:
        """Bytes over the tighter of the two limits (<= 0: fits)."""
        return excess_bytes(est, self.limit, self.host_limit)

    def under_floor(self, config: TrainConfig) -> tuple[int, str] | None:
        """(bytes over, why) when the model's own states under ``config`` exceed a limit."""
        if self.floor is None:
            return None
        device, host = self.floor.device(config), self.floor.host(config)
        if device > self.limit:
            return device - self.limit, f"model states alone need {format_size(device)} on the device"
        if self.host_limit is not None and host > self.host_limit:
            return host - self.host_limit, f"offloaded model states need {format_size(host)} of host memory"
        return None

    def prune(self, config: TrainConfig) -> tuple[int, str] | None:
        """(bytes over the limit, why) when ``config`` cannot fit by what is known already:
        its model states alone (``StateFloor``), or a configuration estimated not to fit that
        it holds at least as much as — the same but for a micro-batch as large or larger and
        as few checkpointed blocks or fewer. None when only an estimate can tell."""
        below = self.under_floor(config)
        if below is not None:
            return below
        for est in self.cache.values():
            other = est.config
            if (other.micro_batch_size <= config.micro_batch_size
                    and other.checkpoint_segments >= config.checkpoint_segments
                    and _same_but_batch_and_segments(other, config) and not self.fits(est)):
                return self.excess(est), f"needs more than {other.describe()}, which does not fit"
        return None

    def evaluate(self, config: TrainConfig) -> Estimate | None:
        """The estimate of ``config`` (None: it could not be traced; ``failures`` says why)."""
        if config not in self.cache and config not in self.failures.reasons:
            try:
                self.cache[config] = self.estimator.estimate(config)
            except MemplanError as exc:
                self.failures.add(config, exc)
        return self.cache.get(config)

    def resume(self, trials: Iterable[FrozenTrial]) -> None:
        """A resumed study's trials answer their configurations without re-estimating."""
        for t in trials:
            if "estimate" in t.user_attrs:
                est = Estimate.from_dict(t.user_attrs["estimate"])
                self.cache.setdefault(est.config, est)
            elif "failed" in t.user_attrs:
                self.failures.resume(t.params, str(t.user_attrs["failed"]))

    def done(self) -> set[TrainConfig]:
        """The configurations answered so far, estimated, failed or pruned."""
        return {est.config for est in self.cache.values()} | set(self.failures.reasons) | set(self.pruned)

    def results(self) -> tuple[list[Estimate], dict[TrainConfig, str]]:
        """The estimates and the failures of the configurations in the space, in the space's
        order (not the order they were asked in: equal predictions then rank alike however
        the trials fell, in one process or over a shared study's workers)."""
        failed = self.failures.in_space()
        return ([self.cache[c] for c in self.space if c in self.cache],
                {c: failed[c] for c in self.space if c in failed})

    def __call__(self, trial: optuna.Trial) -> float:
        return self.answer(trial, self.config_of(trial))

    def config_of(self, trial: optuna.Trial) -> TrainConfig:
        """The configuration the trial's parameters name (suggested by the sampler, or fixed
        by an enqueued trial)."""
        space = self.space
        params = {
            "layout": trial.suggest_categorical("layout", [layout.key for layout in space.layouts]),
            "micro_batch_size": trial.suggest_categorical("micro_batch_size", list(space.micro_batch_sizes)),
            "precision": trial.suggest_categorical("precision", list(space.precisions)),
            "checkpoint_segments": trial.suggest_categorical("checkpoint_segments", list(space.checkpoint_segments)),
        }
        if len(space.grouping) > 1:
            params["length_grouped"] = trial.suggest_categorical("length_grouped", list(space.grouping))
        if space.techniques:
            params["technique"] = trial.suggest_categorical("technique", [t.name for t in space.technique_choices])
        return _config(space, params)

    def answer(self, trial: optuna.Trial, config: TrainConfig) -> float:
        """The trial's value for ``config``, its constraint and what it rests on set on the
        trial: pruned, failed, or estimated (each at most once per configuration)."""
        limit = self.limit
        known = None if config in self.cache else self.prune(config)
        if known is not None:
            # Known not to fit: an infeasible trial for the sampler, without a trace.
            self.pruned[config] = known[1]
            trial.set_user_attr("pruned", known[1])
            trial.set_constraint("memory", max(known[0], 1) / 1e9)
            return 0.0
        est = self.evaluate(config)
        if est is None:
            # A configuration that cannot be traced is a completed, infeasible trial (as an OOM
            # is): the sampler learns from it, and the search goes on without it.
            trial.set_user_attr("failed", self.failures.reasons[config])
            trial.set_constraint("memory", max(limit, 1) / 1e9)
            if not self.cache and self.failures.shared(self.evaluate):
                self.broken = True
                trial.study.stop()  # every configuration fails alike: the model itself is broken
            return 0.0
        trial.set_user_attr("estimate", est.to_dict())
        # Constraint in GB keeps the numbers readable in optuna-dashboard; <= 0 is feasible.
        trial.set_constraint("memory", self.excess(est) / 1e9)
        return float(est.samples_per_s or 0.0)


def _config(space: SearchSpace, params: Mapping[str, Any]) -> TrainConfig:
    return space.config(int(params["micro_batch_size"]), str(params["precision"]), int(params["checkpoint_segments"]),
                        str(params["layout"]), bool(params.get("length_grouped", False)),
                        str(params.get("technique", "none")))


def config_from_params(space: SearchSpace, params: Mapping[str, Any]) -> TrainConfig | None:
    """The configuration a trial's parameters name in ``space`` (None: another space's)."""
    try:
        return _config(space, params)
    except (KeyError, StopIteration, ValueError, MemplanError):
        return None


def trial_params(space: SearchSpace) -> dict[TrainConfig, dict[str, object]]:
    """The trial parameters that ask for each configuration of ``space`` (the first of those
    naming it, where a technique that does not apply makes several name one)."""
    out: dict[TrainConfig, dict[str, object]] = {}
    for layout in space.layouts:
        for micro in space.micro_batch_sizes:
            for precision in space.precisions:
                for segments in space.checkpoint_segments:
                    for grouped in space.grouping:
                        for technique in space.technique_choices:
                            params: dict[str, object] = {"layout": layout.key, "micro_batch_size": micro,
                                                         "precision": precision, "checkpoint_segments": segments}
                            if len(space.grouping) > 1:
                                params["length_grouped"] = grouped
                            if space.techniques:
                                params["technique"] = technique.name
                            out.setdefault(_config(space, params), params)
    return out


def _same_but_batch_and_segments(a: TrainConfig, b: TrainConfig) -> bool:
    def rest(c: TrainConfig) -> TrainConfig:
        # Accumulation counts only as one or more (more holds the gradients while the next
        # micro-batch runs); under a fixed global batch it follows the micro-batch otherwise.
        return c.replace(micro_batch_size=1, checkpoint_segments=0, checkpoint_policy="full",
                         grad_accum_steps=min(c.grad_accum_steps, 2))

    return a.checkpoint_policy == b.checkpoint_policy and rest(a) == rest(b)


ROUNDS = 4
"""The trials asked at most, in budgets: pruned trials cost no trace, but the sampler may keep
asking for them."""


def optimize(mirrored: MirroredStudy, objective: Objective, *, trials: int, exhaustive: bool,
             progress: bool) -> bool:
    """Ask the study for the trials not answered yet (at most ``trials`` estimated or failed
    configurations in all: one pruned without a trace costs none of the budget, so the study
    is asked again for what they left, up to ``ROUNDS`` budgets in all); True when Ctrl-C cut it short
    (the completed trials are in the storage: a plan is built from them)."""
    space, estimator = objective.space, objective.estimator
    in_space = set(space)

    # An enumerated space may be larger than ``trials`` (``enumerates``): all of it is asked.
    budget = max(trials, len(space)) if exhaustive else trials

    def remaining() -> int:
        answered = len([c for c in objective.done() if c in in_space and c not in objective.pruned])
        return max(0, min(budget - answered, len(in_space - objective.done())))

    left = remaining()
    # An enumerated space asks every configuration: its traces start now, on both cores
    # (those whose model states alone do not fit are never traced).
    estimator.expect([c for c in space if objective.under_floor(c) is None], prefetch=exhaustive and left > 0)
    interrupted = False
    if left:
        try:
            asked = 0
            # The sampler may ask a pruned configuration again: ask at most ROUNDS budgets.
            while left and asked < ROUNDS * budget:
                mirrored.optimize(objective, n_trials=left, progress=progress)
                asked += left
                left = 0 if exhaustive or objective.broken else remaining()
        except KeyboardInterrupt:
            interrupted = True  # completed trials are in the storage; plan from them
        finally:
            estimator.close()  # its trace worker, if a large model started one
    return interrupted
