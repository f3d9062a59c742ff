"""The ``memplan`` command: estimate, probe, plan, fit, train, init, doctor, lr-find.

Subcommands are small classes registered in one dict (those that estimate, plan and train
in ``_commands``, their shared arguments in ``_args``); ``main(argv) -> int``. Every
:class:`MemplanError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from estimators import MemplanError

from .._version import __version__
from ._commands import EstimateCommand, FitCommand, PlanCommand, ProbeCommand, TrainCommand

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's own errors follow the same one-line, exit-code-2 rule as ours, and name
        # the command once: "memplan train: ...; see memplan train --help".
        sys.stderr.write(f"{self.prog}: {message}; see {self.prog} --help\n")
        raise SystemExit(2)


class InitCommand:
    """Write a commented model-file template and a config template to start from, or, with
    ``--from hf:...``, a model file for a Hugging Face model."""

    name = "init"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ._args import add_hf_args

        p.add_argument(
            "directory", nargs="?", default=".", help="where to write model.py and memplan.toml (default: here)"
        )
        p.add_argument("--force", action="store_true", help="overwrite existing files")
        p.add_argument("--from", dest="source", default=None,
                       help="write model.py for a Hugging Face model: hf:<repo id | directory | config.json>")
        p.add_argument("--data", default=None, help="with --from: a .txt or .jsonl training file (default: random tokens)")
        p.add_argument("--text-field", default="text", help="with --from: the text field of --data's JSON lines")
        p.add_argument("--global-batch", default="16", help="with --from: sequences per optimizer step (default 16)")
        add_hf_args(p)

    def run(self, args: argparse.Namespace) -> int:
        from estimators import ConfigError, parse_count

        directory = Path(args.directory)
        if args.source is None:
            given = [flag for flag, value in (("--data", args.data), ("--seq-len", args.seq_len),
                                              ("--task", args.hf_task), ("--lora-rank", args.lora_rank),
                                              ("--lora-targets", args.lora_targets),
                                              ("--num-labels", args.num_labels)) if value is not None]
            if given:
                raise ConfigError(f"{', '.join(given)}: only with --from hf:<repo id | directory | config.json>")
            from ._init import write_templates

            for path in write_templates(directory, force=args.force):
                print(f"wrote {path}")
            print(f"next: memplan fit {directory / 'model.py'} --config {directory / 'memplan.toml'} --vram 1GB")
            return 0
        from ._init_hf import write_hf_model_file

        def count(value: str | None, flag: str) -> int | None:
            return parse_count(value, what=flag) if value is not None else None

        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()) if args.lora_targets else None
        target = directory / "model.py"
        found = write_hf_model_file(
            target, args.source, force=args.force, seq_len=count(args.seq_len, "--seq-len"), head=args.hf_task,
            global_batch=parse_count(args.global_batch, what="--global-batch"), data=args.data,
            text_field=args.text_field, lora_rank=count(args.lora_rank, "--lora-rank"), lora_targets=targets,
            num_labels=count(args.num_labels, "--num-labels"))
        print(f"wrote {target} ({found.model_type}, {found.head}, {found.seq_len} tokens, global batch "
              f"{found.global_batch}{f', LoRA r={found.lora_rank}' if found.lora_rank else ''})")
        for line in found.notes():
            print(line)
        print(f"next: memplan fit {target} --vram 24GB")
        return 0


class DoctorCommand:
    """Check a model for training bugs: overfit one batch, gradients per layer, outputs, init, data, loading."""

    name = "doctor"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ._doctor import add_doctor_arguments

        add_doctor_arguments(p)

    def run(self, args: argparse.Namespace) -> int:
        from ._doctor import run_doctor

        return run_doctor(args)


class LrFindCommand:
    """Learning-rate range test: an exponential sweep, a suggested learning rate and a plot."""

    name = "lr-find"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ..diagnostics._lr_find import add_lr_find_arguments

        add_lr_find_arguments(p)

    def run(self, args: argparse.Namespace) -> int:
        from ..diagnostics._lr_find import run_lr_find

        return run_lr_find(args)


_COMMANDS = {
    cmd.name: cmd
    for cmd in (
        EstimateCommand(),
        ProbeCommand(),
        PlanCommand(),
        FitCommand(),
        TrainCommand(),
        InitCommand(),
        DoctorCommand(),
        LrFindCommand(),
    )
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memplan", description="Find the fastest training configuration that fits in memory, then train it."
    )
    parser.add_argument("--version", action="version", version=f"memplan {__version__} (torch {_torch_version()})")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, cmd in _COMMANDS.items():
        p = sub.add_parser(name, help=(cmd.__doc__ or "").strip().splitlines()[0])
        cmd.add_arguments(p)
        _SUBPARSERS[name] = p
    return parser


_SUBPARSERS: dict[str, argparse.ArgumentParser] = {}


def _torch_version() -> str:
    # The installed torch decides the CPU kernels and the fake-tensor semantics an estimate rests on:
    # a bug report needs both versions. Read from the package metadata, so --version imports nothing big.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def _apply_config(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """The config file's search keys fill the flags not written out; its training options
    are kept for ``_train_options`` in ``_commands`` (below the flags, above the model file's settings)."""
    from .._option_sources import SEARCH_KEYS, explicit_dests, read_config

    config = read_config(args.config)
    given = explicit_dests(parser, argv)
    for key in SEARCH_KEYS:
        if key in config and hasattr(args, key) and key not in given:
            value = config[key]
            setattr(args, key, ",".join(map(str, value)) if isinstance(value, list) else str(value))
    args.config_values = {k: v for k, v in config.items() if k not in SEARCH_KEYS}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # Named by the command they were given to, not by the top-level parser.
        _SUBPARSERS[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if getattr(args, "config", None):
            _apply_config(args, _SUBPARSERS[args.command], list(argv) if argv is not None else sys.argv[1:])
        return _COMMANDS[args.command].run(args)
    except MemplanError as exc:
        sys.stderr.write(f"memplan: {exc}\n".replace("\n", " ").rstrip() + "\n")
        return 2
    except OSError as exc:
        # A full disk met outside the trainer (a plan, a report): one line, as the trainer's.
        from ..training._checkpoint_io import out_of_space

        full = out_of_space(exc, exc.filename)
        if full is None:
            raise
        sys.stderr.write(f"memplan: {full}\n")
        return 2
    except KeyboardInterrupt as exc:
        # A search says what it kept and how to go on (SearchInterrupted); a bare Ctrl-C elsewhere
        # has nothing to add. 130: the shell's code for a command stopped by SIGINT.
        sys.stderr.write(f"memplan: {exc or 'interrupted'}\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
