"""The ``memplan`` command: estimate, probe, plan, fit, train, doctor, lr-find.

Subcommands are small classes registered in one dict; ``main(argv) -> int``. Every
:class:`MemplanError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from estimators import (
    Estimator, MemplanError, TrainConfig, load_task, normalize_precision, parse_count,
)

from ._report import estimate_table

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's own errors follow the same one-line, exit-code-2 rule as ours, and name
        # the command once: "memplan train: ...; see memplan train --help".
        sys.stderr.write(f"{self.prog}: {message}; see {self.prog} --help\n")
        raise SystemExit(2)


def _add_common_args(p: argparse.ArgumentParser) -> None:
    """What every command takes: the model file, the device, and quiet progress."""
    p.add_argument("model", help="model file (defines model(), train_data(), …)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="target device type")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    _add_common_args(p)
    p.add_argument("--batch-size", "-b", required=True, help="micro-batch size")
    p.add_argument("--accum", default="1", help="gradient-accumulation steps (default 1)")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16-mixed (bf16) | fp16-mixed (fp16, 16)")
    p.add_argument("--checkpoint", default="0", help="activation-checkpointed blocks (0 = none)")
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
        p.add_argument("--plot", default=None, help="draw the predicted memory timeline to this image (memplan[plots])")
        p.add_argument("--snapshot", default=None, help="write the timeline as a torch.cuda.memory._snapshot() pickle")
        p.add_argument("--vram", default=None, help="budget line drawn on --plot (default: the --gpu card's memory)")
        _add_shape_policy(p)

    def run(self, args: argparse.Namespace) -> int:
        config = _config_from(args)
        task = load_task(args.model)
        estimator = Estimator(task, device=args.device, gpu=args.gpu, shape_policy=args.shape_policy)
        est = estimator.shape_distribution(config, exact=True)
        if args.plot or args.snapshot:
            from ._timeline_out import write_timeline_outputs
            for line in write_timeline_outputs(estimator, config, plot=args.plot, snapshot=args.snapshot, vram=args.vram):
                print(line, file=sys.stderr if args.json else sys.stdout)
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
        from estimators.probing._probe import probe
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
    _add_common_args(p)
    p.add_argument("--config", default=None, help="a TOML file of options (memplan init writes one); flags override it")
    p.add_argument("--precision", default=None, help="precisions to search, e.g. bf16-mixed,fp32 (default: what the device runs well)")
    p.add_argument("--checkpoint", default=None, help="checkpoint segments to search, e.g. 0 or 0,2 (default: 0, powers of two, every block)")
    p.add_argument("--micro-batch", default=None, help="micro-batch sizes to search, e.g. 8,16 (default: all that fit the global batch)")
    p.add_argument("--strategy", default=None, help="strategies to search with --gpus > 1: ddp, fsdp or ddp,fsdp")
    p.add_argument("--vram", default=None, help="memory budget, e.g. 12GB or 12GiB (default: the device's free memory; on CPU half the available RAM)")
    p.add_argument("--gpu", default=None, help="plan for this card (e.g. A100-80GB) without having it")
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
    from .training import LaunchSpec
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


def _counts(text: str | None, what: str, minimum: int = 1) -> list[int] | None:
    if text is None:
        return None
    return [parse_count(v.strip(), what=what, minimum=minimum) for v in str(text).split(",") if v.strip()]


def _names(text: str | None) -> list[str] | None:
    return [v.strip() for v in str(text).split(",") if v.strip()] if text is not None else None


def _search_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        precisions=_names(args.precision), strategies=_names(args.strategy),
        checkpoint_segments=_counts(args.checkpoint, "--checkpoint", minimum=0),
        micro_batch_sizes=_counts(args.micro_batch, "--micro-batch"),
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
        p.add_argument("--plot", default=None, help="draw every trial's peak against samples/s to this image (memplan[plots])")

    def run(self, args: argparse.Namespace) -> int:
        from ._fit import layout_kwargs
        from ._search import search
        gpus, nodes = _layout(args)
        if args.plot:
            from ._plots import require_matplotlib
            require_matplotlib()  # fail before the search, not after it
        plan = search(args.model, progress=not (args.json or args.no_progress) and sys.stderr.isatty(), **_search_kwargs(args),
                      **layout_kwargs(None, gpus=gpus, nodes=nodes), plot=args.plot)
        if args.out:
            plan.save(args.out)
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.table())
        return 0


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from ._options import add_option_flags
    p.add_argument("--out", default="memplan-run", help="output folder (default memplan-run)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (fit: with OUT/plan.json, no search)")
    add_option_flags(p)


def _lr_auto(args: argparse.Namespace, task) -> bool:
    """``--lr auto`` (or ``lr = "auto"`` in the config or the settings): the learning rate is
    memplan lr-find's suggestion on the chosen plan, found once the plan is known."""
    config = getattr(args, "config_values", None) or {}
    given = getattr(args, "option_lr", None)
    if given is None:
        given = config.get("lr", task.settings.get("lr"))
    return isinstance(given, str) and given.strip().lower() == "auto"


def _with_plan(args: argparse.Namespace, options, task, plan):
    """The options for training ``plan``: its device, and the learning rate lr-find suggests
    for its configuration when ``--lr auto`` was asked for."""
    options = replace(options, device=plan.device)
    if _lr_auto(args, task):
        from ._lr_find import auto_lr
        options = replace(options, lr=float(auto_lr(task, plan.config, plan.device)))
    return options


def _train_options(args: argparse.Namespace, device: str, task):
    from pathlib import Path
    from ._options import option_specs, resolve_options
    config = getattr(args, "config_values", None)
    settings = task.settings
    cli = {spec.name: getattr(args, spec.dest, None) for spec in option_specs()}
    if _lr_auto(args, task):
        # Found on the plan, after the search (see _with_plan); none until then.
        cli["lr"] = None
        config = {k: v for k, v in (config or {}).items() if k != "lr"} if config is not None else None
        settings = {k: v for k, v in settings.items() if k != "lr"}
    return resolve_options(
        cli=cli,
        config=config, config_name=Path(args.config).name if config is not None else "config",
        settings=settings, settings_name=Path(task.source_path).name if task.source_path else task.name,
        out_dir=Path(args.out), resume=args.resume, device=device, progress=not args.no_progress,
        seed=parse_count(args.seed, what="--seed", minimum=0) if getattr(args, "seed", None) is not None else None,
    )


def _check_device(args: argparse.Namespace, plan) -> None:
    from estimators import ConfigError
    if args.device is not None and args.device != plan.device.split(":")[0]:
        raise ConfigError(f"the plan was made for {plan.device}, not --device {args.device}; plan again with "
                          f"memplan plan MODEL.py --device {args.device}")


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
        from ._fit import layout_kwargs, resumed_plan, train_plan
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
        options = _train_options(args, "cpu", task)  # checked before a search that may take minutes
        plan = resumed_plan(args.out) if args.resume else None
        if plan is None:
            plan = search(task, progress=not args.no_progress and sys.stderr.isatty(), **_search_kwargs(args),
                          **layout_kwargs(spec))
        else:
            _check_device(args, plan)
            print(f"resuming the plan in {args.out}/plan.json (no search)")
        print(plan.table())
        result = train_plan(task, plan, _with_plan(args, options, task, plan), launch=spec)
        _print_result(result)
        return 0


class TrainCommand:
    """Train a saved plan without searching."""

    name = "train"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        _add_common_args(p)
        p.add_argument("--config", default=None, help="a TOML file of training options; flags override it")
        p.add_argument("--plan", required=True, help="plan.json written by memplan plan --out")
        p.add_argument("--seed", default=None, help="seed of initialisation, dropout and data order (default 0)")
        p.add_argument("--vram", default=None, help="budget to enforce on each device (default: the plan's)")
        _add_train_args(p)
        _add_launch_args(p)

    def run(self, args: argparse.Namespace) -> int:
        from ._fit import train_plan
        from ._plan import Plan
        task = load_task(args.model)
        options = _train_options(args, "cpu", task)
        plan = Plan.load(args.plan)
        _check_device(args, plan)
        result = train_plan(task, plan, _with_plan(args, options, task, plan), vram=args.vram, launch=_launch_spec(args))
        _print_result(result)
        return 0


class InitCommand:
    """Write a commented model-file template and a config template to start from."""

    name = "init"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("directory", nargs="?", default=".", help="where to write model.py and memplan.toml (default: here)")
        p.add_argument("--force", action="store_true", help="overwrite existing files")

    def run(self, args: argparse.Namespace) -> int:
        from ._init import write_templates
        for path in write_templates(args.directory, force=args.force):
            print(f"wrote {path}")
        print(f"next: memplan fit {Path(args.directory) / 'model.py'} --config {Path(args.directory) / 'memplan.toml'} --vram 1GB")
        return 0



class DoctorCommand:
    """Check a model for training bugs: overfit one batch, gradients per layer, outputs, init, data, loading."""

    name = "doctor"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ._doctor_cli import add_doctor_arguments
        add_doctor_arguments(p)

    def run(self, args: argparse.Namespace) -> int:
        from ._doctor_cli import run_doctor
        return run_doctor(args)


class LrFindCommand:
    """Learning-rate range test: an exponential sweep, a suggested learning rate and a plot."""

    name = "lr-find"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        from ._lr_find import add_lr_find_arguments
        add_lr_find_arguments(p)

    def run(self, args: argparse.Namespace) -> int:
        from ._lr_find import run_lr_find
        return run_lr_find(args)


_COMMANDS = {cmd.name: cmd for cmd in (EstimateCommand(), ProbeCommand(), PlanCommand(), FitCommand(), TrainCommand(),
                                       InitCommand(), DoctorCommand(), LrFindCommand())}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memplan", description="Find the fastest training configuration that fits in memory, then train it.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, cmd in _COMMANDS.items():
        p = sub.add_parser(name, help=(cmd.__doc__ or "").strip().splitlines()[0])
        cmd.add_arguments(p)
        _SUBPARSERS[name] = p
    return parser


_SUBPARSERS: dict[str, argparse.ArgumentParser] = {}


def _apply_config(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """The config file's search keys fill the flags not written out; its training options
    are kept for ``_train_options`` (below the flags, above the model file's settings)."""
    from ._options import SEARCH_KEYS, explicit_dests, read_config
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
    except KeyboardInterrupt:
        sys.stderr.write("memplan: interrupted\n")
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

