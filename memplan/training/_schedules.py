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

from typing import Any, Literal

import torch

from estimators import ConfigError

from .._lr_schedule import ExternalSchedule, LRSchedule
from .._schedule_shapes import SHAPES

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
