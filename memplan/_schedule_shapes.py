"""The built-in learning-rate shapes (``memplan.training._schedules`` describes each), by name.

Each is an :class:`LRSchedule` that defines its factor of the base lr after ``t`` optimizer
steps, the warm-up included; ``plateau`` also observes the monitored metric.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch

from estimators import ConfigError

from ._lr_schedule import LRSchedule

__all__ = ["SHAPES"]


def _cosine_between(start: float, end: float, progress: float) -> float:
    """Half a cosine from ``start`` (progress 0) to ``end`` (progress 1)."""
    progress = min(max(progress, 0.0), 1.0)
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _linear_between(start: float, end: float, progress: float) -> float:
    progress = min(max(progress, 0.0), 1.0)
    return start + (end - start) * progress


class _Cosine(LRSchedule):
    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                 min_lr_ratio: float | None = None, min_lr: float | None = None) -> None:
        if min_lr_ratio is not None and min_lr is not None:
            raise ConfigError("schedule 'cosine': set min_lr (absolute) or min_lr_ratio, not both")
        self.min_lr_ratio = 0.1 if min_lr_ratio is None else float(min_lr_ratio)
        self.min_lr = min_lr
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def lr_at(self, base: float, t: int) -> float:
        if t < self.warmup_steps:
            return base * self.warmup_factor(t)
        assert self.total_steps is not None
        end = base * self.min_lr_ratio if self.min_lr is None else float(self.min_lr)
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        return _cosine_between(base, end, (t - self.warmup_steps) / decay_steps)


class _OneCycle(LRSchedule):
    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                 div_factor: float = 25.0, final_div_factor: float = 1e4, pct_start: float | None = None,
                 anneal_strategy: Literal["cos", "linear"] = "cos", cycle_momentum: bool = False,
                 base_momentum: float = 0.85, max_momentum: float = 0.95) -> None:
        if pct_start is not None and warmup_steps > 0:
            raise ConfigError("schedule 'onecycle': its rise is the warm-up; set warmup_steps or pct_start, not both")
        if anneal_strategy not in ("cos", "linear"):
            raise ConfigError(
                f"schedule 'onecycle': anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}"
            )
        self.div_factor = float(div_factor)
        self.final_div_factor = float(final_div_factor)
        # The rising phase *is* the warm-up; without one, pct_start of the run (Smith's 30%).
        pct = 0.3 if pct_start is None else float(pct_start)
        self.up_steps = warmup_steps if warmup_steps > 0 else max(1, int(pct * total_steps))
        self._anneal = _cosine_between if anneal_strategy == "cos" else _linear_between
        self.cycle_momentum = bool(cycle_momentum)
        self.base_momentum, self.max_momentum = float(base_momentum), float(max_momentum)
        if self.cycle_momentum:
            self._momentum_key = _momentum_key(optimizer)
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def _progress(self, t: int, start: float, peak: float, end: float) -> float:
        """``start`` -> ``peak`` over the rise, ``peak`` -> ``end`` over the rest."""
        assert self.total_steps is not None
        if t < self.up_steps:
            return self._anneal(start, peak, t / self.up_steps)
        return self._anneal(peak, end, (t - self.up_steps) / max(1, self.total_steps - self.up_steps))

    def factor(self, t: int) -> float:
        start = 1.0 / self.div_factor
        return self._progress(t, start, 1.0, start / self.final_div_factor)

    def _apply(self) -> None:
        super()._apply()
        if not self.cycle_momentum:
            return
        # Momentum moves against the lr: high while the lr is low, lowest at the peak lr.
        m = self._progress(self.last_epoch, self.max_momentum, self.base_momentum, self.max_momentum)
        for group in self.optimizer.param_groups:
            if self._momentum_key == "betas":
                group["betas"] = (m, *tuple(group["betas"])[1:])
            else:
                group["momentum"] = m


def _momentum_key(optimizer: torch.optim.Optimizer) -> str:
    defaults = optimizer.defaults
    if "betas" in defaults:
        return "betas"
    if "momentum" in defaults:
        return "momentum"
    raise ConfigError(
        f"schedule 'onecycle': cycle_momentum needs an optimizer with momentum or betas, and "
        f"{type(optimizer).__name__} has neither; set cycle_momentum=False"
    )


class _Step(LRSchedule):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_steps: int,
        total_steps: int,
        step_size: int | None = None,
        gamma: float = 0.1,
    ) -> None:
        self.step_size = int(step_size) if step_size else max(1, math.ceil((total_steps - warmup_steps) / 3))
        self.gamma = float(gamma)
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return self.warmup_factor(t)
        return self.gamma ** ((t - self.warmup_steps) // self.step_size)


class _MultiStep(LRSchedule):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_steps: int,
        total_steps: int | None = None,
        milestones: Any = None,
        gamma: float = 0.1,
    ) -> None:
        self.milestones = _milestones(milestones)
        self.gamma = float(gamma)
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return self.warmup_factor(t)
        passed = sum(1 for m in self.milestones if t - self.warmup_steps >= m)
        return self.gamma**passed


def _milestones(value: Any) -> tuple[int, ...]:
    try:
        out = tuple(int(m) for m in value) if value is not None else ()
        ok = (
            bool(out)
            and all(m >= 1 for m in out)
            and list(out) == sorted(set(out))
            and all(float(m) == float(v) for m, v in zip(out, value))
        )
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"schedule 'multistep' needs milestones: increasing whole numbers >= 1, got {value!r}")
    return out


class _Exponential(LRSchedule):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_steps: int,
        total_steps: int | None = None,
        gamma: float | None = None,
    ) -> None:
        if gamma is None or not 0.0 < float(gamma) <= 1.0:
            raise ConfigError(f"schedule 'exponential' needs gamma in (0, 1] (e.g. 0.999), got {gamma!r}")
        self.gamma = float(gamma)
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return self.warmup_factor(t)
        return self.gamma ** (t - self.warmup_steps)


class _CosineRestarts(LRSchedule):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_steps: int,
        total_steps: int | None = None,
        t_0: int | None = None,
        t_mult: int = 1,
        min_lr: float | None = None,
    ) -> None:
        if not isinstance(t_0, int) or isinstance(t_0, bool) or t_0 < 1:
            raise ConfigError(f"schedule 'cosine_restarts' needs t_0, the first period in steps (>= 1), got {t_0!r}")
        if not isinstance(t_mult, int) or isinstance(t_mult, bool) or t_mult < 1:
            raise ConfigError(f"schedule 'cosine_restarts': t_mult must be a whole number >= 1, got {t_mult!r}")
        self.t_0, self.t_mult = t_0, t_mult
        self.min_lr = 0.0 if min_lr is None else float(min_lr)
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def position(self, t: int) -> tuple[int, int]:
        """(steps into the current period, its length) after ``t`` steps past the warm-up."""
        if self.t_mult == 1:
            return t % self.t_0, self.t_0
        # Whole periods first, in integers: t_0 * (t_mult**n - 1) / (t_mult - 1) steps.
        n, start, length = 0, 0, self.t_0
        while t >= start + length:
            start, length, n = start + length, length * self.t_mult, n + 1
        return t - start, length

    def lr_at(self, base: float, t: int) -> float:
        if t < self.warmup_steps:
            return base * self.warmup_factor(t)
        cur, length = self.position(t - self.warmup_steps)
        return _cosine_between(base, self.min_lr, cur / length)


class _Constant(LRSchedule):
    def factor(self, t: int) -> float:
        return self.warmup_factor(t)


class _Plateau(LRSchedule):
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_steps: int,
        total_steps: int | None = None,
        mode: Literal["min", "max"] = "min",
        factor: float = 0.5,
        patience: int = 2,
        threshold: float = 1e-4,
        min_lr_ratio: float | None = None,
        min_lr: float | None = None,
        cooldown: int = 0,
    ) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"plateau schedule: mode must be 'min' or 'max', got {mode!r}")
        if min_lr_ratio is not None and min_lr is not None:
            raise ConfigError("schedule 'plateau': set min_lr (absolute) or min_lr_ratio, not both")
        if not isinstance(cooldown, int) or isinstance(cooldown, bool) or cooldown < 0:
            raise ConfigError(f"schedule 'plateau': cooldown must be a whole number >= 0, got {cooldown!r}")
        self.mode = mode
        self.reduce_by = float(factor)
        self.patience = int(patience)
        self.threshold = float(threshold)
        self.cooldown = cooldown
        self.min_lr = min_lr
        if min_lr is None:
            self.min_scale = 1e-3 if min_lr_ratio is None else float(min_lr_ratio)
        else:
            # Reductions stop once every group is at the floor (the largest base lr last).
            top = max((float(g["lr"]) for g in optimizer.param_groups), default=0.0)
            self.min_scale = float(min_lr) / top if top > 0 else 0.0
        # progress, saved in state_dict
        self.scale = 1.0
        self.best: float | None = None
        self.bad_evaluations = 0
        self.cooldown_left = 0
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def lr_at(self, base: float, t: int) -> float:
        lr = base * self.warmup_factor(t) * self.scale
        if self.min_lr is not None and t >= self.warmup_steps:
            lr = max(lr, float(self.min_lr))  # an absolute floor, as ReduceLROnPlateau's min_lr
        return lr

    def observe(self, metric: float) -> None:
        if not math.isfinite(metric):
            return
        # Relative threshold, as ReduceLROnPlateau: tiny improvements do not reset patience.
        if self.best is None or (
            metric < self.best * (1 - self.threshold)
            if self.mode == "min"
            else metric > self.best * (1 + self.threshold)
        ):
            self.best, self.bad_evaluations = metric, 0
        else:
            self.bad_evaluations += 1
        if self.cooldown_left > 0:  # right after a reduction: give the new lr time to work
            self.cooldown_left -= 1
            self.bad_evaluations = 0
        if self.bad_evaluations > self.patience:
            self.scale = max(self.scale * self.reduce_by, self.min_scale)
            self.bad_evaluations = 0
            self.cooldown_left = self.cooldown
            self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_epoch": self.last_epoch,
            "scale": self.scale,
            "best": self.best,
            "bad_evaluations": self.bad_evaluations,
            "cooldown_left": self.cooldown_left,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scale = float(state.get("scale", 1.0))
        self.best = state.get("best")
        self.bad_evaluations = int(state.get("bad_evaluations", 0))
        self.cooldown_left = int(state.get("cooldown_left", 0))
        super().load_state_dict(state)


SHAPES: dict[str, type[LRSchedule]] = {
    "cosine": _Cosine,
    "onecycle": _OneCycle,
    "step": _Step,
    "multistep": _MultiStep,
    "exponential": _Exponential,
    "cosine_restarts": _CosineRestarts,
    "plateau": _Plateau,
    "constant": _Constant,
}
"""The schedule class of each built-in name."""
