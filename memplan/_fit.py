"""``memplan.fit``: search, then train the winner, writing everything to one folder."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypedDict

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from estimators import ConfigError, MemoryGuard, Task, parse_size
from estimators._types import Batch, Item

from .planning import Plan, check_plan_model, resolve_task, search
from .training import LaunchSpec, TrainOptions, TrainResult, launch_training, train
from .training._out_dir import check_out_dir, claim_out_dir

__all__ = ["fit", "train_plan", "compile_said", "wants_auto_lr", "options_for_plan", "check_plan_device", "run_folder"]


def compile_said(*levels: Any) -> bool | None:
    """What the user said of compiling: the first of ``levels`` (flag, config file, model-file
    settings: a value or a mapping holding ``compile``) that says it; None when none does."""
    for level in levels:
        value = level.get("compile") if isinstance(level, dict) else level
        if value is not None:
            return bool(value)
    return None


def train_plan(task: Task, plan: Plan, options: TrainOptions, *, vram: int | str | None = None,
               launch: LaunchSpec | None = None, compile: bool | None = None,
               plan_file: str | os.PathLike[str] | None = None) -> TrainResult | None:
    """Train the plan's chosen configuration under the plan's budget (or ``vram``).

    ``compile``: what the user said of torch.compile (None: nothing): when nothing, a plan whose
    probes measured the compiled step faster (``plan.compile``) trains compiled.

    The budget is enforced while training, on every device: on CUDA with the per-process memory
    fraction, on the CPU with the memory guard, which raises a real ``torch.OutOfMemoryError``.
    A DDP/FSDP configuration is launched on ``launch`` (default: the processes the plan needs,
    on this machine); the result is rank 0's (``None`` on the other machines).
    """
    # Another model's plan is refused; a plan of this model file as it was before an edit is said.
    for line in check_plan_model(plan, task, plan_file=plan_file):
        logging.getLogger("memplan").warning("%s", line)
    budget = parse_size(vram, what="--vram") if vram is not None else plan.budget_bytes
    device = options.device if options.device else plan.device
    plan_path = Path(options.out_dir) / "plan.json"
    plan.save(plan_path)
    # The run's length, resolved once for every path (fit, train, memplan.fit): the options',
    # else the model file's settings', else DEFAULT_EPOCHS.
    options = replace(options.with_length(task.settings), predicted_peak_bytes=plan.best.predicted.peak_bytes)
    if compile is None and plan.compile and not options.compile:
        options = replace(options, compile=True)
    config = plan.config
    spec = launch if launch is not None else _plan_launch(plan)
    if config.strategy == "single" and config.tp == 1 and spec.world_size == 1:
        guard = MemoryGuard(budget, device="cuda" if device.startswith("cuda") else "cpu")
        # The ladder: what OOM recovery steps down to (same global batch, less predicted memory).
        return _with_report(train(task, config, options, memory_guard=guard, ladder=plan.ladder()), options)
    if config.ranks != spec.world_size or (config.strategy == "single" and config.tp == 1):
        raise ConfigError(
            f"the plan's configuration ({config.describe()}) runs on {config.ranks} process(es), but "
            f"{spec.world_size} were asked for; train it with --nproc {config.ranks}, or plan for "
            f"{spec.world_size} with memplan plan --gpus {spec.nproc_per_node} --nodes {spec.nnodes}"
        )
    if task.source_path is None:
        raise ConfigError("distributed training rebuilds the task in every process from its model file; "
                          "pass a model-file path instead of a module")
    return _with_report(launch_training(task.source_path, config, options, spec=spec, budget_bytes=budget,
                                        ladder=plan.ladder()), options)


def _with_report(result: TrainResult | None, options: TrainOptions) -> TrainResult | None:
    """Write ``OUT/report.html`` where rank 0 wrote its results (not on the other machines)."""
    if result is not None:
        from .reports._html_report import write_report
        try:
            write_report(options.out_dir)
        except Exception as exc:  # noqa: BLE001 - a report must never fail a finished run
            logging.getLogger("memplan").warning("could not write %s/report.html: %s", options.out_dir, exc)
    return result


def fit(
    model: Task | str | os.PathLike[str] | nn.Module,
    *,
    vram: int | str | None = None,
    sample: Batch | Callable[[int], Batch] | None = None,
    train_data: Dataset[Item] | None = None,
    val_data: Dataset[Item] | None = None,
    loss: Callable[[nn.Module, Batch], torch.Tensor] | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    scheduler: Callable[[torch.optim.Optimizer, int], LRScheduler] | None = None,
    global_batch: int | None = None,
    device: str | None = None,
    gpu: str | None = None,
    trials: int | None = None,
    probe_top: int = 2,
    compile_top: int = 1,
    seed: int = 0,
    storage: str | None = None,
    precisions: Sequence[str] | None = None,
    strategies: Sequence[str] | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    checkpoint_segments: Sequence[int] | None = None,
    host_memory: int | str | None = None,
    shape_policy: str = "max",
    options: TrainOptions | None = None,
    lr: float | str | None = None,
    compile: bool | None = None,
    launch: LaunchSpec | None = None,
    progress: bool | None = None,
    on_plan: Callable[[Plan], None] | None = None,
    search_effort: float = 0.1,
    **option_values: object,
) -> tuple[Plan, TrainResult | None]:
    """Search the configurations of ``model`` under ``vram``, then train the best one.

    Returns the plan and the training result; ``options.out_dir`` receives ``plan.json``,
    ``model.pt``, ``metrics.jsonl``, ``summary.json`` and ``checkpoint.pt``. With ``launch``
    (``LaunchSpec(nproc_per_node=2)``), the search plans for ``nproc_per_node x nnodes``
    devices and the winner is trained on that many processes. ``memplan fit`` is this function.

    ``model`` is a model-file path, a ``Task``, or an ``nn.Module`` with ``train_data`` (a
    ``Dataset``; ``sample`` alone can plan but not train), and optionally ``val_data``,
    ``loss(model, batch)``, ``optimizer(parameters)`` and ``scheduler(optimizer, total_steps)``.
    The search's keywords are :func:`memplan.search`'s (``precisions``, ``strategies``,
    ``micro_batch_sizes`` and ``checkpoint_segments`` pin or restrict its axes). Training
    options are ``options`` (a ``TrainOptions``) or its fields as keywords (``epochs=5,
    ema_decay=0.999``), over the model's ``settings``; ``seed`` seeds the search and the run.
    ``lr``: the peak learning rate, or ``"auto"`` (also in the settings): memplan lr-find's
    suggestion for the chosen plan. ``compile``: True/False trains compiled or not; None (not
    said, here or in the settings): compiled when the plan's probes measured it faster
    (``compile_top`` of the best are probed compiled; 0: none). ``on_plan(plan)`` is called
    once the plan is known, before training; ``progress`` shows the search's and the run's
    progress bars (default: the options', on a terminal). ``search_effort``: the share of the
    predicted training time the probes, races and compiled probes may take (``memplan.search``).

    >>> plan, result = fit("examples/digits.py", vram="1GB")   # doctest: +SKIP
    >>> plan, result = fit(module, train_data=ds, val_data=val, vram="1GB", epochs=5)  # doctest: +SKIP
    """
    task = resolve_task(
        model, sample, train_data=train_data, val_data=val_data, loss=loss, optimizer=optimizer, scheduler=scheduler
    )
    if task.train_data is None:
        raise ConfigError(
            f"fit({task.name}) trains on data: pass train_data= (a Dataset), or a model file that defines train_data()"
        )
    if options is not None and option_values:
        raise ConfigError(f"give TrainOptions or its fields as keywords, not both ({', '.join(option_values)})")
    # The learning rate and torch.compile, said here, else in the settings (options given
    # whole carry their own lr; their compile=False cannot be told from the default).
    auto = wants_auto_lr(lr, option_values, task.settings) if options is None else wants_auto_lr(lr)
    said = compile_said(compile, option_values, dict(task.settings)) if options is None else compile_said(
        compile, True if options.compile else None)
    opts = options if options is not None else _options_from(task, option_values, drop=("lr",) if auto else ())
    if lr is not None and not auto:
        opts = replace(opts, lr=_number(lr, "lr") if isinstance(lr, str) else float(lr))
    opts = replace(opts, seed=seed, compile=bool(said))
    if progress is not None:
        opts = replace(opts, progress=progress)
    with run_folder(opts.out_dir, resume=opts.resume, overwrite=opts.overwrite, searches=True, launch=launch):
        task = task.with_step(opts.step_options())  # the step the trainer will run is the one estimated
        plan = resumed_plan(opts.out_dir) if opts.resume else None
        if plan is not None:
            check_plan_device(plan, device)
        else:
            plan = search(
                task, vram=vram, global_batch=global_batch, device=device, gpu=gpu, trials=trials,
                probe_top=probe_top, compile_top=0 if said is False else compile_top,  # nothing compiled to measure
                seed=seed, storage=storage, precisions=precisions, strategies=strategies,
                micro_batch_sizes=micro_batch_sizes, checkpoint_segments=checkpoint_segments,
                host_memory=host_memory, shape_policy=shape_policy, search_effort=search_effort,
                progress=opts.progress and sys.stderr.isatty(), **layout_kwargs(launch),
            )
        if on_plan is not None:
            on_plan(plan)
        opts = options_for_plan(opts, task, plan, auto_lr=auto)
        return plan, train_plan(task, plan, opts, launch=launch, compile=said,
                                plan_file=Path(opts.out_dir) / "plan.json")


def wants_auto_lr(*levels: Any) -> bool:
    """Whether the learning rate is memplan lr-find's (``"auto"``): the first of ``levels`` (a
    value, or a mapping holding ``lr``) that gives one says it."""
    for level in levels:
        value = level.get("lr") if isinstance(level, Mapping) else level
        if value is not None:
            return isinstance(value, str) and value.strip().lower() == "auto"
    return False


def options_for_plan(options: TrainOptions, task: Task, plan: Plan, *, auto_lr: bool = False) -> TrainOptions:
    """The options for training ``plan``: its device, and (``auto_lr``) the learning rate
    lr-find suggests for its configuration."""
    options = replace(options, device=plan.device)
    if auto_lr:
        from .diagnostics._lr_find import auto_lr as find

        options = replace(options, lr=float(find(task, plan.config, plan.device)))
    return options


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{what} must be a number or 'auto', got {text!r}") from None


def _options_from(task: Task, values: dict[str, Any], drop: Sequence[str] = ()) -> TrainOptions:
    """``TrainOptions`` from keywords over the task's settings, each checked by name (those in
    ``drop``, which ``fit`` resolves itself, left out of the settings)."""
    from ._option_sources import option_specs, resolve_options

    known = {spec.name for spec in option_specs()} | set(_FIXED)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"fit() got unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    fixed = {k: values.pop(k) for k in _FIXED if k in values}
    settings = {k: v for k, v in task.settings.items() if k not in drop}
    options = resolve_options(config=values, config_name="fit()", settings=settings, settings_name=task.name, **fixed)
    return options


_FIXED = ("out_dir", "resume", "overwrite", "progress")
"""``fit()`` keywords that are ``TrainOptions`` fields but not options of a config file."""


def check_plan_device(plan: Plan, device: str | None) -> None:
    """A plan made for one device type is trained on that type (``device`` None: the plan's)."""
    if device is not None and device != plan.device.split(":")[0]:
        raise ConfigError(
            f"the plan was made for {plan.device}, not --device {device}; plan again with "
            f"memplan plan MODEL.py --device {device}"
        )


@contextlib.contextmanager
def run_folder(out_dir: str | os.PathLike[str], *, resume: bool, overwrite: bool, searches: bool,
               launch: LaunchSpec | None = None) -> Iterator[None]:
    """Hold the run's folder for a command (its search too) and check it first: a fresh run
    refuses another run's results unless ``overwrite`` (which deletes them), and ``resume``
    needs something to resume (``searches``: the command writes its own ``plan.json``, which
    then is a result too, and resumable). The machines of a multi-machine ``launch`` without
    rank 0 leave the (possibly shared) folder to that one's. The messages name the switches as
    the command line and Python spell them: both reach this."""
    if launch is not None and launch.node_rank != 0:
        yield
        return
    flags = ("--resume (resume=True)", "--overwrite (overwrite=True)")
    with claim_out_dir(out_dir, "the output folder"):
        removed = check_out_dir(out_dir, resume=resume, overwrite=overwrite, plan=searches, flags=flags)
        if removed:
            logging.getLogger("memplan").warning("%s: deleted the earlier run's %s", out_dir, ", ".join(removed))
        yield


def resumed_plan(out_dir: str | os.PathLike[str]) -> Plan | None:
    """The plan a resumed ``fit`` trains: the one its first run saved in ``out_dir`` (with the
    checkpoint's configuration, which the trainer restores), so that no search runs again and
    no other configuration is chosen; None when there is none (the run never got that far)."""
    path = Path(out_dir) / "plan.json"
    return Plan.load(path) if path.exists() else None


class LayoutKwargs(TypedDict, total=False):
    """``search``'s ``gpus`` and ``nodes``, when more than one device."""

    gpus: int
    nodes: int


def layout_kwargs(launch: LaunchSpec | None, *, gpus: int | None = None, nodes: int | None = None) -> LayoutKwargs:
    """``search``'s ``gpus``/``nodes`` for a launch (devices per node, machines)."""
    gpus = gpus if gpus is not None else (launch.nproc_per_node if launch is not None else 1)
    nodes = nodes if nodes is not None else (launch.nnodes if launch is not None else 1)
    if gpus * nodes == 1:
        return {}
    if "gpus" not in inspect.signature(search).parameters:
        raise ConfigError(
            "this memplan's search plans one device only; train a DDP/FSDP plan file with "
            "memplan train MODEL.py --plan plan.json --nproc N"
        )
    return {"gpus": gpus, "nodes": nodes}


def _plan_launch(plan: Plan) -> LaunchSpec:
    """The processes the plan's configuration needs, on this machine (several machines need
    their rendezvous options: ``--nnodes``, ``--rdzv-endpoint``, ``--rdzv-id``)."""
    needs = getattr(plan, "launch", None) or {"nproc_per_node": plan.config.ranks, "nnodes": 1}
    if int(needs.get("nnodes", 1)) > 1:
        raise ConfigError(
            f"the plan runs on {needs['nnodes']} machines; start memplan train on each with --nproc "
            f"{needs['nproc_per_node']} --nnodes {needs['nnodes']} --node-rank R --rdzv-endpoint HOST:PORT --rdzv-id ID"
        )
    return LaunchSpec(nproc_per_node=int(needs.get("nproc_per_node", plan.config.ranks)))
