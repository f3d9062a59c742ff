"""The step's options besides forward, backward and the optimizer step: what the trainer's
options switch on that changes the step's memory or its ops (clipping, EMA, label smoothing).

A :class:`~estimators.Task` carries them (``Task.with_step``), so that the trace, the probes and
the trainer run the same step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ._errors import ConfigError

__all__ = ["StepOptions", "ClipMode"]

ClipMode = Literal["norm", "value", "off"]


@dataclass(frozen=True, slots=True)
class StepOptions:
    """What the step does besides forward, backward and the optimizer step, where it changes
    memory or the ops that run. The defaults are the trainer's (``TrainOptions``)."""

    clip: ClipMode = "norm"
    """Gradient clipping: by the global norm, by value, or off."""
    clip_threshold: float = 1.0
    ema_decay: float | None = None
    """An EMA of the weights (one more copy of the floating-point state) when set."""
    label_smoothing: float = 0.0
    """Label smoothing of the default cross-entropy loss (its own ops and temporaries)."""
    compile: bool = False
    """The forward runs through ``torch.compile``. Fake tensors cannot run Inductor: a trace
    records the eager step and says so in its notes; probes build and measure the compiled one."""

    def __post_init__(self) -> None:
        if self.clip not in ("norm", "value", "off"):
            raise ConfigError(f"StepOptions.clip must be 'norm', 'value' or 'off', got {self.clip!r}")
        if self.clip != "off" and not self.clip_threshold > 0:
            raise ConfigError(f"StepOptions.clip_threshold must be > 0, got {self.clip_threshold!r}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"StepOptions.ema_decay must be in (0, 1) or None, got {self.ema_decay!r}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"StepOptions.label_smoothing must be in [0, 1), got {self.label_smoothing!r}")

    @classmethod
    def from_settings(cls, settings: Mapping[str, object], where: str) -> StepOptions:
        """The step a model file's ``settings`` ask the trainer for: ``grad_clip`` (None: no
        clipping), ``grad_clip_mode``, ``ema_decay`` and ``label_smoothing``, the trainer's
        defaults for those left out -- what ``TrainOptions`` makes of the same keys, so that a
        plan or an estimate of the file is of the step its training runs. A bad value is a
        ``ConfigError`` naming the key and ``where``."""
        def number(key: str, default: float | None) -> float | None:
            value = settings.get(key, default)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ConfigError(f"settings[{key!r}] in {where} must be a number, got {value!r}; "
                                  "write e.g. 0.1, or leave it out for the default")
            return float(value)

        threshold = number("grad_clip", 1.0)
        mode = settings.get("grad_clip_mode", "norm")
        if mode not in ("norm", "value", "off"):
            raise ConfigError(f"settings['grad_clip_mode'] in {where} must be 'norm', 'value' or 'off', got {mode!r}")
        try:
            return cls(clip="off" if threshold is None else mode,  # checked above
                       clip_threshold=threshold or 1.0, ema_decay=number("ema_decay", None),
                       label_smoothing=number("label_smoothing", 0.0) or 0.0)
        except ConfigError as exc:
            text = str(exc)
            for field, key in (("clip_threshold", "grad_clip"), ("ema_decay", "ema_decay"),
                               ("label_smoothing", "label_smoothing")):
                text = text.replace(f"StepOptions.{field}", f"settings[{key!r}] in {where}")
            raise ConfigError(text) from None

    def key(self) -> tuple[ClipMode, bool, bool, bool]:
        """What distinguishes two steps' memory (for caches): the threshold's value does not."""
        return (self.clip, self.ema_decay is not None, bool(self.label_smoothing), self.compile)

    def describe(self) -> str:
        parts = [f"clip by {self.clip}" if self.clip != "off" else "no clipping"]
        if self.ema_decay is not None:
            parts.append("EMA of the weights")
        if self.label_smoothing:
            parts.append("label smoothing")
        if self.compile:
            parts.append("torch.compile")
        return ", ".join(parts)
