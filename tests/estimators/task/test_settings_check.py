"""The model file's ``settings``: misspelt keys and wrong values are one-line errors where the
task is made, the user's own keys one warning each (estimators.task._settings)."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import memplan
from estimators import ConfigError, Task, load_task
from estimators.task._settings import SETTINGS_KEYS, check_settings
from memplan._option_sources import option_specs
from memplan.cli import main

ROOT = Path(__file__).resolve().parents[3]

MODEL = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

nan = float("nan")  # repr(float("nan"))
settings = {SETTINGS}

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
"""


def _source(settings: dict) -> str:
    return MODEL.replace("{SETTINGS}", repr(settings))


def _task(settings: dict, name: str = "t") -> Task:
    return Task(name=name, build_model=lambda: nn.Linear(8, 3),
                train_data=lambda: TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,))),
                settings=settings)


def _ignored(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "memplan" and "not a memplan setting" in r.getMessage()]


def test_the_known_keys_are_the_options_and_the_three_of_their_own():
    assert SETTINGS_KEYS == {s.name for s in option_specs()} | {"global_batch", "weight_decay", "target"}


# (settings, the key the message names)
REFUSED = {
    "typo": ({"global_bach": 16}, "global_bach"),
    "case": ({"Epochs": 3}, "Epochs"),
    "singular": ({"warmup_step": 10}, "warmup_step"),
    "lr word": ({"lr": "fast"}, "lr"),
    "lr quoted": ({"lr": "3e-4"}, "lr"),
    "lr zero": ({"lr": 0}, "lr"),
    "lr nan": ({"lr": float("nan")}, "lr"),
    "batch fraction": ({"global_batch": 16.5}, "global_batch"),
    "batch float": ({"global_batch": 16.0}, "global_batch"),
    "batch bool": ({"global_batch": True}, "global_batch"),
    "batch word": ({"global_batch": "x"}, "global_batch"),
    "batch zero": ({"global_batch": 0}, "global_batch"),
    "epochs fraction": ({"epochs": 2.5}, "epochs"),
    "max_steps word": ({"max_steps": "many"}, "max_steps"),
    "warmup negative": ({"warmup_steps": -1}, "warmup_steps"),
    "decay negative": ({"weight_decay": -1}, "weight_decay"),
    "decay quoted": ({"weight_decay": "0.1"}, "weight_decay"),
    "target word": ({"target": "high"}, "target"),
    "target no value": ({"target": {"metric": "val_accuracy"}}, "target"),
    "target value word": ({"target": {"metric": "val_accuracy", "value": "high"}}, "target"),
    "target metric number": ({"target": {"metric": 1, "value": 0.9}}, "target"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_setting_is_one_line_naming_key_and_file(case, write_model):
    settings, key = REFUSED[case]
    with pytest.raises(ConfigError) as info:
        load_task(write_model(_source(settings)))
    message = str(info.value)
    assert message.startswith(f"settings[{key!r}] in model_file.py "), message
    assert "\n" not in message
    assert repr(settings[key])[:20] in message or "did you mean" in message


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_setting_is_refused_by_every_way_a_task_is_made(case):
    settings, key = REFUSED[case]
    with pytest.raises(ConfigError, match=rf"^settings\[{key!r}\] in t "):
        _task(settings)
    with pytest.raises(ConfigError, match=rf"^settings\[{key!r}\] in Linear "):
        Task.from_module(nn.Linear(8, 3), (torch.randn(4, 8), torch.randint(0, 3, (4,))), settings=settings)
    with pytest.raises(ConfigError, match=rf"^settings\[{key!r}\] in t "):
        dataclasses.replace(_task({}), settings=settings)


def test_the_messages_say_what_to_write():
    with pytest.raises(ConfigError) as info:
        check_settings({"global_bach": 16}, "model.py")
    assert str(info.value).startswith(
        "settings['global_bach'] in model.py is not a memplan setting; did you mean 'global_batch'?")
    with pytest.raises(ConfigError) as info:
        check_settings({"lr": "fast"}, "digits.py")
    assert str(info.value) == ("settings['lr'] in digits.py must be a finite number > 0 or \"auto\" (memplan lr-find's "
                               "suggestion), got 'fast'; write e.g. \"lr\": 3e-4, or leave it out for the default")
    with pytest.raises(ConfigError, match=r"got '32'; write it without quotes, \"global_batch\": 32$"):
        check_settings({"global_batch": "32"}, "model.py")


def test_a_misspelt_key_on_the_command_line_is_exit_2_and_one_line(write_model, capsys):
    path = write_model(_source({"global_bach": 16}))
    code = main(["estimate", path, "-b", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("memplan: settings['global_bach'] in model_file.py is not a memplan setting; "
                          "did you mean 'global_batch'?")


def test_a_key_of_the_users_own_is_warned_once_and_planning_works(write_model, caplog):
    path = write_model(_source({"global_batch": 8, "hidden": 16, "momentum": 0.9}))
    with caplog.at_level(logging.WARNING, logger="memplan"):
        task = load_task(path)
        # Copies of the task (a shape policy, a probe's settings) do not warn again.
        copy = dataclasses.replace(task.with_shape_policy("p99"), settings=dict(task.settings))
        plan = memplan.search(copy, vram="1GB", device="cpu", trials=4, probe_top=0, compile_top=0,
                              storage="sqlite:///:memory:", precisions=["fp32"], checkpoint_segments=[0])
    assert sorted(_ignored(caplog)) == [
        "settings['hidden'] in model_file.py is not a memplan setting; memplan ignores it",
        "settings['momentum'] in model_file.py is not a memplan setting; memplan ignores it",
    ]
    assert plan.best.config.global_batch == 8


def test_the_warning_reaches_the_command_lines_stderr_once(write_model):
    path = write_model(_source({"global_batch": 8, "hidden": 16}))
    done = subprocess.run([sys.executable, "-c", "import sys; from memplan.cli import main; "
                           f"sys.exit(main(['estimate', {path!r}, '-b', '4']))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("not a memplan setting") == 1, done.stderr
    assert "settings['hidden'] in model_file.py is not a memplan setting; memplan ignores it" in done.stderr


def test_the_default_optimizer_reads_the_checked_values():
    model = nn.Linear(8, 3)
    # "auto" is lr-find's to fill in (the trainer sets it once a plan is chosen); None is unset.
    for settings in ({"lr": "auto"}, {"lr": "AUTO", "weight_decay": None}, {"lr": None}):
        opt = _task(settings).make_optimizer(model)
        assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["weight_decay"] == 0.01
    opt = _task({"lr": np.float32(0.5), "weight_decay": 0}).make_optimizer(model)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["weight_decay"] == 0.0


VALID = sorted([ROOT / "examples" / "digits.py", ROOT / "examples" / "tiny_gpt.py",
                *(ROOT / "benchmarks" / "models").glob("*.py")])


@pytest.mark.parametrize("path", VALID, ids=[p.name for p in VALID])
def test_the_shipped_model_files_settings_are_accepted(path, caplog):
    with caplog.at_level(logging.WARNING, logger="memplan"):
        task = load_task(path)
    assert task.settings and check_settings(task.settings, path.name) == ()
    assert not _ignored(caplog)
    # Checked, not skipped: the same settings with one misspelt key more are refused.
    with pytest.raises(ConfigError, match=rf"^settings\['epoch'\] in {path.name} .*did you mean 'epochs'"):
        dataclasses.replace(task, settings={**task.settings, "epoch": 1})


def test_the_init_template_and_other_valid_values_are_accepted(tmp_path, caplog):
    from memplan.cli._init import write_templates

    model_path = next(p for p in write_templates(tmp_path) if p.suffix == ".py")
    with caplog.at_level(logging.WARNING, logger="memplan"):
        assert load_task(model_path).settings
    assert not _ignored(caplog)
    valid = {"global_batch": np.int64(16), "lr": "auto", "epochs": None, "max_steps": 5, "warmup_steps": 0,
             "weight_decay": 0, "target": {"metric": "val_loss", "value": 2, "note": "kept"}, "ema_decay": 0.99}
    assert check_settings(valid, "model.py") == ()
    task = _task(valid)
    assert task.settings["global_batch"] == 16
    assert task.make_optimizer(nn.Linear(8, 3)).param_groups[0]["lr"] == 1e-3  # "auto": lr-find's, later
