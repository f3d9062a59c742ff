"""Saying that nothing fits: the lower bound, the nearest miss, and what would make it fit.

Two refusals, both a :class:`NoFeasiblePlanError` naming the need, the budget and the fixes:
before any trace, when the model's own parameters, gradients and optimizer state exceed the budget (a
3B-parameter model on a 2 GB card is refused in the time it takes to build it on meta); and
after the study, when no configuration's estimate (or no probed one) fits, naming the
smallest with its breakdown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from estimators import (
    Estimate,
    Estimator,
    NoFeasiblePlanError,
    Task,
    TrainConfig,
    format_size,
    fsdp_units,
    weight_dtype,
)

from ._plan import excess_bytes, needed_bytes
from ._space import SearchSpace

__all__ = ["StateFloor", "state_floor", "techniques_used", "refuse_from_lower_bound", "no_fit"]


@dataclass(frozen=True)
class StateFloor:
    """The least memory the model's own states need under a configuration, before a single
    activation: every parameter, the gradient of every trainable one and the optimizer's
    state, in the dtypes the configuration trains them in, split over FSDP2's ranks; under CPU
    offload those live in host memory and the device holds at least the root unit and the
    largest block gathered. A bound, counted from the model built on meta (shared parameters
    once): a configuration above it needs no trace to be known not to fit."""

    params: int
    weights: tuple[int, int]
    """Bytes of the parameters as built, and with floating-point ones in 2 bytes (bf16-true)."""
    grads: tuple[int, int]
    """The same for the trainable parameters (their gradients)."""
    optimizer: int
    """The optimizer's state as built (0 when it cannot step on meta)."""
    gathered: int
    """Under offload, what the device holds in any case, in elements: the root unit (gathered
    from forward to the end of backward, FSDP2 does not reshard it) with its unsharded
    gradients (alive from the head's backward to the root's reduce-scatter, at the end), and
    the largest block gathered with its gradients during its backward."""

    def _states(self, config: TrainConfig) -> int:
        low = int(weight_dtype(config.precision) is not None)
        grads = 0 if config.optimizer_in_backward else self.grads[low]
        # The state follows the weights' dtype (fp32 built, bf16 trained).
        total = self.weights[low] + grads + (self.optimizer // 2 if low else self.optimizer)
        # Tensor parallelism splits the block linears and the head over its ranks (the rest is replicated):
        # at most 1/tp of the states per rank, 1/ranks under FSDP2 too (a shard group's
        # under HSDP) -- a bound.
        # A pipeline's stage holds its blocks' part (``1/pp`` of the stack, at best).
        return total // (config.shard_size * config.tp * config.pp)

    def device(self, config: TrainConfig) -> int:
        if config.cpu_offload:
            # Gathered in the compute dtype; autograd's gradients come in the same dtype.
            return self.gathered * (4 if config.precision == "fp32" else 2)
        return self._states(config)

    def host(self, config: TrainConfig) -> int:
        return self._states(config) if config.cpu_offload else 0


def state_floor(task: Task, model: nn.Module) -> StateFloor:
    """The :class:`StateFloor` of ``task``'s model (``model``: built on meta)."""
    weights = [0, 0]
    grads = [0, 0]
    distinct = list(dict.fromkeys(model.parameters()))
    for p in distinct:
        full, low = (
            p.numel() * p.element_size(),
            p.numel() * (min(p.element_size(), 2) if p.is_floating_point() else p.element_size()),
        )
        weights[0] += full
        weights[1] += low
        if p.requires_grad:
            grads[0] += full
            grads[1] += low
    units = fsdp_units(model, task.checkpoint_blocks)
    return StateFloor(
        params=sum(p.numel() for p in distinct),
        weights=(weights[0], weights[1]),
        grads=(grads[0], grads[1]),
        optimizer=_optimizer_state_bytes(task, model),
        gathered=units.root_numel
        + units.root_trainable
        + max((n + t for n, t in zip(units.block_numels, units.block_trainables)), default=0),
    )


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
        return sum(
            v.numel() * v.element_size()
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.device.type == "meta"
        )
    except Exception:  # noqa: BLE001 - a bound without the optimizer's state is still a bound
        return 0
    finally:
        for p in params:
            p.grad = None


def _more_memory_hint(need: int, budget: int, limit: int, estimator: Estimator) -> str:
    """The budget (its margin kept) that ``need`` would fit in, as a fix to suggest."""
    gb = math.ceil(need * budget / limit / 1e9)  # limit >= 1: search() refuses a budget the margin empties
    return f"a card with >= {gb} GB" if estimator.device == "cuda" else f"--vram {gb}GB or more"


def techniques_used(config: TrainConfig, *, states_only: bool = False) -> str:
    """The memory-saving techniques of ``config`` in words ("bf16-true, full checkpointing and
    CPU offload"), for refusals; empty when it uses none. ``states_only``: only those that
    change what the model's states need (not checkpointing)."""
    used: list[str] = []
    if weight_dtype(config.precision) is not None:
        used.append(config.precision)
    if config.checkpoint_segments and not states_only:
        used.append(f"{config.checkpoint_policy} checkpointing")
    if config.optimizer_in_backward:
        used.append("the optimizer step in backward")
    if config.offload_activations and not states_only:
        used.append("activation offloading")
    if config.cpu_offload:
        used.append("CPU offload" + (f" over {config.world_size} FSDP2 ranks" if config.world_size > 1 else ""))
    elif config.strategy == "fsdp" and not states_only:  # a refusal of states says "per device" itself
        used.append(f"FSDP2 over {config.world_size} ranks")
    return used[0] if len(used) == 1 else ", ".join(used[:-1]) + " and " + used[-1] if used else ""


def _corners(space: SearchSpace) -> list[TrainConfig]:
    """A configuration per layout, precision, technique and micro-batch size (a technique may
    apply at some sizes only: the step in backward without accumulation), every block
    checkpointed. The floor does not depend on the batch; the smallest size comes first."""
    s = space.checkpoint_segments[-1]
    return list(
        dict.fromkeys(
            space.config(m, p, s, layout, False, t)
            for m in space.micro_batch_sizes
            for layout in space.layouts
            for p in space.precisions
            for t in space.technique_choices
        )
    )


def refuse_from_lower_bound(
    task: Task,
    floor: StateFloor,
    space: SearchSpace,
    budget: int,
    limit: int,
    estimator: Estimator,
    host_limit: int | None = None,
) -> None:
    """Say at once, without a trace, that nothing fits when the model's own states do not: a
    3B-parameter model on a 2 GB card is refused in the time it takes to build it on meta,
    not after a search's traces. ``host_limit``: the host memory offloaded states may use."""
    corners = _corners(space)
    on_host = [c for c in corners if host_limit is None or floor.host(c) <= host_limit]
    best = min(on_host or corners, key=floor.device)
    if on_host and floor.device(best) <= limit:
        return
    need = floor.device(best)
    hints = [_more_memory_hint(need, budget, limit, estimator)]
    # Offloaded, the device would have room: the host has not.
    short_of_host = [floor.host(c) for c in corners if c not in on_host and floor.device(c) <= limit]
    if short_of_host:
        hints.insert(
            0,
            f"--host-memory {math.ceil(min(short_of_host) / 1e9)}GB or more (offloaded, the states "
            f"need {format_size(min(short_of_host))} of host memory, more than the "
            f"{format_size(host_limit or 0)} allowed)",
        )
    shards = best.shard_size
    devices = max(2, 2 * shards)
    hints.append(f"FSDP over {devices} devices (--gpus {devices})")
    hints.append("a smaller model, or frozen parts (no gradients)")
    used = techniques_used(best, states_only=True)
    even = (f" even in {used}" if used == best.precision else f" even with {used}") if used else ""
    if best.cpu_offload:
        what = (
            f"{task.name}'s root unit and largest block, gathered on the device, alone need "
            f"{format_size(need)}{even}, before any activation"
        )
    else:
        where = (
            f" per device over {best.shard_size} FSDP2 ranks" if best.shard_size > 1 else ""
        )
        what = (
            f"{task.name}'s {floor.params:,} parameters, their gradients"
            + (" and the optimizer's state" if floor.optimizer else "")
            + f" alone need {format_size(need)}{where}{even}, before any activation"
            + ("" if floor.optimizer else " or optimizer state")
        )
    raise NoFeasiblePlanError(
        f"nothing fits in {format_size(budget)} (keeping {format_size(budget - limit)} free): {what}"
        f" — try {', '.join(hints)}",
        nearest=None,
        needed_bytes=need,
        budget_bytes=budget,
    )


def no_fit(
    estimates: list[Estimate],
    budget: int,
    limit: int,
    estimator: Estimator,
    *,
    measured: bool = False,
    host_limit: int | None = None,
    host_needed: int | None = None,
) -> NoFeasiblePlanError:
    """``host_needed``: the least host memory an offloaded configuration that was set aside
    for the host's limit needs (the refusal names it as the first thing to try)."""
    if not estimates:
        return NoFeasiblePlanError(
            f"nothing fits in {format_size(budget)} (keeping {format_size(budget - limit)} free): no configuration "
            "could be estimated — try a card with more memory, FSDP over more devices, or a smaller model",
            nearest=None,
            needed_bytes=limit + 1,
            budget_bytes=budget,
        )
    nearest = min(estimates, key=lambda e: excess_bytes(e, limit, host_limit))
    need = needed_bytes(nearest)
    parts = sorted(nearest.breakdown.items(), key=lambda kv: -kv[1])
    detail = ", ".join(f"{k} {format_size(v)}" for k, v in parts if v > 0)
    if nearest.context_bytes:
        detail += f", CUDA context {format_size(nearest.context_bytes)}"
    if nearest.host_bytes and host_limit is not None and nearest.host_bytes > host_limit:
        detail += (
            f"; and {format_size(nearest.host_bytes)} of host memory, more than the {format_size(host_limit)} allowed"
        )
    hints = [_more_memory_hint(need, budget, limit, estimator)]
    if host_needed is not None and host_limit is not None:
        hints.insert(0, f"--host-memory {math.ceil(host_needed / 1e9)}GB or more (offloaded, the states need "
                        f"{format_size(host_needed)} of host memory, more than the {format_size(host_limit)} allowed)")
    if nearest.config.strategy == "fsdp":
        hints.append(f"FSDP over more devices (--gpus {2 * nearest.config.world_size})")
    else:
        # FSDP2 shards parameters, gradients and optimizer state over the ranks.
        devices = max(2, 2 * nearest.config.world_size)
        hints.append(f"FSDP over {devices} devices (--gpus {devices})")
    if nearest.host_bytes and host_limit is not None and nearest.host_bytes > host_limit:
        hints.append("--host-memory with the host's RAM")
    hints.append("a smaller model")
    what = "nothing fits" if not measured else "nothing that was probed fits"
    used = techniques_used(nearest.config)
    return NoFeasiblePlanError(
        f"{what} in {format_size(budget)} (keeping {format_size(budget - limit)} free); the smallest plan "
        f"({nearest.config.describe()}) needs {format_size(need)}"
        + (f" even with {used}" if used else "")
        + f": {detail} — try {', '.join(hints)}",
        nearest=nearest,
        needed_bytes=need,
        budget_bytes=budget,
    )
