"""Learning-rate schedules, stepped once per *optimizer* step (not per micro-batch, not per epoch).

Every schedule multiplies each parameter group's base learning rate by a factor of the number
of optimizer steps taken so far, ``t``:

``cosine`` (default)
    linear warm-up over ``warmup_steps`` (nanoGPT's ``(t + 1) / (warmup + 1)``, so the lr is
    never 0 and reaches the base lr exactly at ``t = warmup_steps``), then a half cosine down
    to ``min_lr_ratio`` (default 0.1, nanoGPT's ``min_lr = lr / 10``) at ``total_steps``.
``onecycle``
    Smith's one-cycle: cosine up from ``base / div_factor`` (25) to the base lr over
    ``warmup_steps`` (30% of the run when 0), then cosine down to
    ``base / (div_factor * final_div_factor)`` (1e4). Only the lr cycles; momentum does not
    (unlike ``torch.optim.lr_scheduler.OneCycleLR``), so any optimizer works unchanged.
``step``
    warm-up, then the lr is multiplied by ``gamma`` (0.1) every ``step_size`` steps (default: a
    third of the steps after warm-up, i.e. two drops, the classic ImageNet recipe).
``plateau``
    warm-up, then the lr is multiplied by ``factor`` (0.5) whenever the monitored validation
    metric has not improved for ``patience`` (2) evaluations, down to ``min_lr_ratio`` (1e-3).
    The trainer calls :meth:`LRSchedule.observe` after each evaluation.
``constant``
    warm-up, then the base lr.

Only the *progress* (steps taken, plateau bookkeeping) is saved in ``state_dict``; the shape
(base lrs, warm-up, horizon) comes from the constructor. A run resumed with a larger
``max_steps`` therefore follows the new horizon from where it stopped instead of the old one.

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> s = make_schedule("cosine", opt, warmup_steps=2, total_steps=10)
    >>> lrs = []
    >>> for _ in range(4):
    ...     lrs.append(round(s.get_last_lr()[0], 3))  # the lr the next optimizer step uses
    ...     s.step()
    >>> lrs
    [0.333, 0.667, 1.0, 0.966]
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping

import torch

from estimators import ConfigError

__all__ = ["ScheduleName", "SCHEDULES", "LRSchedule", "make_schedule"]

ScheduleName = Literal["cosine", "onecycle", "step", "plateau", "constant"]
SCHEDULES: tuple[str, ...] = ("cosine", "onecycle", "step", "plateau", "constant")


class LRSchedule:
    """Sets ``group["lr"] = base_lr * factor(t)`` for every group, once per optimizer step.

    ``last_epoch`` is the number of optimizer steps taken (torch's name for it, so code written
    for ``torch.optim.lr_scheduler`` reads it). Subclasses define :meth:`factor`; the trainer
    calls :meth:`step` after each optimizer step that was applied and :meth:`observe` after each
    evaluation.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int = 0,
                 total_steps: int | None = None) -> None:
        self.optimizer = optimizer
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.warmup_steps = int(warmup_steps)
        self.total_steps = total_steps
        self.last_epoch = 0
        self._apply()

    def factor(self, t: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def warmup_factor(self, t: int) -> float:
        """Linear warm-up: ``(t + 1) / (warmup + 1)`` before ``warmup_steps``, else 1."""
        if t < self.warmup_steps:
            return (t + 1) / (self.warmup_steps + 1)
        return 1.0

    def step(self) -> None:
        """Advance by one optimizer step and set the lr for the next one."""
        self.last_epoch += 1
        self._apply()

    def observe(self, metric: float) -> None:
        """An evaluation result of the monitored metric (only ``plateau`` uses it)."""

    def get_last_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._apply()

    def _apply(self) -> None:
        f = self.factor(self.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * f


def _cosine_between(start: float, end: float, progress: float) -> float:
    """Half a cosine from ``start`` (progress 0) to ``end`` (progress 1)."""
    progress = min(max(progress, 0.0), 1.0)
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


class _Cosine(LRSchedule):
    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                 min_lr_ratio: float = 0.1) -> None:
        self.min_lr_ratio = float(min_lr_ratio)
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return self.warmup_factor(t)
        assert self.total_steps is not None
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        return _cosine_between(1.0, self.min_lr_ratio, (t - self.warmup_steps) / decay_steps)


class _OneCycle(LRSchedule):
    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                 div_factor: float = 25.0, final_div_factor: float = 1e4) -> None:
        self.div_factor = float(div_factor)
        self.final_div_factor = float(final_div_factor)
        # The rising phase *is* the warm-up; without one, Smith's 30%.
        self.up_steps = warmup_steps if warmup_steps > 0 else max(1, int(0.3 * total_steps))
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def factor(self, t: int) -> float:
        assert self.total_steps is not None
        start = 1.0 / self.div_factor
        if t < self.up_steps:
            return _cosine_between(start, 1.0, t / self.up_steps)
        end = start / self.final_div_factor
        return _cosine_between(1.0, end, (t - self.up_steps) / max(1, self.total_steps - self.up_steps))


class _Step(LRSchedule):
    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                 step_size: int | None = None, gamma: float = 0.1) -> None:
        self.step_size = int(step_size) if step_size else max(1, math.ceil((total_steps - warmup_steps) / 3))
        self.gamma = float(gamma)
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def factor(self, t: int) -> float:
        if t < self.warmup_steps:
            return self.warmup_factor(t)
        return self.gamma ** ((t - self.warmup_steps) // self.step_size)


class _Constant(LRSchedule):
    def factor(self, t: int) -> float:
        return self.warmup_factor(t)


class _Plateau(LRSchedule):
    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int | None = None,
                 mode: Literal["min", "max"] = "min", factor: float = 0.5, patience: int = 2,
                 threshold: float = 1e-4, min_lr_ratio: float = 1e-3) -> None:
        if mode not in ("min", "max"):
            raise ConfigError(f"plateau schedule: mode must be 'min' or 'max', got {mode!r}")
        self.mode = mode
        self.reduce_by = float(factor)
        self.patience = int(patience)
        self.threshold = float(threshold)
        self.min_lr_ratio = float(min_lr_ratio)
        # progress, saved in state_dict
        self.scale = 1.0
        self.best: float | None = None
        self.bad_evaluations = 0
        super().__init__(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)

    def factor(self, t: int) -> float:
        return self.warmup_factor(t) * self.scale

    def observe(self, metric: float) -> None:
        if not math.isfinite(metric):
            return
        # Relative threshold, as ReduceLROnPlateau: tiny improvements do not reset patience.
        if self.best is None or (
            metric < self.best * (1 - self.threshold) if self.mode == "min"
            else metric > self.best * (1 + self.threshold)
        ):
            self.best, self.bad_evaluations = metric, 0
            return
        self.bad_evaluations += 1
        if self.bad_evaluations > self.patience:
            self.scale = max(self.scale * self.reduce_by, self.min_lr_ratio)
            self.bad_evaluations = 0
            self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "scale": self.scale, "best": self.best,
                "bad_evaluations": self.bad_evaluations}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scale = float(state.get("scale", 1.0))
        self.best = state.get("best")
        self.bad_evaluations = int(state.get("bad_evaluations", 0))
        super().load_state_dict(state)


_CLASSES: dict[str, type[LRSchedule]] = {
    "cosine": _Cosine, "onecycle": _OneCycle, "step": _Step, "plateau": _Plateau, "constant": _Constant,
}
_ARGS: dict[str, tuple[str, ...]] = {
    "cosine": ("min_lr_ratio",),
    "onecycle": ("div_factor", "final_div_factor"),
    "step": ("step_size", "gamma"),
    "plateau": ("mode", "factor", "patience", "threshold", "min_lr_ratio"),
    "constant": (),
}


def make_schedule(
    name: str,
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    **kwargs: Any,
) -> LRSchedule:
    """The schedule ``name`` over ``total_steps`` optimizer steps; ``kwargs`` tune its shape.

    Raises :class:`ConfigError` for an unknown name, an argument the schedule does not take,
    or a missing horizon (cosine, onecycle and step need ``total_steps``).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> make_schedule("step", opt, total_steps=9, step_size=3, gamma=0.5).factor(7)
        0.25
    """
    if name not in _CLASSES:
        raise ConfigError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    unknown = set(kwargs) - set(_ARGS[name])
    if unknown:
        allowed = ", ".join(_ARGS[name]) or "none"
        raise ConfigError(f"schedule {name!r} takes no argument(s) {sorted(unknown)}; it takes: {allowed}")
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if name in ("cosine", "onecycle", "step"):
        if total_steps is None or total_steps < 1:
            raise ConfigError(f"schedule {name!r} needs the run's length; set epochs or max_steps")
        return _CLASSES[name](optimizer, warmup_steps=warmup_steps, total_steps=total_steps, **kwargs)  # type: ignore[call-arg]
    return _CLASSES[name](optimizer, warmup_steps=warmup_steps, total_steps=total_steps, **kwargs)  # type: ignore[call-arg]
