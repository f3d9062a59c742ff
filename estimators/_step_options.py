"""The step's options besides forward, backward and the optimizer step: what the trainer's
options switch on that changes the step's memory or its ops (clipping, EMA, label smoothing).

A :class:`~estimators.Task` carries them (``Task.with_step``), so that the trace, the probes and
the trainer run the same step.
"""

from __future__ import annotations

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
