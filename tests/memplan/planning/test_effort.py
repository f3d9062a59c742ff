"""The measured part of a search (probes, races, compiled probes) is budgeted against the
predicted training time, and the plan says what the budget skipped."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from estimators import ConfigError, Task
from memplan.cli import main
from memplan.planning import PlanEntry
from memplan.planning._effort import MIN_MEASURED_S, MeasuredBudget, check_search_effort, training_seconds


def _entry(samples_per_s: float) -> PlanEntry:
    # Only the prediction's speed is read.
    return SimpleNamespace(predicted=SimpleNamespace(samples_per_s=samples_per_s))  # type: ignore[return-value]


def test_the_training_time_is_the_settings_run_at_the_predicted_speed() -> None:
    data = TensorDataset(torch.randn(105, 4), torch.randint(0, 2, (105,)))
    task = Task(name="t", build_model=lambda: nn.Linear(4, 2), train_data=lambda: data, settings={"epochs": 2})
    entry = _entry(samples_per_s=50.0)
    # 105 // 10 = 10 steps an epoch, 2 epochs, 10 samples a step, at 50 samples/s.
    assert training_seconds(task, entry, 10) == pytest.approx(2 * 10 * 10 / entry.predicted.samples_per_s)
    steps = dataclasses.replace(task, settings={"max_steps": 7})
    assert training_seconds(steps, entry, 10) == pytest.approx(7 * 10 / entry.predicted.samples_per_s)
    assert training_seconds(dataclasses.replace(task, train_data=None), entry, 10) is None


def test_a_short_run_gets_the_floor_and_the_plan_says_what_was_skipped() -> None:
    budget = MeasuredBudget(0.1, training_s=15.0)
    assert budget.seconds == MIN_MEASURED_S
    assert budget.allows("a race", 1.0)
    assert not budget.allows("the compiled probe (torch.compile)", 20.0)
    note = budget.note()
    assert note is not None and "skipped the compiled probe (torch.compile)" in note and "--search-effort" in note
    # The effort it names leaves room for what was skipped.
    asked = float(note.split("--search-effort ")[1].split()[0])
    assert MeasuredBudget(asked, training_s=15.0).allows("again", 20.0)


def test_a_long_run_or_an_unknown_one_skips_nothing() -> None:
    assert MeasuredBudget(0.1, training_s=3600.0).allows("the compiled probe", 20.0)
    unknown = MeasuredBudget(0.1, training_s=None)
    assert unknown.allows("anything", 1e9) and unknown.note() is None


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True])
def test_a_bad_effort_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="--search-effort must be a number > 0"):
        check_search_effort(bad)


def test_the_command_line_refuses_a_bad_effort_in_one_line(capsys) -> None:
    assert main(["plan", "examples/digits.py", "--vram", "1GB", "--search-effort", "lots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--search-effort must be a number > 0" in err and "'lots'" in err
