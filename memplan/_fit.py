"""``memplan.fit``: search, then train the winner, writing everything to one folder."""

from __future__ import annotations

import inspect
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.nn as nn

from estimators import ConfigError, Task, parse_size
from estimators._guard import MemoryGuard

from ._launch import LaunchSpec, launch_training
from ._plan import Plan
from ._search import resolve_task, search
from ._trainer import TrainOptions, TrainResult, train

__all__ = ["fit", "train_plan"]


def train_plan(task: Task, plan: Plan, options: TrainOptions, *, vram: int | str | None = None,
               launch: LaunchSpec | None = None) -> TrainResult | None:
    """Train the plan's chosen configuration under the plan's budget (or ``vram``).

    The budget is enforced while training, on every device: on CUDA with the per-process memory
    fraction, on the CPU with the memory guard, which raises a real ``torch.OutOfMemoryError``.
    A DDP/FSDP configuration is launched on ``launch`` (default: the processes the plan needs,
    on this machine); the result is rank 0's (``None`` on the other machines).
    """
    budget = parse_size(vram, what="--vram") if vram is not None else plan.budget_bytes
    device = options.device if options.device else plan.device
    plan_path = Path(options.out_dir) / "plan.json"
    plan.save(plan_path)
    options = replace(options, predicted_peak_bytes=plan.best.predicted.peak_bytes)
    config = plan.config
    spec = launch if launch is not None else _plan_launch(plan)
    if config.strategy == "single" and spec.world_size == 1:
        guard = MemoryGuard(budget, device="cuda" if device.startswith("cuda") else "cpu")
        # The ladder: what OOM recovery steps down to (same global batch, less predicted memory).
        return train(task, config, options, memory_guard=guard, ladder=plan.ladder())
    if config.world_size != spec.world_size or config.strategy == "single":
        raise ConfigError(
            f"the plan's configuration ({config.describe()}) runs on {config.world_size} process(es), but "
            f"{spec.world_size} were asked for; train it with --nproc {config.world_size}, or plan for "
            f"{spec.world_size} with memplan plan --gpus {spec.nproc_per_node} --nodes {spec.nnodes}"
        )
    if task.source_path is None:
        raise ConfigError("distributed training rebuilds the task in every process from its model file; "
                          "pass a model-file path instead of a module")
    return launch_training(task.source_path, config, options, spec=spec, budget_bytes=budget, ladder=plan.ladder())


def fit(
    model: Task | str | os.PathLike[str] | nn.Module,
    *,
    vram: int | str | None = None,
    sample: Any = None,
    global_batch: int | None = None,
    device: str | None = None,
    trials: int = 60,
    probe_top: int = 2,
    seed: int = 0,
    storage: str | None = None,
    options: TrainOptions | None = None,
    launch: LaunchSpec | None = None,
    shape_policy: str = "max",
) -> tuple[Plan, TrainResult | None]:
    """Search the configurations of ``model`` under ``vram``, then train the best one.

    Returns the plan and the training result; ``options.out_dir`` receives ``plan.json``,
    ``model.pt``, ``metrics.jsonl``, ``summary.json`` and ``checkpoint.pt``. With ``launch``
    (``LaunchSpec(nproc_per_node=2)``), the search plans for ``nproc_per_node x nnodes``
    devices and the winner is trained on that many processes.

    >>> plan, result = fit("examples/digits.py", vram="1GB")   # doctest: +SKIP
    """
    task = resolve_task(model, sample)
    plan = search(task, vram=vram, global_batch=global_batch, device=device, trials=trials,
                  probe_top=probe_top, seed=seed, storage=storage, shape_policy=shape_policy,
                  **layout_kwargs(launch))
    opts = options or TrainOptions()
    opts = replace(opts, device=plan.device, seed=seed)
    return plan, train_plan(task, plan, opts, launch=launch)


def layout_kwargs(launch: LaunchSpec | None, *, gpus: int | None = None, nodes: int | None = None) -> dict[str, int]:
    """``search``'s ``gpus``/``nodes`` for a launch (devices per node, machines)."""
    gpus = gpus if gpus is not None else (launch.nproc_per_node if launch is not None else 1)
    nodes = nodes if nodes is not None else (launch.nnodes if launch is not None else 1)
    if gpus * nodes == 1:
        return {}
    if "gpus" not in inspect.signature(search).parameters:
        raise ConfigError("this memplan's search plans one device only; train a DDP/FSDP plan file with "
                          "memplan train MODEL.py --plan plan.json --nproc N")
    return {"gpus": gpus, "nodes": nodes}


def _plan_launch(plan: Plan) -> LaunchSpec:
    """The processes the plan's configuration needs, on this machine (several machines need
    their rendezvous options: ``--nnodes``, ``--rdzv-endpoint``, ``--rdzv-id``)."""
    needs = getattr(plan, "launch", None) or {"nproc_per_node": plan.config.world_size, "nnodes": 1}
    if int(needs.get("nnodes", 1)) > 1:
        raise ConfigError(
            f"the plan runs on {needs['nnodes']} machines; start memplan train on each with --nproc "
            f"{needs['nproc_per_node']} --nnodes {needs['nnodes']} --node-rank R --rdzv-endpoint HOST:PORT --rdzv-id ID"
        )
    return LaunchSpec(nproc_per_node=int(needs.get("nproc_per_node", plan.config.world_size)))
