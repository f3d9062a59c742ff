"""The run's progress, saved in every checkpoint (:class:`TrainState`), and what a run returns
(:class:`TrainResult`).

``TrainState`` holds the counters that a resumed run must continue from, as torchtitan's
``TrainState``: ``state_dict()`` writes them in the checkpoint's layout (``step``, ``epoch``,
``epoch_sample_offset`` at the top, the rest under ``best`` and ``counters``), which is the
layout checkpoints had before the counters were gathered here, so older checkpoints resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TrainState", "TrainResult"]


@dataclass
class TrainState:
    """Progress counters of a run (over all its resumed runs)."""

    step: int = 0
    """Optimizer-step windows done, skipped ones included."""
    epoch: int = 0
    """Epochs completed."""
    epoch_offset: int = 0
    """Samples of the current epoch already consumed (its permutation's offset)."""
    samples_seen: int = 0
    skipped_steps: int = 0
    """Windows skipped for a NaN/inf loss (or gradient norm without a GradScaler)."""
    scaler_skipped_steps: int = 0
    """fp16: steps the GradScaler skipped while calibrating its scale."""
    consecutive_nonfinite: int = 0
    best_metric: float | None = None
    best_step: int | None = None
    best_metrics: dict[str, float] = field(default_factory=dict)
    bad_evaluations: int = 0
    """Evaluations since the last significant gain (early stopping's patience)."""
    stop_reference: float | None = None
    """Early stopping's last significant value of the monitor."""
    stopped_early: bool = False
    last_metrics: dict[str, float] = field(default_factory=dict)
    last_eval_step: int | None = None
    last_train_loss: float | None = None

    def state_dict(self) -> dict[str, Any]:
        """The counters in the checkpoint's layout (merged into the checkpoint's top level)."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "epoch_sample_offset": self.epoch_offset,
            "best": {
                "metric": self.best_metric, "step": self.best_step, "metrics": self.best_metrics,
                "bad_evaluations": self.bad_evaluations, "stopped_early": self.stopped_early,
                "stop_reference": self.stop_reference,
            },
            "counters": {
                "samples_seen": self.samples_seen, "skipped_steps": self.skipped_steps,
                "scaler_skipped_steps": self.scaler_skipped_steps,
                "consecutive_nonfinite": self.consecutive_nonfinite,
                "last_train_loss": self.last_train_loss, "last_eval_step": self.last_eval_step,
                "last_metrics": self.last_metrics,
            },
        }

    def load_state_dict(self, ckpt: Mapping[str, Any]) -> None:
        """The counters from a checkpoint (``state_dict()``'s layout)."""
        self.step, self.epoch, self.epoch_offset = ckpt["step"], ckpt["epoch"], ckpt["epoch_sample_offset"]
        best, counters = ckpt["best"], ckpt["counters"]
        self.best_metric, self.best_step = best["metric"], best["step"]
        self.best_metrics, self.bad_evaluations = dict(best["metrics"]), best["bad_evaluations"]
        self.stopped_early = best["stopped_early"]
        self.stop_reference = best.get("stop_reference", best["metric"])
        self.samples_seen, self.skipped_steps = counters["samples_seen"], counters["skipped_steps"]
        self.scaler_skipped_steps = counters["scaler_skipped_steps"]
        self.consecutive_nonfinite = counters["consecutive_nonfinite"]
        self.last_train_loss, self.last_eval_step = counters["last_train_loss"], counters["last_eval_step"]
        self.last_metrics = dict(counters["last_metrics"])


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainResult:
    """What a finished (or interrupted) run did; ``summary`` is ``summary.json``'s content."""

    steps: int
    """Optimizer-step windows done, skipped ones included, over all resumed runs."""
    epochs_completed: int
    best_metric: float | None
    """Best value of ``TrainOptions.monitor``; ``None`` without validation data."""
    final_metrics: dict[str, float]
    """``train_loss`` of the last window plus the validation metrics of the written weights."""
    wall_s: float
    interrupted: bool
    """True when SIGINT/SIGTERM stopped the run; ``checkpoint.pt`` resumes it."""
    skipped_steps: int
    """Windows skipped because the loss was NaN/inf (GradScaler skips are in the summary)."""
    out_dir: Path
    summary: dict[str, Any] = field(default_factory=dict)

