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
        _add_shape_policy(p)

    def run(self, args: argparse.Namespace) -> int:
        config = _config_from(args)
        task = load_task(args.model)
        est = Estimator(task, device=args.device, gpu=args.gpu,
                        shape_policy=args.shape_policy).shape_distribution(config, exact=True)
        if args.json:
            print(json.dumps(est.to_dict(), indent=2))
        else:
            print(estimate_table(est))
        return 0


class ProbeCommand:
    """Measure one configuration with a few real steps in an isolated process."""

    name = "probe"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        _add_config_args(p)
        p.add_argument("--steps", default="5", help="measured steps after warm-up (default 5)")
        p.add_argument("--vram", default=None, help="memory budget enforced during the probe")

    def run(self, args: argparse.Namespace) -> int:
        from estimators import parse_size, resolve_target
        from estimators._probe import probe
        config = _config_from(args)
        if args.gpu is not None:
            from estimators import ConfigError
            raise ConfigError("a probe measures the device at hand; drop --gpu (use memplan estimate --gpu to plan for another card)")
        device, _spec = resolve_target(args.device, None)
        task = load_task(args.model)
        budget = parse_size(args.vram, what="--vram") if args.vram else None
        result = probe(task, config, device=device, steps=parse_count(args.steps, what="--steps"), budget_bytes=budget)
        if args.json:
            out = result.estimate.to_dict() if result.estimate is not None else {"method": "measured", "config": config.to_dict()}
            out.update(status=result.status, message=result.message, overhead_s=result.overhead_s)
            print(json.dumps(out, indent=2))
        elif result.estimate is not None:
            print(estimate_table(result.estimate))
            print(f"status {result.status}; probe overhead {result.overhead_s:.2f} s")
        else:
            print(f"status {result.status}: {result.message}")
        return 0 if result.status == "ok" else 1


def _add_shape_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape-policy", choices=["max", "p99"], default="max",
                   help="items of varying shape: plan for the worst batch the loader can form (max, default) "
                        "or the 99th percentile of an epoch's batches (p99; rarer ones are left to OOM recovery)")


def _add_search_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model file (defines model(), train_data(), …)")
    p.add_argument("--vram", default=None, help="memory budget, e.g. 12GB or 12GiB (default: the device's free memory; on CPU half the available RAM)")
    p.add_argument("--gpu", default=None, help="plan for this card (e.g. A100-80GB) without having it")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="target device type")
    p.add_argument("--global-batch", default=None, help="fix micro x accumulation (default: settings['global_batch'] of the model file)")
    p.add_argument("--trials", default="60", help="configurations to estimate (default 60)")
    p.add_argument("--probe-top", default="2", help="best configurations to measure with real steps (default 2; 0 = none)")
    p.add_argument("--seed", default="0", help="sampler seed: same inputs, same plan")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: SQLite in ~/.cache/memplan)")
    _add_shape_policy(p)


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", default=None, help="devices per machine to plan for (default 1; more searches DDP and FSDP2)")
    p.add_argument("--nodes", default=None, help="machines to plan for (default 1)")


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed training (torchrun's options)")
    g.add_argument("--nproc", default=None, help="processes (devices) on this machine (default: what the plan needs)")
    g.add_argument("--nnodes", default="1", help="machines (default 1); run the same command on each")
    g.add_argument("--node-rank", default="0", help="this machine's rank (static rendezvous)")
    g.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT where the machines meet (default: this machine)")
    g.add_argument("--rdzv-id", default=None, help="the job's id, the same on every machine")
    g.add_argument("--rdzv-backend", default="c10d", help="c10d (default) or static")


def _launch_spec(args: argparse.Namespace, nproc: int | None = None):
    """The launch asked for on the command line; None: none (the plan decides)."""
    from ._launch import LaunchSpec
    nproc = nproc if nproc is not None else (parse_count(args.nproc, what="--nproc") if args.nproc else None)
    nnodes = parse_count(args.nnodes, what="--nnodes")
    if nproc is None and nnodes == 1:
        return None
    return LaunchSpec(
        nproc_per_node=nproc if nproc is not None else 1, nnodes=nnodes,
        node_rank=parse_count(args.node_rank, what="--node-rank", minimum=0),
        rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, rdzv_backend=args.rdzv_backend,
    )


def _layout(args: argparse.Namespace) -> tuple[int | None, int | None]:
    gpus = parse_count(args.gpus, what="--gpus") if args.gpus else None
    nodes = parse_count(args.nodes, what="--nodes") if args.nodes else None
    return gpus, nodes


def _search_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        vram=args.vram, gpu=args.gpu, device=args.device,
        global_batch=parse_count(args.global_batch, what="--global-batch") if args.global_batch else None,
        trials=parse_count(args.trials, what="--trials"),
        probe_top=parse_count(args.probe_top, what="--probe-top", minimum=0),
        seed=parse_count(args.seed, what="--seed", minimum=0),
        storage=args.storage, shape_policy=args.shape_policy,
    )


class PlanCommand:
    """Search the configurations that fit the budget and print them ranked."""

    name = "plan"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        _add_search_args(p)
        _add_layout_args(p)
        p.add_argument("--out", default=None, help="write the plan as JSON to this file")
        p.add_argument("--json", action="store_true", help="print the plan as JSON")

    def run(self, args: argparse.Namespace) -> int:
        from ._fit import layout_kwargs
        from ._search import search
        gpus, nodes = _layout(args)
        plan = search(args.model, progress=not args.json and sys.stderr.isatty(), **_search_kwargs(args),
                      **layout_kwargs(None, gpus=gpus, nodes=nodes))
        if args.out:
            plan.save(args.out)
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.table())
        return 0


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", default=None, help="passes over the training data")
    p.add_argument("--max-steps", default=None, help="optimizer steps")
    p.add_argument("--lr", default=None, help="peak learning rate")
    p.add_argument("--out", default="memplan-run", help="output folder (default memplan-run)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _train_options(args: argparse.Namespace, device: str):
    from pathlib import Path
    from ._trainer import TrainOptions
    from estimators import ConfigError
    lr = None
    if args.lr is not None:
        try:
            lr = float(args.lr)
        except ValueError:
            raise ConfigError(f"--lr must be a number such as 3e-4, got {args.lr!r}") from None
    return TrainOptions(
        epochs=parse_count(args.epochs, what="--epochs") if args.epochs else None,
        max_steps=parse_count(args.max_steps, what="--max-steps") if args.max_steps else None,
        lr=lr, out_dir=Path(args.out), resume=args.resume, device=device,
        progress=not args.no_progress,
    )


def _print_result(result) -> None:
    if result is None:  # a machine without rank 0
        print("done: this machine's ranks finished; the machine of rank 0 writes the results")
        return
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in result.final_metrics.items())
    state = "interrupted; resume with --resume" if result.interrupted else "done"
    print(f"{state}: {result.steps} steps in {result.wall_s:.1f} s; {metrics}; written to {result.out_dir}")


class FitCommand:
    """Search the configurations, print the plan, then train the best one."""

    name = "fit"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        _add_search_args(p)
        _add_layout_args(p)
        _add_train_args(p)
        _add_launch_args(p)

    def run(self, args: argparse.Namespace) -> int:
        from estimators import ConfigError
        from ._fit import layout_kwargs, train_plan
        from ._search import resolve_task, search
        # fit trains what it plans: --gpus/--nodes default to --nproc/--nnodes and must agree.
        gpus, nodes = _layout(args)
        nproc = parse_count(args.nproc, what="--nproc") if args.nproc else None
        nnodes = parse_count(args.nnodes, what="--nnodes")
        if gpus is not None and nproc is not None and gpus != nproc:
            raise ConfigError(f"fit trains what it plans: --gpus {gpus} and --nproc {nproc} differ; give one of them")
        if nodes is not None and args.nnodes != "1" and nodes != nnodes:
            raise ConfigError(f"fit trains what it plans: --nodes {nodes} and --nnodes {nnodes} differ; give one of them")
        if nodes is not None:
            args.nnodes = str(nodes)
        spec = _launch_spec(args, nproc if nproc is not None else gpus)
        task = resolve_task(args.model)
        plan = search(task, progress=not args.no_progress and sys.stderr.isatty(), **_search_kwargs(args),
                      **layout_kwargs(spec))
        print(plan.table())
        result = train_plan(task, plan, _train_options(args, plan.device), launch=spec)
        _print_result(result)
        return 0


class TrainCommand:
    """Train a saved plan without searching."""

    name = "train"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="model file")
        p.add_argument("--plan", required=True, help="plan.json written by memplan plan --out")
        p.add_argument("--vram", default=None, help="budget to enforce on each device (default: the plan's)")
        _add_train_args(p)
        _add_launch_args(p)

    def run(self, args: argparse.Namespace) -> int:
        from ._fit import train_plan
        from ._plan import Plan
        task = load_task(args.model)
        plan = Plan.load(args.plan)
        result = train_plan(task, plan, _train_options(args, plan.device), vram=args.vram, launch=_launch_spec(args))
        _print_result(result)
        return 0


_COMMANDS = {cmd.name: cmd for cmd in (EstimateCommand(), ProbeCommand(), PlanCommand(), FitCommand(), TrainCommand())}


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

