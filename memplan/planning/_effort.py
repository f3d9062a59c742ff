"""A search proportional to the job: the measured part (probes, races, compiled probes)
budgeted against the predicted training time.

Static estimates cost what they cost (traces); what runs real steps is budgeted: by default
at most ``search_effort`` = 10% of the predicted training time (the best prediction's samples/s
over the run's samples), and never less than ``MIN_MEASURED_S``, so that a short run is not
searched for longer than it trains. What the budget skipped is said in the plan, with the
``--search-effort`` that would measure it.
"""

from __future__ import annotations

import math
import time

from estimators import ConfigError, Task
from estimators.task._settings import DEFAULT_EPOCHS

from ._plan import PlanEntry

__all__ = ["MeasuredBudget", "DEFAULT_SEARCH_EFFORT", "MIN_MEASURED_S", "COMPILE_COST_S", "check_search_effort"]

DEFAULT_SEARCH_EFFORT = 0.1
"""The share of the predicted training time the measured search may take."""

MIN_MEASURED_S = 5.0
"""The measured budget's floor: the race of the two best (a few seconds) always runs."""

COMPILE_COST_S = 20.0
"""What probing one configuration compiled costs at least on a CPU (the compile, then a race
against eager): skipped when less of the budget is left. digits.py: ~30 s on 2 cores."""



def check_search_effort(value: float) -> float:
    """``value`` as a share > 0 of the training time (else one line naming the fix)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or math.isnan(value):
        raise ConfigError(f"--search-effort must be a number > 0 (the share of the predicted training time the "
                          f"probes, races and compiled probes may take; default 0.1), got {value!r}")
    return float(value)


def training_seconds(task: Task, best: PlanEntry, global_batch: int) -> float | None:
    """The predicted training time of ``best``: the run's samples (``max_steps``, else
    ``epochs`` of the training set, from the model's settings) at its predicted samples/s;
    None when unknown (no training set, no speed)."""
    speed = best.predicted.samples_per_s
    size = task.dataset_size()
    if not speed or size is None:
        return None
    settings = task.settings
    steps = settings.get("max_steps")
    if not isinstance(steps, int) or steps <= 0:
        epochs = settings.get("epochs", DEFAULT_EPOCHS)
        per_epoch = max(1, size // max(1, global_batch))
        steps = int(epochs if isinstance(epochs, int | float) else DEFAULT_EPOCHS) * per_epoch
    return steps * global_batch / speed


class MeasuredBudget:
    """Seconds the measured part of a search may take, and what it skipped."""

    def __init__(self, effort: float, training_s: float | None) -> None:
        self.effort = effort
        self.training_s = training_s
        self.seconds = math.inf if training_s is None else max(MIN_MEASURED_S, effort * training_s)
        self.started = time.monotonic()
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def allows(self, step: str, cost_s: float) -> bool:
        """Whether ``step`` (about ``cost_s``) fits what is left; a skip is kept for the note."""
        if self.left() >= cost_s:
            return True
        self.skipped.append(step)
        return False

    def note(self) -> str | None:
        """The plan's note on what the budget skipped (None: nothing)."""
        if not self.skipped or self.training_s is None:
            return None
        spent = time.monotonic() - self.started
        return (f"search effort {self.effort:g}: measured for {spent:.0f} s of a {self.seconds:.0f} s budget "
                f"({self.effort:.0%} of the predicted {self.training_s:.0f} s of training, at least "
                f"{MIN_MEASURED_S:.0f} s); skipped {', '.join(self.skipped)}; --search-effort "
                f"{_more(self.effort, self.training_s, spent)} (search_effort=) measures them")


def _more(effort: float, training_s: float, spent: float) -> str:
    """An effort that would have left room for a compiled probe after what was spent."""
    needed = (spent + COMPILE_COST_S) / max(training_s, 1e-9)
    return f"{math.ceil(max(needed, effort * 2) * 100) / 100:g}"  # rounded up: it must leave the room
