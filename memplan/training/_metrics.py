"""What a run reports: ``metrics.jsonl`` (written in batches), the progress bar, the peak
memory, the largest batch and ``summary.json``. NVML readings and per-layer gradient norms are
:mod:`memplan.training._monitor`'s. A part of :class:`~memplan.training.Trainer`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from estimators import format_size

from ._data import _Window
from ._window import _WindowOutcome

if TYPE_CHECKING:
    from tqdm.auto import tqdm

    from estimators import Task, TrainConfig

    from ._monitor import TrainingMonitor
    from ._options import TrainOptions
    from ._state import TrainState

__all__: list[str] = []


_LOG_WRITE_SECONDS = 1.0
"""Longest time a step's metrics line waits in memory before it is written (see ``Trainer._log``)."""


class _Metrics:
    """The metrics log, the progress bar and the summary (reads ``state``, ``options``)."""

    # Set by the Trainer and its other parts; annotations only (nothing at runtime), for the type checker.
    task: Task
    config: TrainConfig
    options: TrainOptions
    state: TrainState
    device: torch.device
    world_size: int
    is_main: bool  # _RankAgreement's (read-only) property
    memory_guard: AbstractContextManager[Any] | None
    metrics_path: Path
    model_path: Path
    checkpoint_path: Path
    total_steps: int
    recoveries: list[dict[str, Any]]
    largest_batch: dict[str, Any] | None
    _peak_floor: int | None
    _throughput: list[tuple[int, float]]
    _monitor: TrainingMonitor
    _stop_signal: str | None
    _bar: tqdm[NoReturn]
    _max_over_ranks: Callable[[int | None], int | None]

    def _open_log(self, resumed: bool) -> None:
        """Rank 0 alone writes the log (appended to when resumed); the others write to nowhere."""
        self._metrics_file = (open(self.metrics_path, "a" if resumed else "w")
                              if self.is_main else open(os.devnull, "w"))
        self._pending_log: list[dict[str, Any]] = []
        self._log_written_at = time.monotonic()

    def _log_step(self, window: _Window, outcome: _WindowOutcome, lr: float) -> None:
        """The step's line of ``metrics.jsonl`` and the progress bar's postfix."""
        self._note_largest_batch(outcome)
        samples_per_s = window.global_items / outcome.seconds if outcome.seconds > 0 else None
        self._throughput.append((window.global_items, outcome.seconds))
        record: dict[str, Any] = {
            "type": "step", "step": self.state.step, "epoch": window.epoch,
            "loss": outcome.loss,
            "lr": lr, "samples_per_s": samples_per_s, "grad_norm": outcome.grad_norm,
            "peak_memory_bytes": self._peak_memory(), "skipped": outcome.nonfinite,
        }
        if outcome.scaler_skipped:
            record["scaler_skipped"] = True
        record.update(self._gpu_stats())
        self._log(record)
        self._bar.update(1)
        if not self._bar.disable:  # formatting a postfix nobody sees costs ~25 us a step
            postfix = {"loss": f"{outcome.loss:.4g}", "lr": f"{lr:.3g}"}
            if samples_per_s:
                postfix["samples/s"] = f"{samples_per_s:.1f}"
            if record["peak_memory_bytes"]:
                postfix["mem"] = format_size(record["peak_memory_bytes"])
            self._bar.set_postfix(postfix, refresh=False)

    def _log(self, record: dict[str, Any]) -> None:
        """Queue a line of ``metrics.jsonl``. Step records are written in batches, at most
        ``_LOG_WRITE_SECONDS`` after they were logged; any other record (evaluation, resume, OOM
        recovery), every checkpoint and the end of the run -- normal, by a signal or by an
        error -- write everything queued at once. Serialising and flushing a line per step
        cost ~0.15 ms of a ~12 ms step (examples/digits.py) where a hand-written loop pays
        nothing; and the log on disk still holds every line up to the last checkpoint, which
        is all a resumed run continues from (it logs the later steps again)."""
        self._pending_log.append(record)
        if record["type"] != "step" or time.monotonic() - self._log_written_at >= _LOG_WRITE_SECONDS:
            self._flush_log()

    def _flush_log(self) -> None:
        """Write the queued metrics lines and flush them to the OS."""
        pending = getattr(self, "_pending_log", None)
        if pending is None:  # before run() opened the log
            return
        if pending:
            self._metrics_file.write("".join(json.dumps(_json_safe(r)) + "\n" for r in pending))
            pending.clear()
        self._metrics_file.flush()
        self._log_written_at = time.monotonic()

    def _progress_bar(self) -> tqdm[NoReturn]:
        from tqdm.auto import tqdm

        # disable=None lets tqdm hide the bar when stderr is not a terminal (CI logs, files).
        return tqdm(total=self.total_steps, initial=self.state.step, unit="step", dynamic_ncols=True,
                    disable=None if self.options.progress and self.is_main else True)

    def _note_largest_batch(self, outcome: _WindowOutcome) -> None:
        """Keep the largest micro-batch met so far (by tensor elements: padded items vary) and
        the peak of the step it was in, for the summary: how close the plan came."""
        if outcome.largest_batch is None:
            return
        elements, shapes = outcome.largest_batch
        if self.largest_batch is not None and elements <= self.largest_batch["elements"]:
            return
        self.largest_batch = {"step": self.state.step, "elements": elements, "shapes": shapes,
                              "peak_memory_bytes": self._window_peak()}
        self._log({"type": "largest_batch", **self.largest_batch})

    def _window_peak(self) -> int | None:
        """The peak since the window started (``_reset_window_peak``), without the run's floor."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        value = getattr(self.memory_guard, "peak_bytes", None)
        return int(value) if value is not None else None

    def _peak_memory(self) -> int | None:
        peak: int | None = None
        if self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self.memory_guard is not None:
            value = getattr(self.memory_guard, "peak_bytes", None)
            peak = int(value) if value is not None else None
        floor = getattr(self, "_peak_floor", None)  # the peak before OOM recovery last reset it
        if floor is not None:
            peak = max(peak or 0, floor)
        return peak

    def _gpu_stats(self) -> dict[str, Any]:
        """NVML readings on CUDA, and the per-layer gradient norms when this step took them."""
        return self._monitor.fields()

    def _summary(self, wall_s: float, interrupted: bool, resumed_from: int | None) -> dict[str, Any]:
        items = sum(n for n, _ in self._throughput)
        seconds = sum(s for _, s in self._throughput)
        peak = self._max_over_ranks(self._peak_memory())  # the fullest device's
        predicted = self.options.predicted_peak_bytes
        final_metrics: dict[str, float] = {}
        if self.state.last_train_loss is not None:
            final_metrics["train_loss"] = self.state.last_train_loss
        final_metrics.update(self.state.last_metrics)
        summary: dict[str, Any] = {
            "task": self.task.name,
            "config": self.config.to_dict(),
            "options": self.options.to_dict(),
            "device": str(self.device),
            "world_size": self.world_size,
            "torch": torch.__version__,
            "steps": self.state.step,
            "total_steps": self.total_steps,
            "epochs_completed": self.state.epoch,
            "samples_seen": self.state.samples_seen,
            "wall_s": wall_s,
            "samples_per_s": items / seconds if seconds > 0 else None,
            "interrupted": interrupted,
            "stop_signal": self._stop_signal,
            "stopped_early": self.state.stopped_early,
            "resumed_from_step": resumed_from,
            "recoveries": list(self.recoveries),
            "skipped_steps": self.state.skipped_steps,
            "scaler_skipped_steps": self.state.scaler_skipped_steps,
            "monitor": self.options.monitor,
            "best_metric": self.state.best_metric,
            "best_step": self.state.best_step,
            "final_metrics": final_metrics,
            "peak_memory_bytes": peak,
            "predicted_peak_bytes": predicted,
            "peak_over_predicted": peak / predicted if peak and predicted else None,
            "largest_batch": self.largest_batch,
            "model_path": str(self.model_path),
            "checkpoint_path": str(self.checkpoint_path),
            "metrics_path": str(self.metrics_path),
        }
        target = self.task.settings.get("target")
        if isinstance(target, Mapping) and target.get("metric") in final_metrics and "value" in target:
            value, goal = final_metrics[target["metric"]], float(target["value"])
            lower_better = "loss" in str(target["metric"])
            summary["target"] = {**dict(target), "reached": value <= goal if lower_better else value >= goal}
        return summary


def _json_safe(value: Any) -> Any:
    """NaN/inf as the strings "nan"/"inf" (JSON has no such numbers; strict readers reject them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (int, str)):
        return value  # before the Mapping check, an abstract-class check that is slow for scalars
    if isinstance(value, Mapping):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_json_safe(data), indent=2, default=str) + "\n")
    os.replace(tmp, path)

