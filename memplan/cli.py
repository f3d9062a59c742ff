"""The ``memplan`` command: estimate, probe, plan, fit, train.

Subcommands are small classes registered in one dict; ``main(argv) -> int``. Every
:class:`MemplanError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from estimators import (
    Estimator, MemplanError, TrainConfig, load_task, normalize_precision, parse_count,
)

from ._report import estimate_table

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's own errors follow the same one-line, exit-code-2 rule as ours.
        sys.stderr.write(f"memplan: {message}; see memplan {self.prog.split()[-1]} --help\n")
        raise SystemExit(2)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model file (defines model(), train_data(), …)")
    p.add_argument("--batch-size", "-b", required=True, help="micro-batch size")
    p.add_argument("--accum", default="1", help="gradient-accumulation steps (default 1)")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16-mixed (bf16) | fp16-mixed (fp16, 16)")
    p.add_argument("--checkpoint", default="0", help="activation-checkpointed blocks (0 = none)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="target device type")
    p.add_argument("--gpu", default=None, help="plan for this card (e.g. A100-80GB) without having it")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _config_from(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        micro_batch_size=parse_count(args.batch_size, what="--batch-size"),
        grad_accum_steps=parse_count(args.accum, what="--accum"),
        precision=normalize_precision(args.precision),
        checkpoint_segments=parse_count(args.checkpoint, what="--checkpoint", minimum=0),
    )


class EstimateCommand:
    """Predict the peak memory of one training configuration without running it."""

    name = "estimate"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        _add_config_args(p)

    def run(self, args: argparse.Namespace) -> int:
        config = _config_from(args)
        task = load_task(args.model)
        est = Estimator(task, device=args.device, gpu=args.gpu).estimate(config, exact=True)
        if args.json:
            print(json.dumps(est.to_dict(), indent=2))
        else:
            print(estimate_table(est))
        return 0


_COMMANDS = {cmd.name: cmd for cmd in (EstimateCommand(),)}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memplan", description="Find the fastest training configuration that fits in memory, then train it.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, cmd in _COMMANDS.items():
        p = sub.add_parser(name, help=(cmd.__doc__ or "").strip().splitlines()[0])
        cmd.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command].run(args)
    except MemplanError as exc:
        sys.stderr.write(f"memplan: {exc}\n".replace("\n", " ").rstrip() + "\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("memplan: interrupted\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

