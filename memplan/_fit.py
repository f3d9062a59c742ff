"""``memplan.fit``: search, then train the winner, writing everything to one folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.nn as nn

from estimators import Task, parse_size
from estimators._guard import MemoryGuard

from ._plan import Plan
from ._search import resolve_task, search
from ._trainer import TrainOptions, TrainResult, train

__all__ = ["fit", "train_plan"]


def train_plan(task: Task, plan: Plan, options: TrainOptions, *, vram: int | str | None = None) -> TrainResult:
    """Train the plan's chosen configuration under the plan's budget (or ``vram``).

    The budget is enforced while training: on CUDA with the per-process memory fraction, on
    the CPU with the memory guard, which raises a real ``torch.OutOfMemoryError``.
    """
    budget = parse_size(vram, what="--vram") if vram is not None else plan.budget_bytes
    device = options.device if options.device else plan.device
    guard = MemoryGuard(budget, device="cuda" if device.startswith("cuda") else "cpu")
    plan_path = Path(options.out_dir) / "plan.json"
    plan.save(plan_path)
    options = _with(options, predicted_peak_bytes=plan.best.predicted.peak_bytes)
    # The ladder: what OOM recovery steps down to (same global batch, less predicted memory).
    return train(task, plan.config, options, memory_guard=guard, ladder=plan.ladder())


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
) -> tuple[Plan, TrainResult]:
    """Search the configurations of ``model`` under ``vram``, then train the best one.

    Returns the plan and the training result; ``options.out_dir`` receives ``plan.json``,
    ``model.pt``, ``metrics.jsonl``, ``summary.json`` and ``checkpoint.pt``.

    >>> plan, result = fit("examples/digits.py", vram="1GB")   # doctest: +SKIP
    """
    task = resolve_task(model, sample)
    plan = search(task, vram=vram, global_batch=global_batch, device=device, trials=trials,
                  probe_top=probe_top, seed=seed, storage=storage)
    opts = options or TrainOptions()
    opts = _with(opts, device=plan.device, seed=seed)
    return plan, train_plan(task, plan, opts)


def _with(options: TrainOptions, **changes: Any) -> TrainOptions:
    from dataclasses import replace
    return replace(options, **changes)
