"""Saying that nothing fits: the lower bound, the nearest miss, and what would make it fit.

Two refusals, both a :class:`NoFeasiblePlanError` naming the need, the budget and the fixes:
before any trace, when the model's own parameters, gradients and optimizer state exceed the budget (a
3B-parameter model on a 2 GB card is refused in the time it takes to build it on meta); and
after the study, when no configuration's estimate (or no probed one) fits, naming the
smallest with its breakdown.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from estimators import Estimate, Estimator, NoFeasiblePlanError, Task, format_size

from ._plan import needed_bytes
from ._space import SearchSpace

__all__ = ["refuse_from_lower_bound", "no_fit"]


def _model_state_floor(model: nn.Module, space: SearchSpace) -> tuple[int, int, int]:
    """(bytes, parameters, shards): the least any configuration of ``space`` can hold per
    device before a single activation or optimizer state — every parameter and the gradient
    of every trainable one, in the dtypes the model is built in (mixed precision keeps fp32
    weights; ``bf16-true`` halves them where the space holds it), split over the ranks when FSDP2
    is searched (shared parameters counted once)."""
    seen: set[int] = set()
    states = params = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel()
        states += p.numel() * _element_size(p, space) * (2 if p.requires_grad else 1)
    shards = max((layout.world_size for layout in space.layouts if layout.strategy == "fsdp"), default=1)
    return states // shards, params, shards


def _element_size(p: nn.Parameter, space: SearchSpace) -> int:
    """Bytes per element of ``p`` in the most frugal precision ``space`` holds: bf16-true keeps
    floating-point weights (and their gradients and optimizer state) in two bytes."""
    if "bf16-true" in space.precisions and p.is_floating_point():
        return min(p.element_size(), 2)
    return p.element_size()


def _optimizer_state_bytes(task: Task, model: nn.Module) -> int:
    """Bytes of the state the task's optimizer keeps for ``model`` (built on meta): one step of
    it on meta gradients, which allocates nothing; 0 when the optimizer cannot step on meta
    (the bound then leaves its state out, and stays a bound)."""
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad and p.device.type == "meta"]
    if not params:
        return 0
    try:
        for p in params:
            p.grad = torch.empty_like(p)
        optimizer = task.make_optimizer(model)
        optimizer.step()
        return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.device.type == "meta")
    except Exception:  # noqa: BLE001 - a bound without the optimizer's state is still a bound
        return 0
    finally:
        for p in params:
            p.grad = None


def _more_memory_hint(need: int, budget: int, limit: int, estimator: Estimator) -> str:
    """The budget (its margin kept) that ``need`` would fit in, as a fix to suggest."""
    gb = math.ceil(need * budget / limit / 1e9)
    return f"a card with >= {gb} GB" if estimator.device == "cuda" else f"--vram {gb}GB or more"


def refuse_from_lower_bound(task: Task, model: nn.Module, space: SearchSpace, budget: int, limit: int,
                            estimator: Estimator) -> None:
    """Say at once, without a trace, that nothing fits when the model's own states do not: a
    3B-parameter model on a 2 GB card is refused in the time it takes to build it on meta,
    not after a search's traces."""
    floor, params, shards = _model_state_floor(model, space)
    optimizer = _optimizer_state_bytes(task, model) // shards
    if "bf16-true" in space.precisions:
        optimizer //= 2  # the state follows the weights' dtype (fp32 built, bf16 trained)
    if floor + optimizer <= limit:
        return
    floor += optimizer
    where = f" per device over {shards} FSDP2 ranks" if shards > 1 else ""
    if "bf16-true" in space.precisions:
        where += " even in bf16-true"
    hints = [_more_memory_hint(floor, budget, limit, estimator)]
    devices = max(2, 2 * shards)
    hints.append(f"FSDP over {devices} devices (--gpus {devices})")
    hints.append("a smaller model, or frozen parts (no gradients)")
    raise NoFeasiblePlanError(
        f"nothing fits in {format_size(budget)} (keeping {format_size(budget - limit)} free): {task.name}'s "
        f"{params:,} parameters, their gradients" + (" and the optimizer's state" if optimizer else "")
        + f" alone need {format_size(floor)}{where}, before any activation"
        + ("" if optimizer else " or optimizer state") + f" — try {', '.join(hints)}",
        nearest=None, needed_bytes=floor, budget_bytes=budget,
    )


def no_fit(estimates: list[Estimate], budget: int, limit: int, estimator: Estimator, *, measured: bool = False) -> NoFeasiblePlanError:
    nearest = min(estimates, key=needed_bytes)
    need = needed_bytes(nearest)
    parts = sorted(nearest.breakdown.items(), key=lambda kv: -kv[1])
    detail = ", ".join(f"{k} {format_size(v)}" for k, v in parts if v > 0)
    if nearest.context_bytes:
        detail += f", CUDA context {format_size(nearest.context_bytes)}"
    hints = [_more_memory_hint(need, budget, limit, estimator)]
    if nearest.config.strategy == "fsdp":
        hints.append(f"FSDP over more devices (--gpus {2 * nearest.config.world_size})")
    else:
        # FSDP2 shards parameters, gradients and optimizer state over the ranks.
        devices = max(2, 2 * nearest.config.world_size)
        hints.append(f"FSDP over {devices} devices (--gpus {devices})")
    hints.append("a smaller model")
    what = "nothing fits" if not measured else "nothing that was probed fits"
    return NoFeasiblePlanError(
        f"{what} in {format_size(budget)} (keeping {format_size(budget - limit)} free); the smallest plan "
        f"({nearest.config.describe()}) needs {format_size(need)}: {detail} — try {', '.join(hints)}",
        nearest=nearest, needed_bytes=need, budget_bytes=budget,
    )
