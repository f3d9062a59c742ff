"""Every training option reaches the trainer from the CLI, a config file and the model file's
settings alike; bad values are one-line errors naming the option; the Python API works with a
module and datasets."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from estimators import ConfigError, Task, load_task
from memplan.cli import _commands as _cli_commands
from memplan.cli import _main as cli
from memplan._option_sources import SEARCH_KEYS, option_specs, read_config, resolve_options

MODEL = '''
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

settings = {SETTINGS}

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

def train_data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))

def val_data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
'''

# Values some options need to be valid (anything else takes a generic non-default value).
_SPECIAL: dict[str, Any] = {"monitor": "val_accuracy", "metrics_path": "/tmp/elsewhere.jsonl",
                            "scaler_growth_factor": 3.0, "scaler_init_scale": 1024.0}
# Options that only go with another: given with it (the test gives both the same way).
_WITH: dict[str, dict[str, Any]] = {
    "schedule_args": {"schedule": "plateau"}, "gamma": {"schedule": "step"}, "step_size": {"schedule": "step"},
    "milestones": {"schedule": "multistep"}, "t_0": {"schedule": "cosine_restarts"},
    "t_mult": {"schedule": "cosine_restarts", "t_0": 3}, "min_lr": {"schedule": "cosine"},
    "pct_start": {"schedule": "onecycle"}, "anneal_strategy": {"schedule": "onecycle"},
    "cycle_momentum": {"schedule": "onecycle"}, "cooldown": {"schedule": "plateau"},
    "base_momentum": {"schedule": "onecycle", "cycle_momentum": True},
    "max_momentum": {"schedule": "onecycle", "cycle_momentum": True},
    "early_stopping_min_delta": {"early_stopping_patience": 3},
}


def _value(spec) -> Any:
    """A valid value of ``spec`` other than its default."""
    if spec.name in _SPECIAL:
        return _SPECIAL[spec.name]
    if spec.kind == "choice":
        return next(c for c in spec.choices if c != spec.default)
    if spec.kind == "bool":
        return not spec.default
    if spec.kind == "int":
        return 4 if spec.default == 3 else 3
    if spec.kind == "float":
        return 0.5 if spec.default != 0.5 else 0.25
    if spec.kind == "mapping":
        return {"factor": 0.5} if _WITH.get(spec.name, {}).get("schedule") == "plateau" else {"gamma": 0.5}
    if spec.kind == "ints":
        return (2, 4)
    return "x"


def _text(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {v}" for k, v in value.items()) + " }"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return repr(value)


def _model_file(tmp_path: Path, settings: dict[str, Any] | None = None) -> str:
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(MODEL.replace("{SETTINGS}", repr(settings or {}))))
    return str(path)


def _cli_options(argv: list[str], task: Task):
    parser = cli.build_parser()
    args, extra = parser.parse_known_args(argv)
    assert not extra
    if args.config:
        cli._apply_config(args, cli._SUBPARSERS[args.command], argv)
    return _cli_commands._train_options(args, "cpu", task)


SPECS = option_specs()


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_every_option_reaches_the_trainer_three_ways(spec, tmp_path):
    value = _value(spec)
    given = {**_WITH.get(spec.name, {}), spec.name: value}
    by_name = {s.name: s for s in SPECS}
    task = load_task(_model_file(tmp_path))
    expected = tuple(value) if isinstance(value, tuple) else (Path(value) if spec.kind == "path" else value)

    def flags(name: str, v: Any) -> list[str]:
        s = by_name[name]
        if s.kind == "bool" and not s.optional:
            return [s.flag] if v else [f"--no-{s.flag[2:]}"]
        return [s.flag, _text(v)]
    # 1. the command line
    got = _cli_options(["fit", str(tmp_path / "m.py"), *[a for k, v in given.items() for a in flags(k, v)]], task)
    assert getattr(got, spec.name) == expected
    # 2. a config file
    config = tmp_path / "run.toml"
    config.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in given.items()))
    got = _cli_options(["fit", str(tmp_path / "m.py"), "--config", str(config)], task)
    assert getattr(got, spec.name) == expected
    # 3. the model file's settings
    settings = {k: list(v) if isinstance(v, tuple) else v for k, v in given.items()}
    got = _cli_options(["train", str(tmp_path / "m.py"), "--plan", "unused.json"], load_task(_model_file(tmp_path, settings)))
    assert getattr(got, spec.name) == expected


_BAD = {"int": "many", "float": "fast", "bool": "maybe", "choice": "nonesuch", "mapping": "[1, 2]", "ints": "a,b"}


@pytest.mark.parametrize("spec", [s for s in SPECS if s.kind in _BAD], ids=[s.name for s in SPECS if s.kind in _BAD])
def test_a_bad_value_is_one_line_naming_the_option(spec, tmp_path, capsys):
    path = _model_file(tmp_path)
    if spec.kind == "bool":
        # A flag on the command line takes no value; a config value does.
        config = tmp_path / "bad.toml"
        config.write_text(f'{spec.name} = "maybe"\n')
        code = cli.main(["train", path, "--plan", "p.json", "--config", str(config)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and f"bad.toml: {spec.name}" in err
        return
    code = cli.main(["train", path, "--plan", "p.json", spec.flag, _BAD[spec.kind]])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and spec.flag in err, err
    # The same value in the model file's settings names the settings key.
    # (Those the model file's contract reads itself are refused as the file is loaded.)
    with pytest.raises(ConfigError, match=re.escape(f"settings[{spec.name!r}] in m.py")):
        bad_settings = load_task(_model_file(tmp_path, {spec.name: _BAD[spec.kind]}))
        resolve_options(settings=bad_settings.settings, settings_name="m.py")


def test_out_of_range_values_name_their_origin(tmp_path, capsys):
    path = _model_file(tmp_path)
    code = cli.main(["train", path, "--plan", "p.json", "--ema", "1.5"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("memplan: --ema-decay must be in (0, 1)") and err.count("\n") == 1
    with pytest.raises(ConfigError, match=r"^run.toml: grad_clip must be > 0"):
        resolve_options(config={"grad_clip": -1.0}, config_name="run.toml")


def test_the_command_line_wins_over_the_config_which_wins_over_settings(tmp_path):
    task = load_task(_model_file(tmp_path, {"lr": 0.1, "ema_decay": 0.5, "eval_every": 7}))
    config = tmp_path / "run.toml"
    config.write_text("lr = 0.2\nema_decay = 0.6\n")
    got = _cli_options(["fit", str(tmp_path / "m.py"), "--config", str(config), "--lr", "0.3"], task)
    assert (got.lr, got.ema_decay, got.eval_every) == (0.3, 0.6, 7)


def test_epochs_and_max_steps_come_from_one_place(tmp_path):
    # --max-steps on the command line is not cut short by the model file's epochs.
    task = load_task(_model_file(tmp_path, {"epochs": 1}))
    got = _cli_options(["fit", str(tmp_path / "m.py"), "--max-steps", "40"], task)
    assert (got.epochs, got.max_steps) == (None, 40)
    assert _cli_options(["fit", str(tmp_path / "m.py")], task).epochs == 1


def test_unknown_config_keys_are_an_error_listing_the_known_ones(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("ema = 0.9\nlr = 0.1\n")
    with pytest.raises(ConfigError) as info:
        read_config(config)
    message = str(info.value)
    assert message.startswith("run.toml: unknown key 'ema'; known keys: ") and "ema_decay" in message
    assert "vram" in message and "\n" not in message


def test_config_search_keys_fill_unwritten_flags(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    path = _model_file(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text('vram = "1GB"\nglobal_batch = 8\nprecision = ["fp32"]\ncheckpoint = [0]\nprobe_top = 0\n'
                      'micro_batch = [2, 4]\n')
    code = cli.main(["plan", path, "--config", str(config), "--json", "--micro-batch", "4"])
    out = capsys.readouterr().out
    assert code == 0
    entries = json.loads(out)["entries"]
    assert {(e["config"]["micro_batch_size"], e["config"]["precision"], e["config"]["checkpoint_segments"])
            for e in entries} == {(4, "fp32", 0)}
    assert all(e["config"]["grad_accum_steps"] == 2 for e in entries)


def test_search_axes_are_pinned_or_restricted(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    path = _model_file(tmp_path)
    code = cli.main(["plan", path, "--vram", "1GB", "--global-batch", "8", "--probe-top", "0", "--json",
                     "--precision", "bf16-mixed,fp32", "--micro-batch", "2,8"])
    assert code == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert {e["config"]["micro_batch_size"] for e in entries} == {2, 8}
    assert {e["config"]["precision"] for e in entries} == {"bf16-mixed", "fp32"}
    code = cli.main(["plan", path, "--vram", "1GB", "--global-batch", "8", "--micro-batch", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "--micro-batch 3 does not divide the per-device global batch 8" in err


def test_init_writes_templates_that_fit(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["init"]) == 0
    assert (tmp_path / "model.py").exists() and (tmp_path / "memplan.toml").exists()
    assert cli.main(["init"]) == 2 and "already exist" in capsys.readouterr().err  # nothing overwritten
    text = (tmp_path / "memplan.toml").read_text()
    assert all(f"# {spec.name} = " in text for spec in SPECS)
    read_config(tmp_path / "memplan.toml")  # every key commented out: valid, empty
    (tmp_path / "memplan.toml").write_text(text.replace("# max_steps = ...  # default: none", "max_steps = 3"))
    code = cli.main(["fit", "model.py", "--config", "memplan.toml", "--vram", "1GB", "--probe-top", "0",
                     "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "done: 3 steps" in out


OPTIONS_DOC = Path(__file__).resolve().parents[3] / "docs" / "options.md"  # tables generated by memplan._option_sources


def test_the_options_page_lists_every_option():
    from memplan._option_sources import generated_block, options_table, search_keys_table
    text = OPTIONS_DOC.read_text()
    block = generated_block(text, "options")
    assert block == options_table(), "run python -m memplan._option_sources to rewrite docs/options.md's tables"
    for spec in SPECS:
        assert f"| `{spec.flag}`" in block and f"`{spec.name}`" in block, spec.name
    keys = generated_block(text, "search-keys")
    assert keys == search_keys_table(), "run python -m memplan._option_sources to rewrite docs/options.md's tables"
    cli.build_parser()
    fit_flags = {f for action in cli._SUBPARSERS["fit"]._actions for f in action.option_strings}
    for key in SEARCH_KEYS:
        flag = f"--{key.replace('_', '-')}"
        assert f"| `{flag}` | `{key}` |" in keys and flag in fit_flags, key


def test_a_stale_options_table_is_rewritten(tmp_path):
    from memplan._option_sources import generated_block, options_table, write_tables
    page = tmp_path / "options.md"
    current = OPTIONS_DOC.read_text()
    stale = current.replace(options_table(), options_table().rsplit("\n", 1)[0])  # the last row lost
    assert generated_block(stale, "options") != options_table()
    page.write_text(stale)
    assert write_tables(page) == ["options"]
    assert page.read_text() == current and write_tables(page) == []
    with pytest.raises(ValueError, match="options:start"):
        generated_block("no markers here", "options")


# -- the Python API ------------------------------------------------------------------------------

def _digits():
    import importlib.util
    path = Path(__file__).resolve().parents[3] / "examples" / "digits.py"
    spec = importlib.util.spec_from_file_location("digits_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.slow
def test_fit_a_module_with_datasets_reaches_the_digits_accuracy(tmp_path):
    import memplan
    digits = _digits()
    torch.manual_seed(0)
    plan, result = memplan.fit(digits.model(), train_data=digits.train_data(), val_data=digits.val_data(),
                               vram="1GB", global_batch=64, probe_top=0, precisions=["fp32"],
                               checkpoint_segments=[0], epochs=6, lr=3e-3, warmup_steps=20,
                               out_dir=tmp_path / "run", progress=False)
    assert plan.config.global_batch == 64
    assert result is not None and result.final_metrics["val_accuracy"] >= 0.97


def test_search_a_module_takes_a_loss_and_says_what_it_needs(tmp_path):
    import memplan
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(ConfigError) as info:
        memplan.search(module)
    assert "needs batches: pass sample=" in str(info.value) and "\n" not in str(info.value)
    calls = []

    def mse(model, batch):
        calls.append(1)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    plan = memplan.search(module, sample=(torch.randn(4, 4), torch.randn(4, 1)), loss=mse, vram="1GB",
                          global_batch=4, probe_top=0, trials=8, storage=f"sqlite:///{tmp_path / 's.db'}")
    assert calls and plan.config.global_batch == 4
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    plan = memplan.search(module, train_data=data, loss=mse, vram="1GB", global_batch=8, probe_top=0, trials=8,
                          storage=f"sqlite:///{tmp_path / 's.db'}")
    assert plan.config.global_batch == 8


def test_two_modules_of_one_class_never_share_a_study(tmp_path):
    import optuna

    import memplan
    storage = f"sqlite:///{tmp_path / 's.db'}"
    sample = (torch.randn(4, 8), torch.randint(0, 3, (4,)))
    small = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    wide = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 3))
    a = memplan.search(small, sample=sample, vram="1GB", global_batch=4, probe_top=0, trials=8, storage=storage)
    b = memplan.search(wide, sample=sample, vram="1GB", global_batch=4, probe_top=0, trials=8, storage=storage)
    assert len(optuna.get_all_study_names(storage)) == 2
    assert b.best.predicted.params > a.best.predicted.params
