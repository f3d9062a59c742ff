"""Learning-rate schedules, stepped once per *optimizer* step (not per micro-batch, not per epoch).

Every schedule sets each parameter group's lr from its base lr and the number of optimizer
steps taken so far, ``t``. All but ``onecycle`` start with the same linear warm-up over
``warmup_steps`` (nanoGPT's ``(t + 1) / (warmup + 1)``, so the lr is never 0 and reaches the
base lr exactly at ``t = warmup_steps``), and count their own shape from the end of it (as
``SequentialLR([warm-up, schedule])`` does):

``cosine`` (default)
    a half cosine down to ``min_lr_ratio`` x base (default 0.1, nanoGPT's ``min_lr = lr / 10``),
    or to the absolute ``min_lr``, at ``total_steps``.
``onecycle``
    Smith's one-cycle: up from ``base / div_factor`` (25) to the base lr over ``warmup_steps``
    (or ``pct_start`` of the run; 30% when neither is set), then down to
    ``base / (div_factor * final_div_factor)`` (1e4); ``anneal_strategy`` ``"cos"`` (default) or
    ``"linear"``. With ``cycle_momentum`` the momentum (SGD's ``momentum``, the Adam family's
    ``betas[0]``) moves the other way, from ``max_momentum`` (0.95) to ``base_momentum`` (0.85)
    and back, as ``torch.optim.lr_scheduler.OneCycleLR`` does; off by default, so any optimizer
    works unchanged.
``step``
    the lr is multiplied by ``gamma`` (0.1) every ``step_size`` steps (default: a third of the
    steps after warm-up, i.e. two drops, the classic ImageNet recipe).
``multistep``
    the lr is multiplied by ``gamma`` (0.1) at each of ``milestones`` (steps after warm-up).
``exponential``
    the lr is multiplied by ``gamma`` (required) every step.
``cosine_restarts``
    SGDR (``CosineAnnealingWarmRestarts``): cosine from the base lr to ``min_lr`` (0) over
    ``t_0`` steps (required), then again over ``t_0 * t_mult``, ``t_0 * t_mult**2``, ...
``plateau``
    the lr is multiplied by ``factor`` (0.5) whenever the monitored validation metric has not
    improved for ``patience`` (2) evaluations, then nothing is counted for ``cooldown`` (0)
    evaluations; down to ``min_lr_ratio`` x base (1e-3) or the absolute ``min_lr``. The trainer
    calls :meth:`LRSchedule.observe` after each evaluation.
``constant``
    the base lr.

A model file may instead define ``scheduler(optimizer, total_steps)`` returning any
``torch.optim.lr_scheduler.LRScheduler``; :class:`ExternalSchedule` steps it the same way (a
``ReduceLROnPlateau`` is stepped with each evaluation's metric instead).

The module holds, in this order, :class:`LRSchedule` (how the trainer steps a schedule: it sets
every group's lr from its base lr and ``t``), :class:`ExternalSchedule` (a model file's own
``torch.optim.lr_scheduler`` behind the same methods), the built-in shapes by name (``SHAPES``:
each defines its factor of the base lr after ``t`` optimizer steps, the warm-up included) and
:func:`make_schedule`.

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
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch

from estimators import ConfigError, ModelFileError

__all__ = ["ScheduleName", "SCHEDULES", "SCHEDULE_ARGS", "LRSchedule", "ExternalSchedule", "make_schedule"]

ScheduleName = Literal["cosine", "onecycle", "step", "multistep", "exponential", "cosine_restarts",
                       "plateau", "constant"]
SCHEDULES: tuple[str, ...] = ("cosine", "onecycle", "step", "multistep", "exponential", "cosine_restarts",
                              "plateau", "constant")


SCHEDULE_ARGS: dict[str, tuple[str, ...]] = {
    "cosine": ("min_lr_ratio", "min_lr"),
    "onecycle": ("div_factor", "final_div_factor", "pct_start", "anneal_strategy", "cycle_momentum",
                 "base_momentum", "max_momentum"),
    "step": ("step_size", "gamma"),
    "multistep": ("milestones", "gamma"),
    "exponential": ("gamma",),
    "cosine_restarts": ("t_0", "t_mult", "min_lr"),
    "plateau": ("mode", "factor", "patience", "threshold", "min_lr_ratio", "min_lr", "cooldown"),
    "constant": (),
}
"""The shape arguments each schedule takes."""

_NEEDS_HORIZON = ("cosine", "onecycle", "step")


# -- the interface: how the trainer steps a schedule, and a model file's own --------------------

class LRSchedule:
    """Sets every group's lr from its base lr and ``t``, once per optimizer step.

    ``last_epoch`` is the number of optimizer steps taken (torch's name for it, so code written
    for ``torch.optim.lr_scheduler`` reads it). Subclasses define :meth:`factor` (or
    :meth:`lr_at` when the lr is not a multiple of the base lr); the trainer calls :meth:`step`
    after each optimizer step that was applied and :meth:`observe` after each evaluation.
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

    def lr_at(self, base: float, t: int) -> float:
        """The lr of a group with base lr ``base`` after ``t`` optimizer steps."""
        return base * self.factor(t)

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
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = self.lr_at(base, self.last_epoch)


class ExternalSchedule(LRSchedule):
    """A model file's ``scheduler(optimizer, total_steps)``, stepped as the built-in schedules
    are: once per optimizer step, or -- a ``ReduceLROnPlateau`` -- once per evaluation with the
    monitored metric. It owns the lr entirely (no warm-up is added to it)."""

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer, *, name: str = "the model file") -> None:
        for attr in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(scheduler, attr, None)):
                raise ModelFileError(
                    f"{name}: scheduler(optimizer, total_steps) returned {type(scheduler).__name__}, not a "
                    "torch.optim.lr_scheduler.LRScheduler; return e.g. "
                    "torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)"
                )
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ModelFileError(f"{name}: scheduler() must schedule the optimizer it is given")
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.base_lrs = [float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        self.warmup_steps, self.total_steps = 0, None
        self.on_metric = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.last_epoch = 0

    def step(self) -> None:
        self.last_epoch += 1
        if self.on_metric:
            return
        with warnings.catch_warnings():
            # A step the GradScaler skipped has no optimizer.step(): torch warns about the order.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self.scheduler.step()

    def observe(self, metric: float) -> None:
        if self.on_metric and math.isfinite(metric):
            self.scheduler.step(metric)

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # The optimizer's own state (loaded first) brings each group's lr back.
        self.last_epoch = int(state["last_epoch"])
        self.scheduler.load_state_dict(state["scheduler"])


# -- the built-in shapes, by name ------------------------------------------------------------

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
    a missing required argument, or a missing horizon (cosine, onecycle and step need
    ``total_steps``).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> make_schedule("step", opt, total_steps=9, step_size=3, gamma=0.5).factor(7)
        0.25
    """
    if name not in SHAPES:
        raise ConfigError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    unknown = set(kwargs) - set(SCHEDULE_ARGS[name])
    if unknown:
        allowed = ", ".join(SCHEDULE_ARGS[name]) or "none"
        raise ConfigError(f"schedule {name!r} takes no argument(s) {sorted(unknown)}; it takes: {allowed}")
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if name in _NEEDS_HORIZON and (total_steps is None or total_steps < 1):
        raise ConfigError(f"schedule {name!r} needs the run's length; set epochs or max_steps")
    return SHAPES[name](optimizer, warmup_steps=warmup_steps, total_steps=total_steps, **kwargs)
