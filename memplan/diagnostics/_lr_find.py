"""``memplan lr-find``: the learning-rate range test (Smith 2015; fastai's ``lr_find``).

A fresh model trains with the model file's own optimizer while the learning rate grows
exponentially from ``start_lr`` to ``end_lr``, one batch per step; the loss is smoothed by
a bias-corrected exponential moving average and the sweep stops once the smoothed loss
exceeds ``diverge`` times its minimum. The suggestion uses one stated rule:

* ``min/10`` (default): a tenth of the learning rate at the smoothed loss's minimum — the
  loss still falls fast there, a safe margin below where it blows up;
* ``steepest``: where the smoothed loss falls fastest against log(lr).

The micro-batch size and precision are the plan's (``--plan``) or the options'.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from estimators import ConfigError, Task, TrainConfig, load_task, normalize_precision, parse_count, to_device

from ..planning._space import DEFAULT_GLOBAL_BATCH
from ._steps import PlainSteps, fresh_model

__all__ = ["LrFindResult", "lr_find", "suggest", "add_lr_find_arguments", "run_lr_find"]

Rule = Literal["min/10", "steepest"]


@dataclass(frozen=True)
class LrFindResult:
    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    suggestion: float
    rule: str
    """The rule the suggestion used, in words."""
    diverged: bool
    batch_size: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _smooth(losses: list[float], beta: float) -> list[float]:
    avg, out = 0.0, []
    for i, loss in enumerate(losses, start=1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta**i))  # bias correction: early values are not pulled to 0
    return out


def suggest(lrs: list[float], smoothed: list[float], rule: Rule = "min/10") -> tuple[float, str]:
    """The suggested learning rate and the rule that produced it, in words."""
    if len(lrs) < 5:
        raise ConfigError("lr-find: the sweep stopped after fewer than 5 steps; lower --start-lr")
    values = np.asarray(smoothed)
    lowest = int(np.nanargmin(values))
    if rule == "min/10":
        return lrs[lowest] / 10, f"min/10: a tenth of {lrs[lowest]:.3g}, where the smoothed loss is lowest"
    if rule == "steepest":
        upto = max(lowest, 2)
        slope = np.gradient(values[: upto + 1], np.log(np.asarray(lrs[: upto + 1])))
        i = int(np.nanargmin(slope))
        return lrs[i], f"steepest: the smoothed loss falls fastest against log(lr) at {lrs[i]:.3g}"
    raise ConfigError(f"lr-find: unknown rule {rule!r}; use min/10 or steepest")


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def lr_find(model: Task | str, *, batch_size: int | None = None, precision: str = "fp32", device: str = "cpu",
            start_lr: float = 1e-7, end_lr: float = 10.0, steps: int = 100, beta: float = 0.9,
            diverge: float = 4.0, rule: Rule = "min/10", seed: int = 0) -> LrFindResult:
    """Run the range test on a model file (or :class:`Task`).

    >>> result = lr_find("examples/digits.py")      # doctest: +SKIP
    >>> result.suggestion, result.rule              # doctest: +SKIP
    """
    if not 0 < start_lr < end_lr:
        raise ConfigError(f"lr-find: need 0 < --start-lr < --end-lr, got {start_lr} and {end_lr}")
    task = load_task(model) if isinstance(model, str) else model
    precision = normalize_precision(precision)
    # settings["global_batch"]: a whole number >= 1 or None (checked where the task was made).
    b = batch_size or int(task.settings.get("global_batch") or DEFAULT_GLOBAL_BATCH)
    n = task.dataset_size() or b
    steps_of = PlainSteps(task, fresh_model(task, device, seed, precision), device, precision)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    data = task.dataset()
    factor = (end_lr / start_lr) ** (1 / max(steps - 1, 1))
    lrs: list[float] = []
    losses: list[float] = []
    diverged = False
    for step in range(steps):
        lr = start_lr * factor**step
        _set_lr(steps_of.optimizer, lr)
        items = [data[order[(step * b + i) % n]] for i in range(b)] if data is not None else None
        batch = task.collate(items) if items is not None else task.real_batch(b, offset=step * b)
        batch = to_device(batch, torch.device(device))  # as the trainer moves a batch
        value = steps_of.step(batch)  # the trainer's step; a NaN/inf loss leaves the weights
        if not math.isfinite(value):
            diverged = True
            break
        lrs.append(lr)
        losses.append(value)
        smoothed = _smooth(losses, beta)
        if step > 5 and smoothed[-1] > diverge * min(smoothed):
            diverged = True
            break
    smoothed = _smooth(losses, beta)
    lr, why = suggest(lrs, smoothed, rule)
    return LrFindResult(lrs, losses, smoothed, lr, why, diverged, b)


def plot_lr_find(result: LrFindResult, path: str | Path) -> Path:
    from .._figures import require_matplotlib, save_figure
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(result.lrs, result.losses, color="#bab0ab", linewidth=0.8, label="loss")
    ax.plot(result.lrs, result.smoothed, color="#4e79a7", linewidth=1.6, label="smoothed")
    ax.axvline(result.suggestion, color="#e15759", linestyle="--", label=f"suggested {result.suggestion:.2g}")
    ax.set_xscale("log")
    low, high = min(result.smoothed), max(result.smoothed[: max(len(result.smoothed) // 3, 1)])
    ax.set_ylim(low - 0.1 * abs(high - low), high + 0.5 * abs(high - low) + 1e-12)
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel("training loss")
    ax.set_title(f"learning-rate range test ({result.rule.split(':')[0]})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def add_lr_find_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model file (defines model(), train_data(), …)")
    p.add_argument("--plan", default=None, help="take the micro-batch size and precision from this plan.json")
    p.add_argument("--batch-size", "-b", default=None, help="batch size (default: the plan's or settings['global_batch'], else 32)")
    p.add_argument("--precision", default=None, help="fp32 (default) | bf16 | fp16")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--start-lr", default="1e-7", help="first learning rate (default 1e-7)")
    p.add_argument("--end-lr", default="10", help="last learning rate (default 10)")
    p.add_argument("--steps", default="100", help="sweep steps (default 100)")
    p.add_argument("--rule", default="min/10", choices=["min/10", "steepest"], help="suggestion rule (default min/10)")
    p.add_argument("--plot", default=None, help="draw loss against learning rate to this image (memplan[plots])")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _float(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{what} must be a number such as 1e-7, got {text!r}") from None


def run_lr_find(args: argparse.Namespace) -> int:
    import json

    config: TrainConfig | None = None
    if args.plan:
        from ..planning import Plan

        config = Plan.load(args.plan).config
    batch = (
        parse_count(args.batch_size, what="--batch-size")
        if args.batch_size
        else (config.micro_batch_size if config else None)
    )
    precision = args.precision or (config.precision if config else "fp32")
    if args.plot:
        from .._figures import require_matplotlib

        require_matplotlib()
    result = lr_find(
        args.model,
        batch_size=batch,
        precision=precision,
        device=args.device,
        start_lr=_float(args.start_lr, "--start-lr"),
        end_lr=_float(args.end_lr, "--end-lr"),
        steps=parse_count(args.steps, what="--steps"),
        rule=args.rule,
    )
    if args.plot:
        plot_lr_find(result, args.plot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(
            f"suggested learning rate {result.suggestion:.3g} ({result.rule}); swept {result.lrs[0]:.2g} to "
            f"{result.lrs[-1]:.2g} in {len(result.lrs)} steps of batch {result.batch_size}"
            + ("; stopped where the loss diverged" if result.diverged else "")
        )
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def auto_lr(task: Task, config: TrainConfig, device: str) -> str:
    """``--lr auto``: the range test on the plan's micro-batch size and precision (on the CPU
    for a plan made for another card); prints the suggestion and returns it as text."""
    local = device if device == "cpu" or torch.cuda.is_available() else "cpu"
    result = lr_find(task, batch_size=config.micro_batch_size, precision=config.precision, device=local)
    print(f"--lr auto: {result.suggestion:.3g} ({result.rule})")
    return repr(result.suggestion)
