"""A plan file never silently trains something other than what was planned: a hand-edited entry
that contradicts the plan is refused on load, a plan made for another model is refused (an edited
file of the same structure is one warning), and a --vram the target cannot have is said."""

from __future__ import annotations

import json
import logging
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import memplan
from estimators import ConfigError, Estimator, Task, load_task
from memplan.planning import Plan, check_plan_model
from memplan.planning._inputs import _physical_ram, vram_beyond_device

GLOBAL = 16
SMALL: dict[str, Any] = {"vram": "1GB", "device": "cpu", "trials": 4, "probe_top": 0, "compile_top": 0,
                         "storage": "sqlite:///:memory:", "precisions": ["fp32"], "checkpoint_segments": [0],
                         "global_batch": GLOBAL}

MODEL = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model():
    return nn.Sequential(nn.Linear(8, {hidden}), nn.ReLU(), nn.Linear({hidden}, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
"""


def _write(folder: Path, name: str, hidden: int, extra: str = "") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(MODEL.format(hidden=hidden)) + extra)
    return path


def _params(hidden: int) -> int:
    return 8 * hidden + hidden + hidden * 3 + 3


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real plan of a tiny model file (hidden 16), saved: (the model file, the plan file)."""
    folder = tmp_path_factory.mktemp("planned")
    model = _write(folder, "digits.py", 16)
    plan = memplan.search(str(model), **SMALL)
    return model, plan.save(folder / "plan.json")


def _edited(planned: tuple[Path, Path], tmp_path: Path, edit: Any) -> Path:
    data = json.loads(planned[1].read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


# -- a plan file that contradicts itself ------------------------------------------------------
def test_a_real_plan_round_trips_and_records_the_models_structure(planned):
    model, path = planned
    plan = Plan.load(path)
    assert Plan.load(plan.save(path)).to_dict() == plan.to_dict()
    assert plan.provenance["model_parameters"] == _params(16)
    assert len(plan.provenance["model_structure_sha256_16"]) == 16
    assert plan.provenance["model_name"] == "digits.py"
    assert check_plan_model(plan, load_task(model), plan_file=path) == []


def test_an_entry_edited_to_another_global_batch_is_refused(planned, tmp_path):
    def micro_24(data: dict[str, Any]) -> None:
        assert data["global_batch"] == GLOBAL and data["entries"][0]["config"]["grad_accum_steps"] == 1
        for part in (data["entries"][0]["config"], data["entries"][0]["predicted"]["config"]):
            part["micro_batch_size"] = 24  # a thorough edit: its figures' configuration too

    path = _edited(planned, tmp_path, micro_24)
    with pytest.raises(ConfigError) as info:
        Plan.load(path)
    message = str(info.value)
    assert "\n" not in message and "edited.json" in message
    assert "entry #1 (micro-batch 24, fp32) makes a global batch of 24" in message
    assert "not the plan's global batch of 16" in message and "re-create it with memplan plan" in message


def test_an_entry_whose_figures_are_for_another_configuration_is_refused(planned, tmp_path):
    def micro_8_accum_2(data: dict[str, Any]) -> None:
        data["entries"][0]["config"].update(micro_batch_size=8, grad_accum_steps=2)  # still 16

    path = _edited(planned, tmp_path, micro_8_accum_2)
    best = Plan.load(planned[1]).config
    if best.micro_batch_size == 8 and best.grad_accum_steps == 2:
        pytest.skip("the plan chose micro-batch 8 x2 itself")
    with pytest.raises(ConfigError, match=r"entry #1's configuration \(micro-batch 8, x2 accumulation, fp32\) is "
                                          r"not the one its predicted figures are for"):
        Plan.load(path)


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda d: d.update(budget_bytes=0), "budget_bytes must be a number of bytes above 0, got 0"),
    (lambda d: d.update(budget_bytes=1000), "needs"),
    (lambda d: d.update(entries=[]), "the plan has no configurations"),
    (lambda d: d.update(margin=1.5), "margin must be in [0, 1), got 1.5"),
    (lambda d: d.update(global_batch="16"), "global_batch must be a whole number or null, got '16'"),
])
def test_other_contradictions_are_refused_in_one_line(planned, tmp_path, edit, expected):
    with pytest.raises(ConfigError) as info:
        Plan.load(_edited(planned, tmp_path, edit))
    message = str(info.value)
    assert expected in message and "\n" not in message and "edited.json" in message
    # The fix names the plan's own model file and the plan file's path.
    assert f"re-create it with memplan plan digits.py --out {tmp_path / 'edited.json'}" in message
    if expected == "needs":
        assert "more than the plan's budget of 1.00 kB" in message


# -- a plan made for another model -------------------------------------------------------------
def test_a_plan_for_another_model_file_is_refused(planned, tmp_path):
    _, path = planned
    other = _write(tmp_path, "other.py", 64)
    with pytest.raises(ConfigError) as info:
        check_plan_model(Plan.load(path), load_task(other), plan_file=path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"plan.json was made for a model of {_params(16):,} parameters (digits.py), not this "
                              f"one of {_params(64):,} (other.py); plan it with memplan plan ")
    assert message.endswith(f"other.py --out {path}")


def test_the_same_model_file_edited_is_one_warning(planned, tmp_path):
    model, path = planned
    edited = tmp_path / "digits.py"
    edited.write_text(model.read_text() + "# a comment\n")
    warnings = check_plan_model(Plan.load(path), load_task(edited), plan_file=path)
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("plan.json was made from another version of digits.py (the file's hash differs")
    assert "plan again if the model changed: memplan plan " in warnings[0]
    # Renamed with the same content: the same model, nothing to say.
    renamed = tmp_path / "renamed.py"
    shutil.copy(model, renamed)
    assert check_plan_model(Plan.load(path), load_task(renamed)) == []


def test_the_same_count_with_another_structure_is_refused(planned):
    model, path = planned
    task = load_task(model)
    frozen = task.build_model()
    frozen[0].weight.requires_grad_(False)
    edited = Task(name="digits.py", build_model=task.build_model, source_hash="0" * 16)
    with pytest.raises(ConfigError, match=rf"plan.json was made for another model of {_params(16):,} parameters "
                                          r"\(digits.py\): its parameters' or buffers' names, shapes, dtypes or "
                                          r"trainability differ from this one's"):
        check_plan_model(Plan.load(path), edited, frozen, plan_file=path)
    assert len(check_plan_model(Plan.load(path), edited, task.build_model())) == 1  # the same: a warning


def _module_task(hidden: int) -> Task:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    return Task.from_module(nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 3)), train_data=data)


def test_an_in_memory_module_of_another_size_is_refused(planned):
    plan = memplan.search(_module_task(16), **SMALL)
    assert plan.provenance["model_file_sha256_16"].startswith("module-")
    assert check_plan_model(plan, _module_task(16)) == []  # another instance, the same fingerprint
    with pytest.raises(ConfigError, match=rf"the plan was made for a model of {_params(16):,} parameters "
                                          rf"\(Sequential\), not this one of {_params(32):,} \(Sequential\)"):
        check_plan_model(plan, _module_task(32))
    # The model file's plan against a module of another size, and of the same structure.
    with pytest.raises(ConfigError, match=r"\(digits.py\), not this one of"):
        check_plan_model(Plan.load(planned[1]), _module_task(32))
    assert len(check_plan_model(Plan.load(planned[1]), _module_task(16))) == 1


def test_an_older_plan_without_a_structure_warns_when_the_file_differs(planned, tmp_path):
    model, path = planned
    data = json.loads(path.read_text())
    for key in ("model_parameters", "model_structure_sha256_16", "model_name"):
        del data["provenance"][key]
    older = Plan.from_dict(data)
    assert check_plan_model(older, load_task(model)) == []
    other = load_task(_write(tmp_path, "other.py", 64))
    warnings = check_plan_model(older, other)
    assert len(warnings) == 1 and "records no model structure (an older plan)" in warnings[0]
    assert "digits.py, not other.py" in warnings[0]


# -- a budget the target cannot have -------------------------------------------------------------
def test_a_vram_above_this_machines_memory_is_said_not_refused(planned, caplog):
    ram = _physical_ram()
    assert ram is not None
    model, _ = planned
    with caplog.at_level(logging.WARNING, logger="memplan"):
        plan = memplan.search(str(model), **{**SMALL, "vram": 2 * ram})
    said = [n for n in plan.notes if n.startswith("--vram ")]
    assert len(said) == 1 and "is more than this machine's" in said[0] and "--gpu" in said[0]
    assert said[0].endswith("of memory; the plan assumes memory it does not have (to plan for a GPU that is not "
                            "here, name it with --gpu)")
    assert [r.getMessage() for r in caplog.records if r.name == "memplan"] == said
    assert f"note: {said[0]}" in plan.table()
    small = memplan.search(str(model), **SMALL)
    assert not any(n.startswith("--vram ") for n in small.notes)


def test_a_vram_above_the_named_cards_memory_is_said(planned):
    task = load_task(planned[0])
    card = Estimator(task, gpu="A100-80GB")
    assert card.spec is not None
    said = vram_beyond_device(card, 200 * 10**9, "A100-80GB")
    assert said == ("--vram 200 GB is more than the 85.9 GB (80.0 GiB) of the --gpu A100-80GB; the plan assumes memory "
                    "the card does not have (name a bigger card with --gpu)")
    assert vram_beyond_device(card, card.spec.memory_bytes, "A100-80GB") is None


def test_a_vram_above_the_local_gpus_memory_is_said(monkeypatch):
    from types import SimpleNamespace

    from estimators import get_gpu
    from memplan.planning import _inputs

    # The local card, without one: its total memory is what torch.cuda says, not the spec's.
    local = SimpleNamespace(device="cuda", spec=get_gpu("A100-80GB"))
    monkeypatch.setattr(_inputs, "_local_matches", lambda estimator: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (10 * 10**9, 79 * 2**30))
    said = vram_beyond_device(local, 80 * 2**30, None)  # type: ignore[arg-type]
    assert said is not None and said.startswith("--vram 85.9 GB is more than the 84.8 GB (79.0 GiB) of this machine's "
                                                "GPU (A100-80GB); the plan assumes memory it does not have")
    assert "name it with --gpu" in said
    assert vram_beyond_device(local, 79 * 2**30, None) is None  # type: ignore[arg-type]


# -- where plans are trained -------------------------------------------------------------------
def test_memplan_train_and_a_resumed_fit_refuse_another_models_plan(planned, tmp_path, capsys):
    from memplan.cli import main

    _model, plan_file = planned
    other = _write(tmp_path, "other.py", 64)
    code = main(["train", str(other), "--plan", str(plan_file), "--out", str(tmp_path / "run"), "--max-steps", "1",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "was made for a model of" in err and "other.py" in err, err
    assert not (tmp_path / "run" / "model.pt").exists()
    # A fit resumed from a folder whose plan.json is another model's: the same refusal, no search.
    run = tmp_path / "resumed"
    run.mkdir()
    shutil.copy(plan_file, run / "plan.json")
    code = main(["fit", str(other), "--out", str(run), "--resume", "--max-steps", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "was made for a model of" in err.splitlines()[-1], err
    assert not (run / "model.pt").exists()
