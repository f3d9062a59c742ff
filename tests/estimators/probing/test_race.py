"""Tests of races (estimators.probing._race): two configurations timed step against step in one
probe child, every failure a status, no process left behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.models import SLEEPY  # noqa: E402 - shared with the search's tests

# The probe tests' fixtures: a 60 s bound per test, and one probe server for the module.
from helpers.probe import assert_no_probe_children, probe_server, time_bound, write_model  # noqa: F401

from estimators import TrainConfig
from estimators._errors import ConfigError
from estimators.probing._race import RaceResult, race

PLAIN = TrainConfig(micro_batch_size=8)
CHECKPOINTED = TrainConfig(micro_batch_size=8, checkpoint_segments=2)


def test_race_times_both_configurations_in_alternation(tmp_path: Path) -> None:
    path = write_model(tmp_path, SLEEPY)
    result = race(path, (CHECKPOINTED, PLAIN), rounds=4, warmup=1)
    assert result.ok, result.message
    assert result.configs == (CHECKPOINTED, PLAIN)
    assert [len(t) for t in result.step_times] == [4, 4]
    # Two blocks sleep 50 ms each: >= 100 ms a plain step, >= 200 ms checkpointed.
    assert min(result.step_times[1]) >= 0.1 and min(result.step_times[0]) >= 0.2
    assert result.ratio > 1.5 and result.second_wins == 4
    assert result.median_step_s(0) > result.median_step_s(1)
    assert_no_probe_children()


def test_race_reports_the_models_error_as_a_status(tmp_path: Path) -> None:
    path = write_model(tmp_path, SLEEPY, """
    def loss(model, batch):
        raise ValueError("the loss is broken")
    """)
    result = race(path, (CHECKPOINTED, PLAIN), rounds=2, warmup=0)
    assert result.status == "error" and not result.ok and result.step_times == ()
    assert "ValueError: the loss is broken" in result.message and "\n" not in result.message
    assert_no_probe_children()


def test_race_times_out_and_leaves_no_process(tmp_path: Path) -> None:
    path = write_model(tmp_path, SLEEPY.replace("time.sleep(0.05)", "time.sleep(30)"))
    t0 = time.monotonic()
    result = race(path, (CHECKPOINTED, PLAIN), rounds=2, warmup=0, timeout_s=3)
    assert result.status == "timeout" and time.monotonic() - t0 < 15
    assert "against" in result.message and "did not finish within 3 s" in result.message
    assert_no_probe_children()


@pytest.mark.parametrize("configs, kwargs, match", [
    ((PLAIN, PLAIN), {}, "two different configurations"),
    ((PLAIN,), {}, "exactly two"),
    ((PLAIN, TrainConfig(micro_batch_size=4, strategy="ddp", world_size=2)), {}, "strategy single"),
    ((PLAIN, CHECKPOINTED), {"rounds": 0}, "rounds must be"),
    ((PLAIN, CHECKPOINTED), {"warmup": -1}, "warmup must be"),
    ((PLAIN, CHECKPOINTED), {"timeout_s": 0}, "timeout_s must be"),
])
def test_bad_race_arguments_raise_before_any_process_starts(tmp_path: Path, configs, kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        race(write_model(tmp_path, SLEEPY), configs, **kwargs)


def test_ratio_and_wins_are_per_round() -> None:
    result = RaceResult(status="ok", configs=(PLAIN, CHECKPOINTED),
                        step_times=((1.0, 2.0, 3.0), (2.0, 1.0, 1.0)))
    # The rounds' ratios are 0.5, 2 and 3; the second is faster in the last two.
    assert result.ratio == 2.0 and result.second_wins == 2
    assert result.median_step_s(0) == 2.0 and result.median_step_s(1) == 1.0
