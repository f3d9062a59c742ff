"""The CLI: one-line errors with exit code 2, table and JSON output."""

from __future__ import annotations

import json

import pytest

from memplan.cli import main

GOOD = """
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
"""


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_json(write_model, capsys):
    path = write_model(GOOD)
    code, out, err = run_cli(capsys, "estimate", path, "--batch-size", "4", "--json")
    assert code == 0, err
    data = json.loads(out)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "breakdown", "context_bytes", "method", "config"):
        assert key in data
    assert data["peak_reserved_bytes"] is None  # cpu target
    assert data["config"]["micro_batch_size"] == 4
    assert data["breakdown"]["params"] == (8 * 16 + 16 + 16 * 3 + 3) * 4


def test_estimate_table_for_a_gpu_names_reserved_and_context(write_model, capsys):
    path = write_model(GOOD)
    code, out, _ = run_cli(capsys, "estimate", path, "-b", "4", "--gpu", "A100-80GB", "--precision", "bf16")
    assert code == 0
    assert "peak reserved" in out and "CUDA context" in out and "cuBLAS" in out and "modelled" in out


BROKEN = {
    "syntax": ("def model(:\n", "syntax error at line 1"),
    "no_model": ("x = 1\n", "defines no model()"),
    "not_module": ("def model():\n    return 3\ndef train_data():\n    return [1]\n", "not a torch.nn.Module"),
    "import_error": ("import does_not_exist_pkg\n", "importing it raised ModuleNotFoundError"),
    "bad_batch": (GOOD.replace("nn.Linear(8, 16)", "nn.Linear(9, 16)"), "failed"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_model_files_get_one_line_and_exit_2(case, write_model, capsys):
    source, expected = BROKEN[case]
    path = write_model(source)
    code, out, err = run_cli(capsys, "estimate", path, "-b", "4")
    assert code == 2
    assert err.count("\n") == 1 and expected in err and "model_file.py" in err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--batch-size", "0"], "--batch-size must be a whole number"),
        (["-b", "4", "--precision", "fp8"], "unknown precision"),
        (["-b", "4", "--gpu", "B300-NOPE"], "unknown GPU"),
        (["-b", "4", "--precision", "bf16", "--gpu", "V100-32GB"], "no bf16"),
    ],
)
def test_bad_options_get_one_line_and_exit_2(argv, expected, write_model, capsys):
    path = write_model(GOOD)
    code, _, err = run_cli(capsys, "estimate", path, *argv)
    assert code == 2
    assert err.count("\n") == 1 and expected.lower() in err.lower()


def test_missing_file(capsys):
    code, _, err = run_cli(capsys, "estimate", "/nonexistent/model.py", "-b", "2")
    assert code == 2 and "not found" in err


def test_probe_json_is_measured(write_model, capsys, monkeypatch, tmp_path):
    path = write_model(GOOD)
    code, out, err = run_cli(capsys, "probe", path, "-b", "4", "--steps", "2", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "measured" and data["status"] == "ok"
    assert data["peak_allocated_bytes"] > (8 * 16 + 16 + 16 * 3 + 3) * 4 and data["step_time_s"] > 0


def test_plan_json_and_impossible_budget(write_model, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    path = write_model(GOOD)
    out_file = tmp_path / "plan.json"
    code, out, err = run_cli(capsys, "plan", path, "--vram", "1GB", "--global-batch", "8", "--probe-top", "0",
                             "--json", "--out", str(out_file))
    assert code == 0, err
    data = json.loads(out)
    config = data["entries"][0]["config"]
    assert set(config) >= {"micro_batch_size", "grad_accum_steps", "precision", "checkpoint_segments", "strategy", "world_size"}
    assert config["micro_batch_size"] * config["grad_accum_steps"] == 8
    assert json.loads(out_file.read_text()) == data
    code, _, err = run_cli(capsys, "plan", path, "--vram", "1kB", "--global-batch", "8", "--probe-top", "0")
    assert code == 2 and err.startswith("memplan: nothing fits in 1.00 kB") and err.count("\n") == 1
    code, _, err = run_cli(capsys, "plan", path, "--vram", "12G")
    assert code == 2 and "cannot read '12G'" in err


DDP_PLAN_CONFIG = {"micro_batch_size": 2, "grad_accum_steps": 1, "precision": "fp32", "checkpoint_segments": 0,
                   "strategy": "ddp", "world_size": 2}


def _ddp_plan(tmp_path) -> str:
    from estimators import Estimate, TrainConfig
    from memplan.planning import Plan, PlanEntry

    c = TrainConfig(**DDP_PLAN_CONFIG)
    est = Estimate(config=c, device="cpu", gpu=None, peak_allocated_bytes=10**6, peak_reserved_bytes=None,
                   breakdown={}, peak_phase="backward", context_bytes=0, workspace_bytes=0, method="static",
                   modelled=False, params=0, trainable_params=0, samples_per_s=1.0)
    path = tmp_path / "plan.json"
    Plan(entries=(PlanEntry(config=c, predicted=est),), budget_bytes=10**9, margin=0.1, device="cpu", gpu=None,
         global_batch=4, trials=1).save(path)
    return str(path)


def test_train_a_distributed_plan_on_the_wrong_number_of_processes_is_one_line(write_model, tmp_path, capsys):
    path = write_model(GOOD)
    code, _, err = run_cli(capsys, "train", path, "--plan", _ddp_plan(tmp_path), "--nproc", "3",
                           "--out", str(tmp_path / "run"))
    assert code == 2
    assert err.count("\n") == 1 and "runs on 2 process(es), but 3 were asked for" in err and "--nproc 2" in err


def test_fit_trains_what_it_plans(write_model, capsys):
    path = write_model(GOOD)
    code, _, err = run_cli(capsys, "fit", path, "--gpus", "2", "--nproc", "4")
    assert code == 2 and "--gpus 2 and --nproc 4 differ" in err


def test_several_machines_need_a_rendezvous(write_model, tmp_path, capsys):
    path = write_model(GOOD)
    code, _, err = run_cli(capsys, "train", path, "--plan", _ddp_plan(tmp_path), "--nproc", "1", "--nnodes", "2")
    assert code == 2 and "--rdzv-endpoint" in err and "--rdzv-id" in err


def test_usage_errors_name_the_command_once(write_model, capsys):
    path = write_model(GOOD)
    with pytest.raises(SystemExit) as info:
        main(["train", path, "--plan", "p.json", "--bogus", "1"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("memplan train: unrecognized arguments: --bogus 1") and err.count("memplan train") == 2
    assert "memplan memplan" not in err
    with pytest.raises(SystemExit) as info:
        main(["nosuchcommand"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("memplan: ") and "see memplan --help" in err and "memplan memplan" not in err


@pytest.mark.parametrize("command", ["estimate", "probe", "plan", "fit", "train"])
def test_every_command_takes_the_common_options(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--device" in out and "--no-progress" in out


def test_train_takes_the_device_and_refuses_another_than_the_plans(write_model, tmp_path, capsys):
    path = write_model(GOOD)
    code, _, err = run_cli(capsys, "train", path, "--plan", _ddp_plan(tmp_path), "--device", "cuda")
    assert code == 2 and err.count("\n") == 1 and "the plan was made for cpu, not --device cuda" in err


def test_a_plan_file_with_a_missing_key_is_one_line(write_model, tmp_path, capsys):
    path = write_model(GOOD)
    plan = json.loads(open(_ddp_plan(tmp_path)).read())
    del plan["budget_bytes"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(plan))
    code, _, err = run_cli(capsys, "train", path, "--plan", str(broken))
    assert code == 2 and err.count("\n") == 1 and "broken.json" in err and "lacks 'budget_bytes'" in err


def test_a_global_batch_larger_than_the_data_is_one_line(write_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    path = write_model(GOOD)  # 32 training items
    code, _, err = run_cli(capsys, "plan", path, "--vram", "1GB", "--global-batch", "100000")
    assert code == 2 and err.count("\n") == 1
    assert "global batch 100000 is larger than the training set (32 items)" in err and "--global-batch 32" in err


def test_fit_resume_trains_the_saved_plan_without_searching(write_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    path = write_model(GOOD)
    out = tmp_path / "run"
    common = ["--vram", "1GB", "--global-batch", "8", "--probe-top", "0", "--out", str(out), "--no-progress"]
    code, first, err = run_cli(capsys, "fit", path, "--max-steps", "2", *common)
    assert code == 0, err
    saved = json.loads((out / "plan.json").read_text())["entries"][0]["config"]

    import memplan.planning as search_module

    def no_search(*args, **kwargs):
        raise AssertionError("a resumed fit must not search")
    monkeypatch.setattr(search_module, "search", no_search)
    code, again, err = run_cli(capsys, "fit", path, "--max-steps", "4", "--resume", *common)
    assert code == 0, err
    assert "no search" in again and "4 steps" in again
    assert json.loads((out / "plan.json").read_text())["entries"][0]["config"] == saved
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2


def test_a_damaged_checkpoint_on_resume_is_one_line(write_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    path = write_model(GOOD)
    out = tmp_path / "run"
    common = ["--vram", "1GB", "--global-batch", "8", "--probe-top", "0", "--out", str(out), "--no-progress"]
    assert run_cli(capsys, "fit", path, "--max-steps", "1", *common)[0] == 0
    for name in ("checkpoint.pt", "checkpoint.previous.pt"):
        f = out / name
        if f.exists():
            f.write_bytes(f.read_bytes()[:100])
    code, _, err = run_cli(capsys, "fit", path, "--max-steps", "2", "--resume", *common)
    assert code == 2 and err.count("\n") == 1 and "checkpoint.pt is damaged" in err
