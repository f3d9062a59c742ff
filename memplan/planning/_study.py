"""A search's Optuna study: run in memory, kept in persistent storage.

An RDB storage costs tens of milliseconds per trial (a transaction for every suggested
parameter, user attribute and constraint): on SQLite that was a third of a small model's
whole search. The study therefore runs on Optuna's in-memory storage, seeded with the
completed trials of the persistent study of the same name (a resumed or shared study), and
its new trials are written to the persistent study in batches: at most ``flush_s`` apart,
and when the search ends or is interrupted. A hard kill loses at most the last batch.

The default storage, a SQLite file in the cache directory, runs in WAL mode with
``synchronous=NORMAL`` (a commit is durable against a process crash, not against a power
cut, which costs only re-estimated trials): creating its schema went from ~1 s to ~0.1 s.
A storage URL given by the user is opened as given.

A study several processes share (a PostgreSQL or MySQL URL, or ``shared=True``) cannot run in
memory: its processes must see each other's trials as they run. It runs on the storage, its
configurations claimed per trial (``._shared``).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from estimators import ConfigError, Estimator, Task, TrainConfig

from .._version import __version__
from ._shared import ChosenSampler, SharedStudy
from ._space import SearchSpace

__all__ = ["MirroredStudy", "default_storage", "open_study", "enqueue_corners", "check_storage", "STORAGE_HINT",
           "sqlite_storage", "other_inputs", "enumerates",
           "DEFAULT_TRIALS", "ENUMERATE_LIMIT", "enqueue_ascending"]

STORAGE_HINT = "give an Optuna storage URL such as sqlite:///studies.db or postgresql://user@host/db"


def check_storage(url: str | None) -> None:
    """A ``--storage`` URL that Optuna can open, checked before the search: its form and its
    database driver (SQLAlchemy's), and for SQLite that its folder exists. A database that
    cannot be reached is found when the study opens (``MirroredStudy``), also as one line."""
    if url is None:
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
        parsed.get_dialect()
    except (ArgumentError, ValueError) as exc:
        raise ConfigError(f"--storage {url!r} is not a database URL ({exc}); {STORAGE_HINT}") from None
    except NoSuchModuleError:
        raise ConfigError(f"--storage {url!r}: no database driver for {parsed.drivername!r}; {STORAGE_HINT}") from None
    except ImportError as exc:
        raise ConfigError(f"--storage {url!r} needs a database driver that is not installed ({exc.name}); "
                          f"pip install it, or {STORAGE_HINT}") from None
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        folder = Path(parsed.database).expanduser().resolve().parent
        if not folder.is_dir():
            raise ConfigError(f"--storage {url!r}: folder {folder} does not exist; create it or {STORAGE_HINT}")


def default_storage() -> str:
    """The default storage: ``studies.db`` under ``$MEMPLAN_CACHE_DIR`` (else ``~/.cache/memplan``)."""
    root = os.environ.get("MEMPLAN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "memplan")
    Path(root).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{os.path.join(root, 'studies.db')}"


def sqlite_storage(url: str, **options: Any) -> optuna.storages.RDBStorage:
    """A SQLite storage in WAL mode with ``synchronous=NORMAL`` (``options``: RDBStorage's)."""
    path = url[len("sqlite:///"):]

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(path, timeout=60, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    return optuna.storages.RDBStorage(url, engine_kwargs={"creator": connect}, **options)


class MirroredStudy:
    """An in-memory study (``.study``) whose trials are copied to ``storage``."""

    def __init__(self, *, name: str, storage: str, sampler: optuna.samplers.BaseSampler,
                 tuned_sqlite: bool = False, flush_s: float = 2.0) -> None:
        backend: Any = sqlite_storage(storage) if tuned_sqlite and storage.startswith("sqlite:///") else storage
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            try:
                self.persistent = optuna.create_study(study_name=name, storage=backend, direction="maximize",
                                                      load_if_exists=True)
            except Exception as exc:  # SQLAlchemy's and the drivers' errors: a server down, a bad file
                if isinstance(exc, ConfigError):
                    raise
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ConfigError(f"--storage {storage!r} cannot be opened ({reason}); {STORAGE_HINT}") from None
            self.study = optuna.create_study(study_name=name, sampler=sampler, direction="maximize")
        done = self.persistent.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        self.study.add_trials(done)
        self._written = {t.number for t in self.study.trials}
        self._flush_s = flush_s
        self._last = time.monotonic()

    def resumed(self) -> list[FrozenTrial]:
        """The completed trials the study started with."""
        return self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))

    def optimize(self, objective: Callable[[optuna.Trial], float], *, n_trials: int, progress: bool) -> None:
        """``study.optimize`` that writes finished trials through; re-raises what stopped it
        (a ``KeyboardInterrupt`` included) after writing the trials finished so far."""
        try:
            self.study.optimize(objective, n_trials=n_trials, show_progress_bar=progress, catch=(),
                                callbacks=[self._maybe_flush])
        finally:
            self.flush()

    def _maybe_flush(self, _study: optuna.Study, _trial: FrozenTrial) -> None:
        if time.monotonic() - self._last >= self._flush_s:
            self.flush()

    def flush(self) -> None:
        """Write the trials completed since the last flush (Optuna fails a trial cut short by
        an interrupt: it is left out, and estimated again when the study resumes)."""
        new = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
               if t.number not in self._written]
        if new:
            self.persistent.add_trials(new)
            self._written.update(t.number for t in new)
        self._last = time.monotonic()


def _study_name(task: Task, estimator: Estimator, budget: int, margin: float, space: SearchSpace,
                host_limit: int | None = None) -> str:
    return f"memplan-{task.name}-{_study_key(task, estimator, budget, margin, space, host_limit)[:12]}"


def _study_key(task: Task, estimator: Estimator, budget: int, margin: float, space: SearchSpace,
               host_limit: int | None = None) -> str:
    """A hash of everything the study's figures depend on (its name holds the first 12 digits)."""
    key = "|".join(str(x) for x in (
        task.source_hash or task.name, estimator.device, estimator.spec.name if estimator.spec else "",
        budget, margin, space.global_batch, space.micro_batch_sizes, space.precisions,
        space.checkpoint_segments, tuple(layout.key for layout in space.layouts), torch.__version__,
        # The step the estimates are of (clipping, EMA, ...) and the code that made them: a
        # study of another step or another memplan holds figures this one would not produce.
        task.step.key(), __version__,
        # Only a non-default policy names itself, so that existing studies keep their names.
        *((task.shape_policy,) if task.shape_policy != "max" else ()),
        *((space.grouping,) if space.grouping != (False,) else ()),
        *((tuple(t.name for t in space.techniques),) if space.techniques else ()),
        # The host's limit decides which offloaded configurations fit (or were set aside
        # untraced): a study made under another one answers differently.
        *((f"host {host_limit}",) if host_limit is not None else ()),
    ))
    return hashlib.sha256(key.encode()).hexdigest()


def open_study(task: Task, estimator: Estimator, *, budget: int, margin: float, space: SearchSpace, trials: int,
               seed: int | None, storage: str | None, shared: bool = False,
               study_name: str | None = None, survivors: int | None = None,
               enumerate_limit: int | None = None, host_limit: int | None = None) -> tuple[MirroredStudy | SharedStudy, bool]:
    """The study of this task, target, budget and space (resumed when it exists), and whether
    it enumerates the space: a space no larger than ``trials`` is asked whole
    (``BruteForceSampler``), a larger one sampled by a seeded TPE sampler. ``shared``: the
    study runs on the storage, its configurations split with the other processes that open it
    (``._shared``); their samplers are not seeded, or all would ask the same configuration
    first. ``survivors``: the configurations the model states alone do not rule out (a study
    of one process enumerates up to ``enumerate_limit`` of them, default ``ENUMERATE_LIMIT``).
    ``study_name`` names the study (else a hash of its inputs does), and the study records the
    hash of its inputs: a named study of other inputs is refused."""
    # Optuna's own warnings (a trial cut short by Ctrl-C) are not the user's business.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    # A shared study splits an enumerated space by the trial budget: it keeps the plain rule.
    exhaustive = enumerates(space, trials, None if shared else survivors, enumerate_limit)
    key = _study_key(task, estimator, budget, margin, space, host_limit)
    name = study_name or _study_name(task, estimator, budget, margin, space, host_limit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler: optuna.samplers.BaseSampler
        if shared:
            # An enumerated space: each process chooses what it answers (by groups that share
            # their traces); a sampled one: TPE, a running trial counting as asked.
            sampler = ChosenSampler() if exhaustive else optuna.samplers.TPESampler(constant_liar=True)
            return SharedStudy(name=name, storage=storage or default_storage(), sampler=sampler, key=key,
                               check_key=study_name is not None), exhaustive
        sampler = optuna.samplers.BruteForceSampler(seed=seed) if exhaustive else optuna.samplers.TPESampler(seed=seed)
    mirrored = MirroredStudy(name=name, storage=storage or default_storage(), sampler=sampler,
                             tuned_sqlite=storage is None)
    if study_name is not None:
        recorded = mirrored.persistent.user_attrs.get("memplan_key")
        if recorded is None:
            mirrored.persistent.set_user_attr("memplan_key", key)
        elif recorded != key:
            raise ConfigError(other_inputs(study_name, storage or default_storage()))
    return mirrored, exhaustive


DEFAULT_TRIALS = 60
"""The trial budget of a search not given one."""

ENUMERATE_LIMIT = 200
"""A space is enumerated, whatever the default trial budget, when at most this many of its
configurations are left once those whose model states alone exceed the budget are set aside
(a budget the user gives is the limit instead: ``--trials 3`` asks for a quick search):
the others cost no trace, and asked from the least memory up, each miss prunes the larger
ones of its kind without one. Measured on an 8B model for an A100-80GB (405 configurations,
135 left by the states): 32 estimated, 123 s on a shared 2-core machine against 183 s for 24
sampled trials, and a plan 33% faster than
theirs (``benchmarks/results/search_exhaustive.md``)."""


def enumerates(space: SearchSpace, trials: int, survivors: int | None = None, limit: int | None = None) -> bool:
    """Whether a search of ``trials`` asks the whole of ``space`` (else it samples it):
    when it is no larger than ``trials``, or when ``survivors`` (its configurations that the
    model states alone do not rule out) are at most ``max(trials, limit)`` (default
    ``ENUMERATE_LIMIT``)."""
    limit = ENUMERATE_LIMIT if limit is None else limit
    return len(space) <= trials or (survivors is not None and survivors <= max(trials, limit))


def other_inputs(name: str, storage: str) -> str:
    """The refusal of a named study that holds another search."""
    return (f"study {name!r} in {storage!r} holds another search (other model, target, budget, space or "
            "versions); give another --study-name, or the same inputs as the study's other processes")


def enqueue_corners(study: optuna.Study, space: SearchSpace, done: Iterable[TrainConfig]) -> None:
    """Ask first for the corners most likely to need the least memory (``space.smallest()``),
    those not answered yet: when nothing fits, the nearest miss is among them."""
    done = set(done)
    for corner, params in space.smallest():
        if corner not in done:
            study.enqueue_trial(params, skip_if_exists=True)


def enqueue_ascending(study: optuna.Study, space: SearchSpace, candidates: Iterable[TrainConfig],
                      done: Iterable[TrainConfig]) -> None:
    """Ask an enumerated space's ``candidates`` (those not done) from the least memory up: by
    micro-batch, then by checkpointed blocks, most first. A configuration that holds at least
    as much as one estimated not to fit is then pruned without a trace (``Objective.prune``)
    when asked, which asking in the sampler's order would leave to chance."""
    from ._objective import trial_params

    done, params = set(done), trial_params(space)
    for config in sorted((c for c in candidates if c not in done and c in params),
                         key=lambda c: (c.micro_batch_size, -c.checkpoint_segments)):
        study.enqueue_trial(params[config], skip_if_exists=True)
