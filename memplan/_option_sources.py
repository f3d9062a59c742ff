"""One options model, three ways in: CLI flags, a TOML config file, the model file's ``settings``.

Every field of :class:`~memplan.training.TrainOptions` is an option: its flag is the field's
name in kebab case (``ema_decay`` -> ``--ema-decay``), its config and ``settings`` key the
field's name. The flag's help is the field's attribute docstring, its parsing follows the
field's type. A value given on the command line wins over the config file's, which wins over
the model file's ``settings``, which win over the field's default. Each value is checked on its
own, so that an error names the option where it was given (``--ema-decay``, ``run.toml:
ema_decay``, ``settings['ema_decay'] in model.py``) in one line.

The search's own options (``vram``, ``gpu``, ``global_batch``, …) are config keys too
(:data:`SEARCH_KEYS`); unknown config keys are an error that lists the known ones.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from estimators import ConfigError

from .training import TrainOptions

__all__ = ["OptionSpec", "option_specs", "add_option_flags", "explicit_dests", "read_config", "resolve_options",
           "SEARCH_KEYS", "config_template", "options_table", "search_keys_table",
           "generated_block", "write_tables"]

# Fields that are not options a user sets: the plan fills them in (device, the predicted peak),
# or a command-line flag of its own carries them (--out, --resume, --overwrite, --no-progress, --seed).
_NOT_OPTIONS = {"device", "predicted_peak_bytes", "out_dir", "resume", "overwrite", "progress", "seed"}

SEARCH_KEYS: dict[str, str] = {
    "vram": "the memory budget, e.g. \"12GB\"",
    "gpu": "plan for this card (e.g. \"A100-80GB\") without having it",
    "device": "target device type: \"cpu\" or \"cuda\"",
    "global_batch": "samples per optimizer step, micro x accumulation x ranks (default 32)",
    "trials": "configurations to estimate",
    "probe_top": "best configurations to measure with real steps",
    "compile_top": "best configurations to probe compiled (0: none)",
    "search_effort": "share of the predicted training time the probes, races and compiled probes may take (0.1)",
    "seed": "sampler and training seed",
    "storage": "Optuna storage URL",
    "gpus": "devices per machine to plan for",
    "nodes": "machines to plan for",
    "precision": "precisions searched, e.g. \"bf16-mixed,fp32\"",
    "checkpoint": "checkpoint segments searched, e.g. \"0,2\"",
    "micro_batch": "micro-batch sizes searched, e.g. \"8,16\"",
    "strategy": "strategies searched: single, ddp, fsdp",
    "shape_policy": "items of varying shape: plan for the \"max\" (default) or \"p99\" batch",
    "out": "output folder",
}
"""Config-file keys of the search and of the run itself (not ``TrainOptions`` fields)."""

_TOGETHER = (("epochs", "max_steps"),)
"""Options that say one thing together: where one is given, the others come from there too."""

Kind = Literal["int", "float", "bool", "str", "choice", "path", "mapping", "ints"]


@dataclass(frozen=True)
class OptionSpec:
    """One option: a field of ``TrainOptions`` and how it is read."""

    name: str
    kind: Kind
    optional: bool
    """``None`` is a value (given as ``none`` or ``off`` on the command line)."""
    default: Any
    help: str
    choices: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return f"option_{self.name}"


def _docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string right after a field) of a dataclass, by field name."""
    tree = ast.parse(inspect.getsource(cls).lstrip())
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            out[a.target.id] = " ".join(b.value.value.split())
    return out


def _kind(annotation: Any) -> tuple[Kind, bool, tuple[str, ...]]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = type(None) in typing.get_args(annotation)
    if optional and len(args) == 1:
        annotation = args[0]
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "choice", optional, tuple(str(a) for a in typing.get_args(annotation))
    if annotation is bool:
        return "bool", optional, ()
    if annotation is int:
        return "int", optional, ()
    if annotation is float:
        return "float", optional, ()
    if annotation is str:
        return "str", optional, ()
    if annotation is Path:
        return "path", optional, ()
    import collections.abc as abc
    if origin in (dict, abc.Mapping) or annotation in (dict, Mapping):
        return "mapping", optional, ()
    if origin in (tuple, list, abc.Sequence):
        return "ints", optional, ()
    raise TypeError(f"TrainOptions field of type {annotation!r} has no option reader")


@functools.lru_cache(maxsize=1)
def option_specs() -> tuple[OptionSpec, ...]:
    """The options, in ``TrainOptions``' field order (read once: parsing the trainer's source
    for the docstrings costs a fifth of a second)."""
    hints = typing.get_type_hints(TrainOptions)
    docs = _docstrings(TrainOptions)
    specs = []
    for f in dataclasses.fields(TrainOptions):
        if f.name in _NOT_OPTIONS or f.name.startswith("_"):
            continue
        kind, optional, choices = _kind(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        specs.append(OptionSpec(f.name, kind, optional, default, docs.get(f.name, ""), choices))
    return tuple(specs)


# -- reading values ---------------------------------------------------------------------------

_NONE_WORDS = ("none", "off", "null")


def _from_text(spec: OptionSpec, text: str) -> Any:
    """A command-line string as the option's value (raises ValueError with what it expects)."""
    # For an optional switch, "off" is False, not "the default".
    none_words = ("none", "null") if spec.kind == "bool" else _NONE_WORDS
    if spec.optional and text.strip().lower() in none_words:
        return None
    if spec.kind == "int":
        return int(text)
    if spec.kind == "float":
        return float(text)
    if spec.kind == "bool":
        word = text.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise ValueError("true or false")
    if spec.kind == "mapping":
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("a JSON object such as '{\"gamma\": 0.5}'")
        return value
    if spec.kind == "ints":
        return tuple(int(v) for v in text.split(",") if v.strip())
    return text


def _typed(spec: OptionSpec, value: Any) -> Any:
    """A config-file or ``settings`` value (already typed) as the option's value."""
    if value is None:
        if spec.optional:
            return None
        raise ValueError("a value (null is not allowed here)")
    if isinstance(value, str) and spec.kind not in ("str", "choice", "path"):
        return _from_text(spec, value)
    if spec.kind == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
        raise ValueError("a whole number")
    if spec.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a number")
        return float(value)
    if spec.kind == "bool" and not isinstance(value, bool):
        raise ValueError("true or false")
    if spec.kind in ("str", "choice", "path") and not isinstance(value, str):
        raise ValueError("a string")
    if spec.kind == "mapping" and not isinstance(value, Mapping):
        raise ValueError("a table of named values")
    if spec.kind == "ints":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError("a list of whole numbers")
        return tuple(value)
    return value


_EXPECTS = {
    "int": "a whole number",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "path": "a path",
    "mapping": "a JSON object",
    "ints": "comma-separated whole numbers",
}


def _checked(spec: OptionSpec, value: Any, origin: str) -> Any:
    """``value`` for ``spec`` given at ``origin``: a choice among its choices (the ranges and
    the options that go together are ``TrainOptions``' own checks, see :func:`_build`)."""
    if spec.kind == "choice" and value is not None and value not in spec.choices:
        raise ConfigError(f"{origin} must be one of {', '.join(spec.choices)}, got {value!r}")
    return value


def _build(values: dict[str, Any], origins: Mapping[str, str]) -> TrainOptions:
    """``TrainOptions(**values)``; its error names each option where it was given."""
    import re

    try:
        return TrainOptions(**values)
    except ConfigError as exc:
        text = re.sub(r"TrainOptions\.(\w+)", lambda m: origins.get(m.group(1), m.group(1)), str(exc))
        raise ConfigError(text) from None


def _read(spec: OptionSpec, value: Any, origin: str, *, text: bool) -> Any:
    try:
        parsed = _from_text(spec, value) if text else _typed(spec, value)
    except (ValueError, json.JSONDecodeError) as exc:
        expects = str(exc) if str(exc) and spec.kind in ("bool", "mapping") else _EXPECTS.get(spec.kind, "a value")
        if spec.optional:
            expects += " (or none)"
        raise ConfigError(f"{origin} must be {expects}, got {value!r}") from None
    return _checked(spec, parsed, origin)


# -- the three ways in ------------------------------------------------------------------------


def add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option (default: not given), in a group of their own."""
    group = parser.add_argument_group("training options (also config keys and model-file settings)")
    for spec in option_specs():
        first = _first_sentence(spec.help).replace("%", "%%")
        flags = [spec.flag, *_ALIASES.get(spec.name, ())]
        if spec.kind == "bool" and not spec.optional:
            group.add_argument(*flags, dest=spec.dest, action=argparse.BooleanOptionalAction, default=None, help=first)
        else:
            metavar = "{" + ",".join(spec.choices) + "}" if spec.choices else spec.kind.upper()
            group.add_argument(*flags, dest=spec.dest, default=None, metavar=metavar, help=first)


# Short names of a few long ones, as other trainers spell them.
_ALIASES = {"ema_decay": ("--ema",), "early_stopping_patience": ("--early-stopping",)}


def _first_sentence(text: str) -> str:
    import re

    first = re.split(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z`(])", text)[0].rstrip(".")
    return first.replace("``", "")


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations of the flags written out in ``argv`` (a value given equal to the
    default still wins over the config file)."""
    strings = {s: a.dest for a in parser._actions for s in a.option_strings}  # noqa: SLF001
    out = set()
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in strings:
            out.add(strings[flag])
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    """A TOML config file's keys (options and :data:`SEARCH_KEYS`); unknown keys, a missing
    file or bad TOML are one-line errors."""
    p = Path(path)
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser as a package
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError("reading --config needs Python 3.11+ (tomllib) or `pip install tomli`") from None
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} not found; write one with memplan init") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {str(p)!r} is a folder; give the TOML file (memplan init writes one)") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "save it as UTF-8 TOML") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML ({exc})") from None
    known = [s.name for s in option_specs()] + list(SEARCH_KEYS)
    unknown = [k for k in data if k not in known]
    if unknown:
        raise ConfigError(
            f"{p.name}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"known keys: {', '.join(sorted(known))}"
        )
    return data


def resolve_options(
    *,
    cli: Mapping[str, str | bool | None] | None = None,
    config: Mapping[str, Any] | None = None,
    config_name: str = "config",
    settings: Mapping[str, Any] | None = None,
    settings_name: str = "the model file",
    **fixed: Any,
) -> TrainOptions:
    """``TrainOptions`` from the command line's strings (by field name), the config file's
    values, the model file's ``settings`` and ``fixed`` fields (out_dir, device, …), in that
    order of precedence (``fixed`` first: the command says them explicitly)."""
    values: dict[str, Any] = {}
    levels = [(cli or {}), (config or {}), (settings or {})]
    for group in _TOGETHER:
        # The first level that gives any of a group gives all of it: --max-steps 40 on the
        # command line is not cut short by the model file's settings["epochs"].
        top = next((i for i, level in enumerate(levels) if any(level.get(k) is not None for k in group)), None)
        if top is not None:
            for i, level in enumerate(levels):
                if i != top and any(k in level for k in group):
                    levels[i] = {k: v for k, v in level.items() if k not in group}
    cli, config, settings = levels
    origins: dict[str, str] = {}
    for spec in option_specs():
        if cli and spec.name in cli and cli[spec.name] is not None:
            raw, origins[spec.name] = cli[spec.name], spec.flag
            values[spec.name] = raw if isinstance(raw, bool) else _read(spec, raw, spec.flag, text=True)
        elif config and spec.name in config:
            origins[spec.name] = f"{config_name}: {spec.name}"
            values[spec.name] = _read(spec, config[spec.name], origins[spec.name], text=False)
        elif settings and spec.name in settings:
            origins[spec.name] = f"settings[{spec.name!r}] in {settings_name}"
            values[spec.name] = _read(spec, settings[spec.name], origins[spec.name], text=False)
    values.update({k: v for k, v in fixed.items() if v is not None})
    return _build(values, origins)


def config_template() -> str:
    """A commented config file naming every key with its default and what it does."""
    lines = [
        "# memplan config: `memplan fit model.py --config memplan.toml`.",
        "# Command-line flags override these; these override the model file's `settings`.",
        "# Every key is optional: uncomment what you want to set.",
        "",
        "# -- search --",
    ]
    for key, what in SEARCH_KEYS.items():
        lines.append(f"# {key} = ...  # {what}")
    lines += ["", "# -- training --"]
    for spec in option_specs():
        lines.append(f"# {spec.help}" if spec.help else f"# {spec.name}")
        lines.append(f"# {spec.name} = {_toml_value(spec.default)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if value is None:
        return "...  # default: none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


OPTIONS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"
"""The page whose generated tables :func:`write_tables` keeps current (in a source checkout)."""


def options_table() -> str:
    """The table of training options (``docs/options.md``, between its ``options`` markers)."""
    rows = ["| CLI flag | config / `settings` key | what |", "| --- | --- | --- |"]
    for spec in option_specs():
        flags = " ".join(f"`{f}`" for f in (spec.flag, *_ALIASES.get(spec.name, ())))
        rows.append(f"| {flags} | `{spec.name}` | {_first_sentence(spec.help)} |")
    return "\n".join(rows)


def search_keys_table() -> str:
    """The table of the config file's :data:`SEARCH_KEYS` and their flags (``docs/options.md``,
    between its ``search-keys`` markers)."""
    rows = ["| CLI flag | config key | what |", "| --- | --- | --- |"]
    for key, what in SEARCH_KEYS.items():
        rows.append(f"| `--{key.replace('_', '-')}` | `{key}` | {what} |")
    return "\n".join(rows)


_TABLES = {"options": options_table, "search-keys": search_keys_table}
"""The generated blocks of :data:`OPTIONS_PAGE`, by the name in their markers."""


def generated_block(text: str, name: str) -> str:
    """What stands between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in ``text``."""
    start, end = f"<!-- {name}:start -->\n", f"\n<!-- {name}:end -->"
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one {start.strip()} ... {end.strip()} block")
    return text.split(start)[1].split(end)[0]


def write_tables(page: Path = OPTIONS_PAGE) -> list[str]:
    """Rewrite every generated table of ``page`` from the code; the names of those that changed."""
    text = page.read_text()
    changed = []
    for name, table in _TABLES.items():
        old, new = generated_block(text, name), table()
        if old != new:
            marker = f"<!-- {name}:start -->\n"
            text = text.replace(marker + old + "\n", marker + new + "\n")
            changed.append(name)
    if changed:
        page.write_text(text)
    return changed


if __name__ == "__main__":  # pragma: no cover - `python -m memplan._option_sources` rewrites docs/options.md's tables
    names = write_tables()
    sys.stdout.write(f"{OPTIONS_PAGE}: {', '.join(names) + ' rewritten' if names else 'already current'}\n")
