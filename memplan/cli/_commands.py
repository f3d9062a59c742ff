"""The commands that estimate, probe, plan and train: ``memplan estimate|probe|plan|fit|train``.

Each is a small class (``name``, ``add_arguments``, ``run``) that ``cli`` registers.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from estimators import ConfigError, Estimator, Task, is_hf_source, load_task, parse_count

from .._paths import writable_dir, writable_file
from ..reports._report import estimate_table
from ._args import (
    add_common_args,
    add_config_args,
    add_hf_args,
    add_launch_args,
    add_layout_args,
    add_search_args,
    add_shape_policy,
    add_train_args,
    config_from,
    launch_spec,
    layout_from,
    search_kwargs,
    task_from,
)

if TYPE_CHECKING:
    from ..planning import Plan
    from ..training import TrainOptions, TrainResult

__all__ = ["EstimateCommand", "ProbeCommand", "PlanCommand", "FitCommand", "TrainCommand"]


class EstimateCommand:
    """Predict the peak memory of one training configuration without running it."""

    name = "estimate"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_config_args(p)
        p.add_argument("--plot", default=None, help="draw the predicted memory timeline to this image (memplan[plots])")
        p.add_argument("--snapshot", default=None, help="write the timeline as a torch.cuda.memory._snapshot() pickle")
        p.add_argument("--vram", default=None, help="budget line drawn on --plot (default: the --gpu card's memory)")
        add_shape_policy(p)
        add_hf_args(p)

    def run(self, args: argparse.Namespace) -> int:
        config = config_from(args)
        for flag, path in (("--plot", args.plot), ("--snapshot", args.snapshot)):
            if path:
                writable_file(path, flag)
        task = task_from(args)
        estimator = Estimator(task, device=args.device, gpu=args.gpu, shape_policy=args.shape_policy)
        est = estimator.shape_distribution(config, exact=True)
        if args.plot or args.snapshot:
            from ..reports._timeline_out import write_timeline_outputs
            for line in write_timeline_outputs(
                estimator, config, plot=args.plot, snapshot=args.snapshot, vram=args.vram
            ):
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
        add_config_args(p)
        p.add_argument("--steps", default="5", help="measured steps after warm-up (default 5)")
        p.add_argument("--vram", default=None, help="memory budget enforced during the probe")
        add_hf_args(p)

    def run(self, args: argparse.Namespace) -> int:
        from estimators import parse_size, probe, resolve_target

        config = config_from(args)
        if args.gpu is not None:
            raise ConfigError(
                "a probe measures the device at hand; drop --gpu (use memplan estimate --gpu to plan for another card)"
            )
        device, _spec = resolve_target(args.device, None)
        task = task_from(args)
        budget = parse_size(args.vram, what="--vram") if args.vram else None
        result = probe(task, config, device=device, steps=parse_count(args.steps, what="--steps"), budget_bytes=budget)
        if args.json:
            out: dict[str, Any] = (
                result.estimate.to_dict()
                if result.estimate is not None
                else {"method": "measured", "config": config.to_dict()}
            )
            out.update(status=result.status, message=result.message, overhead_s=result.overhead_s)
            print(json.dumps(out, indent=2))
        elif result.estimate is not None:
            print(estimate_table(result.estimate))
            print(f"status {result.status}; probe overhead {result.overhead_s:.2f} s")
        else:
            print(f"status {result.status}: {result.message}")
        return 0 if result.status == "ok" else 1


class PlanCommand:
    """Search the configurations that fit the budget and print them ranked."""

    name = "plan"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_search_args(p)
        add_layout_args(p)
        p.add_argument("--out", default=None, help="write the plan as JSON to this file")
        p.add_argument("--json", action="store_true", help="print the plan as JSON")
        p.add_argument(
            "--plot", default=None, help="draw every trial's peak against samples/s to this image (memplan[plots])"
        )
        from ..integrations import TOOLS

        p.add_argument("--emit", default=None, choices=TOOLS,
                       help="print the plan as that trainer's settings (the table goes to stderr)")
        p.add_argument("--emit-out", default=None, help="write the --emit settings to this file instead of printing them")
        add_hf_args(p)

    def run(self, args: argparse.Namespace) -> int:
        from .._fit import layout_kwargs
        from ..planning import search

        gpus, nodes = layout_from(args)
        if args.emit_out and not args.emit:
            raise ConfigError("--emit-out names where --emit's settings go; add --emit hf|trl|lightning|accelerate|torchtune")
        if args.emit and args.json:
            raise ConfigError("--emit and --json both print the plan; give one (or --emit with --emit-out FILE)")
        # Where the results go, checked before a search that may take minutes.
        for flag, path in (("--out", args.out), ("--emit-out", args.emit_out)):
            if path:
                writable_file(path, flag)
        if args.plot:
            writable_file(args.plot, "--plot")
            from .._figures import require_matplotlib

            require_matplotlib()  # fail before the search, not after it
        task = task_from(args)
        plan = search(
            task,
            progress=not (args.json or args.no_progress) and sys.stderr.isatty(),
            **search_kwargs(args),
            **layout_kwargs(None, gpus=gpus, nodes=nodes),
            plot=args.plot,
        )
        if args.out:
            plan.save(args.out)
        if args.emit:
            _emit(plan, args.emit, args.emit_out)
            return 0
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.table())
        return 0


def _emit(plan: Plan, tool: str, out: str | None) -> None:
    """The plan as ``tool``'s settings, printed (the table then on stderr) or written to ``out``;
    what the tool cannot express is said on stderr, never dropped."""
    from pathlib import Path

    from ..integrations import caveats, emit

    text = emit(plan, tool)
    print(plan.table(), file=sys.stderr if out is None else sys.stdout)
    for line in caveats(plan, tool):
        print(f"memplan: {tool}: {line}", file=sys.stderr)
    if out is None:
        print(text)
    else:
        Path(out).write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
        print(f"{tool} settings written to {out}")


def _no_hf(args: argparse.Namespace, command: str) -> None:
    """fit and train need the model file's data: an hf: source has none."""
    if is_hf_source(args.model):
        raise ConfigError(f"memplan {command} trains on a model file's train_data(); write one with "
                          f"`memplan init --from {args.model}`, then `memplan {command} model.py ...`")


def _lr_auto(args: argparse.Namespace, task: Task) -> bool:
    """``--lr auto`` (or ``lr = "auto"`` in the config or the settings)."""
    from .._fit import wants_auto_lr

    return wants_auto_lr(getattr(args, "option_lr", None), getattr(args, "config_values", None) or {}, task.settings)


def _train_options(args: argparse.Namespace, device: str, task: Task) -> TrainOptions:
    from pathlib import Path

    from .._option_sources import option_specs, resolve_options

    config = getattr(args, "config_values", None)
    settings = task.settings
    # Strings, and True/False from the --flag/--no-flag options (None: not given).
    cli: dict[str, str | bool | None] = {spec.name: getattr(args, spec.dest, None) for spec in option_specs()}
    if _lr_auto(args, task):
        # Found on the plan, after the search (fit's options_for_plan); none until then.
        cli["lr"] = None
        config = {k: v for k, v in (config or {}).items() if k != "lr"} if config is not None else None
        settings = {k: v for k, v in settings.items() if k != "lr"}
    return resolve_options(
        cli=cli,
        config=config,
        config_name=Path(args.config).name if config is not None else "config",
        settings=settings,
        settings_name=Path(task.source_path).name if task.source_path else task.name,
        out_dir=writable_dir(args.out, "--out"),
        resume=args.resume,
        overwrite=args.overwrite,
        device=device,
        progress=not args.no_progress,
        seed=parse_count(args.seed, what="--seed", minimum=0) if getattr(args, "seed", None) is not None else None,
    )


def _compile_said(args: argparse.Namespace, task: Task) -> bool | None:
    """What the command line, the config file or the model file said of --compile (None: nothing)."""
    from .._fit import compile_said

    return compile_said(
        getattr(args, "option_compile", None), getattr(args, "config_values", None) or {}, dict(task.settings)
    )


def _print_result(result: TrainResult | None) -> None:
    if result is None:  # a machine without rank 0
        print("done: this machine's ranks finished; the machine of rank 0 writes the results")
        return
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in result.final_metrics.items())
    state = "interrupted; resume with --resume" if result.interrupted else "done"
    print(f"{state}: {result.steps} steps in {result.wall_s:.1f} s; {metrics}; written to {result.out_dir}")


_SEARCH_ONLY = ("vram", "gpu", "host_memory", "global_batch", "precision", "checkpoint", "micro_batch", "strategy",
                "storage")
"""fit's flags that only the search reads (default: not given)."""


def _unused_on_resume(args: argparse.Namespace) -> None:
    """Say which search flags a resumed fit, which trains the saved plan, does not use."""
    import logging

    given = [f"--{name.replace('_', '-')}" for name in _SEARCH_ONLY if getattr(args, name, None) is not None]
    if given:
        logging.getLogger("memplan").warning(
            "%s not used: --resume trains the plan saved in %s/plan.json, without a search; to plan anew, "
            "start a fresh run there with --overwrite", ", ".join(given), args.out)


class FitCommand:
    """Search the configurations, print the plan, then train the best one."""

    name = "fit"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_search_args(p)
        add_layout_args(p)
        add_train_args(p)
        add_launch_args(p)

    def run(self, args: argparse.Namespace) -> int:
        from .._fit import fit, resumed_plan
        from ..planning import resolve_task

        _no_hf(args, "fit")
        # fit trains what it plans: --gpus/--nodes default to --nproc/--nnodes and must agree.
        gpus, nodes = layout_from(args)
        nproc = parse_count(args.nproc, what="--nproc") if args.nproc else None
        nnodes = parse_count(args.nnodes, what="--nnodes")
        if gpus is not None and nproc is not None and gpus != nproc:
            raise ConfigError(f"fit trains what it plans: --gpus {gpus} and --nproc {nproc} differ; give one of them")
        if nodes is not None and args.nnodes != "1" and nodes != nnodes:
            raise ConfigError(
                f"fit trains what it plans: --nodes {nodes} and --nnodes {nnodes} differ; give one of them"
            )
        if nodes is not None:
            args.nnodes = str(nodes)
        spec = launch_spec(args, nproc if nproc is not None else gpus)
        task = resolve_task(args.model)
        options = _train_options(args, "cpu", task)  # checked before a search that may take minutes
        resuming = args.resume and resumed_plan(args.out) is not None

        def show(plan: Plan) -> None:
            # Called once fit holds the folder and has the plan (read back, or searched).
            if resuming:
                _unused_on_resume(args)
                print(f"resuming the plan in {args.out}/plan.json (no search)")
            print(plan.table())

        _plan, result = fit(
            task, **search_kwargs(args), options=options,
            lr="auto" if _lr_auto(args, task) else None, compile=_compile_said(args, task), launch=spec,
            progress=not args.no_progress, on_plan=show,
        )
        _print_result(result)
        return 0


class TrainCommand:
    """Train a saved plan without searching."""

    name = "train"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_common_args(p)
        p.add_argument("--config", default=None, help="a TOML file of training options; flags override it")
        p.add_argument("--plan", required=True, help="plan.json written by memplan plan --out")
        p.add_argument("--seed", default=None, help="seed of initialisation, dropout and data order (default 0)")
        p.add_argument("--vram", default=None, help="budget to enforce on each device (default: the plan's)")
        add_train_args(p)
        add_launch_args(p)

    def run(self, args: argparse.Namespace) -> int:
        from .._fit import check_plan_device, options_for_plan, run_folder, train_plan
        from ..planning import Plan

        _no_hf(args, "train")
        task = load_task(args.model)
        options = _train_options(args, "cpu", task)
        plan = Plan.load(args.plan)
        check_plan_device(plan, args.device)
        spec = launch_spec(args)
        with run_folder(args.out, resume=args.resume, overwrite=args.overwrite, searches=False, launch=spec):
            result = train_plan(
                task,
                plan,
                options_for_plan(options, task, plan, auto_lr=_lr_auto(args, task)),
                vram=args.vram,
                launch=spec,
                compile=_compile_said(args, task),
                plan_file=args.plan,
            )
        _print_result(result)
        return 0
