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
"""

from __future__ import annotations

import sqlite3
import time
import warnings
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

__all__ = ["MirroredStudy"]


def _sqlite_storage(url: str) -> optuna.storages.RDBStorage:
    path = url[len("sqlite:///"):]

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(path, timeout=60, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    return optuna.storages.RDBStorage(url, engine_kwargs={"creator": connect})


class MirroredStudy:
    """An in-memory study (``.study``) whose trials are copied to ``storage``."""

    def __init__(self, *, name: str, storage: str, sampler: optuna.samplers.BaseSampler,
                 tuned_sqlite: bool = False, flush_s: float = 2.0) -> None:
        backend: Any = _sqlite_storage(storage) if tuned_sqlite and storage.startswith("sqlite:///") else storage
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.persistent = optuna.create_study(study_name=name, storage=backend, direction="maximize",
                                                  load_if_exists=True)
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
