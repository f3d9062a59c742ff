"""The step a model file's settings ask the trainer for (clipping, EMA, label smoothing) is the
step its plans and estimates are of, as the trainer's options make it of the same keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from estimators import ConfigError, Estimator, StepOptions, Task, TrainConfig, load_task
from memplan._fit import _options_from
from memplan.cli import main

MODEL = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g))

settings = SETTINGS
"""


@pytest.mark.parametrize("settings, step", [
    ({}, StepOptions()),
    ({"ema_decay": 0.99, "grad_clip": None}, StepOptions(clip="off", ema_decay=0.99)),
    ({"grad_clip": 0.5, "grad_clip_mode": "value", "label_smoothing": 0.1},
     StepOptions(clip="value", clip_threshold=0.5, label_smoothing=0.1)),
], ids=["defaults", "ema-no-clipping", "clip-by-value-smoothed"])
def test_the_files_step_is_the_trainers(settings, step, write_model) -> None:
    task = load_task(write_model(MODEL.replace("SETTINGS", repr(settings))))
    assert task.step == step
    # What the trainer's options make of the same settings (fit estimates that step).
    assert _options_from(task, {}).step_options() == task.step
    module = Task.from_module(nn.Linear(4, 2), (torch.randn(2, 4), torch.randint(0, 2, (2,))), settings=settings)
    assert module.step == step


def test_an_ema_in_the_settings_is_in_the_estimate(write_model, capsys) -> None:
    plain = write_model(MODEL.replace("SETTINGS", "{}"), name="plain.py")
    ema = write_model(MODEL.replace("SETTINGS", repr({"ema_decay": 0.99})), name="ema.py")
    config = TrainConfig(micro_batch_size=8)
    peaks = [Estimator(load_task(p), device="cpu").estimate(config).peak_allocated_bytes for p in (plain, ema)]
    params = (64 * 256 + 256 + 256 * 10 + 10) * 4
    assert peaks[1] - peaks[0] >= params  # the EMA's copy of the weights


@pytest.mark.parametrize("settings, expected", [
    ({"grad_clip": "big"}, "settings['grad_clip'] in model_file.py must be a number"),
    ({"grad_clip": -1.0}, "settings['grad_clip'] in model_file.py must be > 0"),
    ({"grad_clip_mode": "l2"}, "settings['grad_clip_mode'] in model_file.py must be 'norm', 'value' or 'off'"),
    ({"ema_decay": 1.5}, "settings['ema_decay'] in model_file.py must be in (0, 1)"),
])
def test_a_bad_step_setting_is_one_line(settings, expected, write_model, capsys) -> None:
    path = write_model(MODEL.replace("SETTINGS", repr(settings)))
    with pytest.raises(ConfigError, match="settings"):
        load_task(path)
    code = main(["estimate", path, "-b", "4"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and expected in err, err
