"""``memplan doctor MODEL.py``: options, output, exit code (0 healthy, 1 with findings)."""

from __future__ import annotations

import argparse
from pathlib import Path

from estimators import ConfigError, parse_count

from ..diagnostics._doctor import CHECKS, doctor

__all__ = ["add_doctor_arguments", "run_doctor", "DOCTOR_FILE"]

DOCTOR_FILE = "doctor.json"
"""Where ``--out DIR`` keeps the findings; the run report of a ``fit`` into DIR shows them."""


def add_doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model file (defines model(), train_data(), …)")
    p.add_argument(
        "--steps",
        default="300",
        help="most steps of the overfit-one-batch check (default 300; it stops once memorised)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--seed", default="0", help="seed of the model's init and the data order")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument(
        "--out", default=None, help=f"also write the findings to OUT/{DOCTOR_FILE} (the run report shows them)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_doctor(args: argparse.Namespace) -> int:
    checks = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ConfigError(f"--checks: unknown {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if args.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {args.device!r}")
    report = doctor(
        args.model,
        device=args.device,
        steps=parse_count(args.steps, what="--steps"),
        seed=parse_count(args.seed, what="--seed", minimum=0),
        checks=checks,
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / DOCTOR_FILE).write_text(report.to_json())
    print(report.to_json() if args.json else report.text(checks))
    return 0 if report.healthy else 1
