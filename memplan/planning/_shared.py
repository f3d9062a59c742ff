"""A study shared by several ``memplan plan`` processes, on one machine or many.

Processes given the same storage (a PostgreSQL or MySQL URL, or any URL with ``shared=True``)
and the same inputs open the same study and split its configurations between them:

* The study runs on the RDB storage itself (not in memory, as ``MirroredStudy`` does), with
  Optuna's heartbeat: a trial whose process stops beating for the grace period
  (``MEMPLAN_STUDY_GRACE_S``, default 30 s; a beat every tenth of it, at least 1 s) is failed
  by whichever process looks next, and ``RetryHeartbeatStaleTrialCallback`` enqueues it again.
* Each configuration is answered by one trial: before estimating, a trial claims its
  configuration in the table ``memplan_claims`` of the same database (a row per study and
  configuration; the primary key makes the first insert win, in any RDB). A trial that
  loses the claim estimates nothing: it waits for the owner's trial and copies its answer
  (value, constraint, estimate; ``same_as`` names the owner), or, when the owner's trial
  failed (its process died), takes the claim over (a compare-and-swap ``UPDATE``) and answers
  itself. A configuration some trial already answered is copied without a claim. The owner
  records ``worker`` (host:pid) on its trial.
* An enumerated space (no larger than ``trials``) is split by groups of configurations that
  share their traces (all but the micro-batch size and the accumulation: the estimator traces
  a shape at two or three micro-batch sizes and scales the others from them), so that each
  shape is traced by one process: a process holds a group in the same table (a lease it renews
  at each configuration it takes), answers its configurations, and holds the next free group.
  With none free it waits; a group whose lease went unrenewed for the grace period (its holder
  died) is taken over, and enqueued trials (a dead process's, retried) are answered first by
  whoever looks.
* Every process ends with the same plan, built from all the study's completed trials once the
  study is complete. An enumerated space is complete when every configuration has an answer.
  A sampled space (TPE, larger than ``trials``) is complete when ``trials`` configurations are
  answered across the processes: the first to see it closes the study (its user attribute
  ``closed_at_trials``) and waits until no trial runs; a trial started after the close is
  pruned unanswered. Each trial writes its parameters before it reads the close, and the
  closer writes the close before it reads the running trials, so a trial either sees the close
  or is waited for.

The processes must be given the same inputs (model, target, budget, space, memplan and torch
versions): the study's name is a hash of them, and a study named with ``study_name`` records
that hash (``memplan_key``) and refuses other inputs. Probes are not run on a shared study
(``memplan.search`` says so in the plan): they measure the machine they run on, and every
process's plan is the one built from the shared estimates.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import optuna
import sqlalchemy as sa
from optuna.trial import FrozenTrial, TrialState

from estimators import ConfigError, TrainConfig

from ._objective import ROUNDS, Objective, config_from_params, trial_params

__all__ = ["SharedStudy", "shares_storage", "run_shared", "grace_period"]

_log = logging.getLogger("memplan")

_OPEN_ATTEMPTS = 5

_ANSWERS = frozenset({"estimate", "failed", "pruned"})
"""The user attributes of a trial that answered its configuration (``Objective.answer``)."""

_POLL_S = 0.2
"""How often a trial waiting for its configuration's owner looks again."""

_IDLE_S = 0.5
"""How often a process with nothing to answer looks at the study again."""


def shares_storage(url: str | None, shared: bool | None) -> bool:
    """Whether the study in ``url`` is shared: as asked, else for any database but SQLite (a
    server that processes on several machines reach)."""
    if shared is not None:
        return shared
    if url is None:
        return False
    from sqlalchemy.engine import make_url

    return make_url(url).get_backend_name() != "sqlite"


def grace_period() -> tuple[int, int]:
    """(heartbeat, grace) in seconds: ``MEMPLAN_STUDY_GRACE_S`` (default 30) is how long a
    trial may go without a beat before another process fails it and retries it."""
    text = os.environ.get("MEMPLAN_STUDY_GRACE_S", "30")
    try:
        grace = int(text)
    except ValueError:
        raise ConfigError(f"MEMPLAN_STUDY_GRACE_S={text!r} is not a whole number of seconds") from None
    if grace < 2:
        raise ConfigError(f"MEMPLAN_STUDY_GRACE_S={grace}: give at least 2 seconds")
    return max(1, grace // 10), grace


def _key(kind: str, config: TrainConfig) -> str:
    import hashlib
    import json

    return hashlib.sha256(f"{kind}:{json.dumps(config.to_dict(), sort_keys=True)}".encode()).hexdigest()


def _config_key(config: TrainConfig) -> str:
    return _key("config", config)


def _group_key(config: TrainConfig) -> str:
    """The configurations that share their traces: all but the micro-batch size and the
    accumulation (the estimator traces a shape at two or three micro-batch sizes and scales the
    rest; accumulation 1 takes its traces from accumulation 2's)."""
    return _key("group", config.replace(micro_batch_size=1, grad_accum_steps=1))


class _Claims:
    """Claims in one study, a row each in ``memplan_claims``: a configuration's owning trial
    (``trial_number``), and a group's holding process (``worker``, with a lease the holder
    renews, ``renewals``, at each configuration of it it takes)."""

    def __init__(self, engine: sa.Engine, study_name: str) -> None:
        self.engine = engine
        self.study = study_name
        meta = sa.MetaData()
        self.table = sa.Table(
            "memplan_claims", meta,
            sa.Column("study_name", sa.String(512), primary_key=True),
            sa.Column("claim_sha256", sa.String(64), primary_key=True),
            sa.Column("trial_number", sa.Integer, nullable=True),
            sa.Column("worker", sa.String(255), nullable=True),
            sa.Column("renewals", sa.Integer, nullable=True),
        )
        meta.create_all(engine)  # a race with another process's CREATE: SharedStudy opens again
        self._leases: dict[str, tuple[tuple[str, int], float]] = {}
        """Each group held by another process: (holder, renewals) as last seen, and since when."""

    def _where(self, key: str) -> Any:
        t = self.table
        return sa.and_(t.c.study_name == self.study, t.c.claim_sha256 == key)

    def _insert(self, key: str, **values: Any) -> bool:
        try:
            with self.engine.begin() as conn:
                conn.execute(self.table.insert().values(study_name=self.study, claim_sha256=key, **values))
            return True
        except sa.exc.IntegrityError:
            return False

    def claim(self, key: str, number: int) -> int:
        """The trial that owns ``key``: ``number`` when its insert came first."""
        if self._insert(key, trial_number=number):
            return number
        owner = self.owner(key)
        assert owner is not None  # claims are never deleted
        return owner

    def owner(self, key: str) -> int | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(self.table.c.trial_number).where(self._where(key))).first()
        return None if row is None or row[0] is None else int(row[0])

    def take_over(self, key: str, dead: int, number: int) -> bool:
        """Move the claim of ``key`` from the failed trial ``dead`` to ``number``; False when
        another process moved it first."""
        t = self.table
        with self.engine.begin() as conn:
            done = conn.execute(t.update().where(self._where(key), t.c.trial_number == dead).values(trial_number=number))
        return done.rowcount == 1

    def hold(self, key: str, worker: str, grace: float) -> bool:
        """Hold the group ``key`` for ``worker`` (and renew its lease): True when it was free,
        is ``worker``'s, or its holder let the lease go unrenewed for ``grace`` seconds (as
        this process's clock saw it: no two machines' clocks are compared)."""
        t = self.table
        if self._insert(key, worker=worker, renewals=0):
            return True
        with self.engine.begin() as conn:
            row = conn.execute(sa.select(t.c.worker, t.c.renewals).where(self._where(key))).first()
            assert row is not None
            holder, renewals = str(row[0]), int(row[1])
            if holder == worker:
                conn.execute(t.update().where(self._where(key), t.c.worker == worker).values(renewals=renewals + 1))
                return True
        seen = self._leases.get(key)
        if seen is None or seen[0] != (holder, renewals):
            self._leases[key] = ((holder, renewals), time.monotonic())
            return False
        if time.monotonic() - seen[1] < grace:
            return False
        with self.engine.begin() as conn:  # compare-and-swap: only one process takes it over
            done = conn.execute(t.update().where(self._where(key), t.c.worker == holder, t.c.renewals == renewals)
                                .values(worker=worker, renewals=renewals + 1))
        return done.rowcount == 1


class ChosenSampler(optuna.samplers.BaseSampler):
    """Asks for the configurations the process chose (``queue``: their parameters, one a trial,
    in order), where a process chooses what it answers (an enumerated shared space); an
    enqueued or retried trial keeps its own parameters."""

    def __init__(self) -> None:
        self.queue: list[dict[str, Any]] = []
        self._asked: dict[int, dict[str, Any]] = {}

    def choose(self, queue: list[dict[str, Any]]) -> None:
        assert queue, "nothing chosen"
        self.queue, self._asked = list(queue), {}

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
        return {}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, Any]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: Any) -> Any:
        if trial.number not in self._asked:
            # Asked for no more trials than it holds; past them, the last again (its claim
            # makes it a copy).
            self._asked[trial.number] = self.queue.pop(0) if len(self.queue) > 1 else self.queue[0]
        return self._asked[trial.number][param_name]


class SharedStudy:
    """A study on an RDB storage, with heartbeat, whose configurations are claimed per trial."""

    def __init__(self, *, name: str, storage: str, sampler: optuna.samplers.BaseSampler, key: str,
                 check_key: bool) -> None:
        from ._study import STORAGE_HINT, other_inputs, sqlite_storage

        heartbeat, grace = grace_period()
        for attempt in range(_OPEN_ATTEMPTS):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                options: dict[str, Any] = {
                    "heartbeat_interval": heartbeat,
                    "grace_period": grace,
                    "heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None),
                }
                try:
                    self.storage = (sqlite_storage(storage, **options) if storage.startswith("sqlite:///")
                                    else optuna.storages.RDBStorage(storage, **options))
                    self.study = optuna.create_study(study_name=name, storage=self.storage, sampler=sampler,
                                                     direction="maximize", load_if_exists=True)
                    self.claims = _Claims(self.storage.engine, name)
                    break
                except (sa.exc.IntegrityError, sa.exc.ProgrammingError) as exc:
                    # Processes started together race to create the schema (PostgreSQL's
                    # "duplicate key ... pg_type_typname_nsp_index", "relation ... already
                    # exists"): the loser opens it again.
                    if attempt == _OPEN_ATTEMPTS - 1:
                        raise ConfigError(_cannot_open(storage, exc, STORAGE_HINT)) from None
                    time.sleep(0.2 + random.random())
                except Exception as exc:  # SQLAlchemy's and the drivers' errors: a server down, a bad file
                    if isinstance(exc, ConfigError):
                        raise
                    raise ConfigError(_cannot_open(storage, exc, STORAGE_HINT)) from None
        self.name = name
        self.sampler = sampler
        self.grace = grace
        self.study_id = self.storage.get_study_id_from_name(name)
        recorded = self.study.user_attrs.get("memplan_key")
        if recorded is None:
            self.study.set_user_attr("memplan_key", key)
        elif check_key and recorded != key:
            raise ConfigError(other_inputs(name, storage))
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.answered: dict[TrainConfig, FrozenTrial] = {}
        """A completed trial answering each configuration answered so far."""
        self.held: str | None = None
        """The group whose configurations this process is answering (an enumerated space)."""
        self._seen: set[int] = set()

    @property
    def persistent(self) -> optuna.Study:
        """The study in the storage (the study itself: no copy is kept in memory)."""
        return self.study

    def resumed(self) -> list[FrozenTrial]:
        """The completed trials the study holds now."""
        return self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))

    def refresh(self, objective: Objective, trials: list[FrozenTrial] | None = None) -> None:
        """Learn the answers completed since the last look (at the study's trials, else at
        ``trials``, just read): ``objective`` reuses them, and prunes with the estimates of
        every process."""
        done = self.resumed() if trials is None else [t for t in trials if t.state == TrialState.COMPLETE]
        new = [t for t in done if t.number not in self._seen]
        objective.resume(new)
        for t in new:
            self._seen.add(t.number)
            config = config_from_params(objective.space, t.params)
            if config is None or not _ANSWERS & set(t.user_attrs):
                continue
            self.answered.setdefault(config, t)
            if "pruned" in t.user_attrs:
                objective.pruned.setdefault(config, str(t.user_attrs["pruned"]))

    def trial(self, number: int) -> FrozenTrial:
        return self.storage.get_trial(self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number))

    def fail_stale(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)

    def closed(self, trials: int) -> bool:
        return int(self.study.user_attrs.get("closed_at_trials", 0)) >= trials

    def close(self, trials: int) -> None:
        if not self.closed(trials):
            self.study.set_user_attr("closed_at_trials", trials)


def _cannot_open(storage: str, exc: Exception, hint: str) -> str:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"--storage {storage!r} cannot be opened ({reason}); {hint}"


def _copy(trial: optuna.Trial, stored: FrozenTrial) -> float:
    """Answer ``trial`` with ``stored``'s answer, estimating nothing."""
    for name in sorted(_ANSWERS):
        if name in stored.user_attrs:
            trial.set_user_attr(name, stored.user_attrs[name])
    trial.set_user_attr("same_as", stored.number)
    for name, value in stored.constraints.items():
        trial.set_constraint(name, value)
    return float(stored.value or 0.0)


def _objective(shared: SharedStudy, objective: Objective, *, trials: int,
               exhaustive: bool) -> Callable[[optuna.Trial], float]:
    """The shared study's objective: ``objective``'s, once per configuration over the processes."""

    def answer(trial: optuna.Trial) -> float:
        config = objective.config_of(trial)  # the parameters are in the storage from here on
        if not exhaustive and shared.closed(trials):
            raise optuna.TrialPruned("the shared study has its trials")
        if shared.held is not None:
            shared.claims.hold(shared.held, shared.worker, shared.grace)  # renew the lease
        key = _config_key(config)
        stored = shared.answered.get(config)  # answered already (as of the last look)
        owner = None if stored is not None else shared.claims.claim(key, trial.number)
        last_check = time.monotonic()
        while owner is not None and owner != trial.number:
            other = shared.trial(owner)
            if other.state == TrialState.COMPLETE:
                stored = other
                break
            if other.state.is_finished():  # failed (its process died or was interrupted): answer it here
                owner = trial.number if shared.claims.take_over(key, owner, trial.number) else shared.claims.owner(key)
                continue
            time.sleep(_POLL_S)
            if time.monotonic() - last_check >= 1.0:
                shared.fail_stale()  # an owner that stopped beating is failed, and retried
                last_check = time.monotonic()
        if owner != trial.number and stored is not None and _ANSWERS & set(stored.user_attrs):
            return _copy(trial, stored)
        value = objective.answer(trial, config)
        trial.set_user_attr("worker", shared.worker)  # after answering: a retried trial does not inherit it
        return value

    return answer


def run_shared(shared: SharedStudy, objective: Objective, *, trials: int, exhaustive: bool, progress: bool) -> bool:
    """Answer this process's share of the study's configurations, then wait until the study is
    complete; True when Ctrl-C cut it short. ``objective`` then holds every process's answers."""
    space, estimator = objective.space, objective.estimator
    configs = list(dict.fromkeys(space))
    params = trial_params(space)
    func = _objective(shared, objective, trials=trials, exhaustive=exhaustive)

    def answered_enough() -> bool:
        done = [c for c in configs if c in shared.answered]
        if len(done) == len(configs) or objective.broken:
            return True
        if exhaustive:
            return False
        estimated = [c for c in done if "pruned" not in shared.answered[c].user_attrs]
        asked = len(shared.study.get_trials(deepcopy=False))
        return len(estimated) >= trials or asked >= ROUNDS * trials

    def stop_when_done(study: optuna.Study, _trial: FrozenTrial) -> None:
        shared.refresh(objective)
        if answered_enough():
            if not exhaustive:
                shared.close(trials)
            study.stop()

    def run(n_trials: int, show: bool) -> None:
        # An enumerated space's loop looks at the study between trials itself.
        callbacks = [] if exhaustive else [stop_when_done]
        try:
            shared.study.optimize(func, n_trials=n_trials, show_progress_bar=show, catch=(), callbacks=callbacks)
        except optuna.exceptions.UpdateFinishedTrialError:
            # This trial went without a beat for the grace period: another process failed it
            # and answers its configuration. A longer MEMPLAN_STUDY_GRACE_S avoids that.
            _log.warning("a trial of %s was failed for a missed heartbeat; another process answers it", shared.name)

    # Each process traces only what it answers: no prefetch of the whole space.
    estimator.expect([c for c in configs if objective.under_floor(c) is None], prefetch=False)
    interrupted = False
    try:
        shared.refresh(objective)
        if exhaustive:
            _answer_by_groups(shared, objective, configs, params, run)
        else:
            if not answered_enough():
                from ._study import enqueue_corners  # ._study imports this module

                enqueue_corners(shared.study, space, shared.answered)
                run(trials, progress)
            _wait_for_the_sampled(shared, objective, trials=trials, answered_enough=answered_enough, run=run)
    except KeyboardInterrupt:
        interrupted = True  # this process's running trial fails; another process answers it
    finally:
        estimator.close()
    here = sum(1 for t in shared.answered.values() if t.user_attrs.get("worker") == shared.worker)
    _log.info("shared study %s: %d of %d configurations answered by this process (%s)",
              shared.name, here, len(shared.answered), shared.worker)
    return interrupted


def _answer_by_groups(shared: SharedStudy, objective: Objective, configs: list[TrainConfig],
                      params: dict[TrainConfig, dict[str, object]], run: Callable[[int, bool], None]) -> None:
    """An enumerated space, answered a group of configurations at a time (``_group_key``: those
    whose traces are one shape's) until every configuration is answered: each process holds a
    group and answers its configurations, then holds the next free one, so that a shape is
    traced by one process. With no group free, a process waits; a group whose holder stopped
    renewing it for the grace period (a dead process) is taken over, and trials enqueued again
    (a dead process's, retried) are answered by whoever looks first."""
    assert isinstance(shared.sampler, ChosenSampler)
    groups: dict[str, list[TrainConfig]] = {}
    for config in configs:
        groups.setdefault(_group_key(config), []).append(config)
    held: str | None = None
    while True:
        shared.fail_stale()
        everything = shared.study.get_trials(deepcopy=False)
        shared.refresh(objective, everything)
        if objective.broken:
            return
        if all(c in shared.answered for c in configs):
            return
        pending = [t for t in everything if t.state in (TrialState.RUNNING, TrialState.WAITING)]
        waiting = [params[c] for c in _configs_of(objective, [t for t in pending if t.state == TrialState.WAITING])
                   if c in params and c not in shared.answered]
        if waiting:
            # Whoever pops one first answers it; a trial of this process's that finds them
            # popped asks for their configurations all the same (and copies, or waits).
            shared.sampler.choose(waiting)
            run(len(waiting), False)
            continue
        busy = set(_configs_of(objective, pending))
        todo = {g: [c for c in group if c not in shared.answered and c not in busy] for g, group in groups.items()}
        if held is not None and not (todo[held] and shared.claims.hold(held, shared.worker, shared.grace)):
            held = None
        if held is None:
            held = next((g for g in groups if todo[g] and shared.claims.hold(g, shared.worker, shared.grace)), None)
        if held is None:
            time.sleep(_IDLE_S)  # every group left is another live process's
            continue
        # The group's configurations in one go, the lease renewed at each (``_objective``).
        shared.held = held
        shared.sampler.choose([params[c] for c in todo[held]])
        run(len(todo[held]), False)
        shared.held = None


def _wait_for_the_sampled(shared: SharedStudy, objective: Objective, *, trials: int,
                          answered_enough: Callable[[], bool], run: Callable[[int, bool], None]) -> None:
    """A sampled space, until ``trials`` configurations are answered: the study is then closed,
    and complete once no trial with a whole configuration runs."""
    while True:
        shared.fail_stale()
        shared.refresh(objective)
        if objective.broken:
            return
        if answered_enough():
            shared.close(trials)
        if shared.closed(trials):
            # A trial still writing its parameters reads the close after them, and is pruned:
            # only those with a whole configuration may still answer.
            running = shared.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if not any(True for _ in _configs_of(objective, running)):
                return
            time.sleep(_IDLE_S)
            continue
        run(1, False)  # still short of the budget (a trial cut short elsewhere)


def _configs_of(objective: Objective, trials: Iterable[FrozenTrial]) -> Iterable[TrainConfig]:
    for t in trials:
        fixed = t.system_attrs.get("fixed_params")
        config = config_from_params(objective.space, {**t.params, **(fixed if isinstance(fixed, dict) else {})})
        if config is not None:
            yield config
