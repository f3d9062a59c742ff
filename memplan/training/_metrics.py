"""What a run reports: ``metrics.jsonl`` (written in batches), the progress bar, the peak
memory, the largest batch and ``summary.json``. NVML readings and per-layer gradient norms are
:mod:`memplan.training._monitor`'s.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn

import torch

from estimators import format_size

from ._data import _Window
from ._window import _WindowOutcome

if TYPE_CHECKING:
    from tqdm.auto import tqdm

    from estimators import Task, TrainConfig

    from ._memory import PeakMemory
    from ._monitor import TrainingMonitor
    from ._options import TrainOptions
    from ._state import TrainState

__all__: list[str] = []


_LOG_WRITE_SECONDS = 1.0
"""Longest time a step's metrics line waits in memory before it is written (see ``Metrics.log``)."""


class Metrics:
    """The metrics log and the progress bar (rank 0's; the other ranks write to nowhere).

    Made before a resume (a checkpoint written meanwhile flushes a log not yet open: nothing),
    opened once the run knows whether it continues a log (:meth:`open`), closed at its end.
    """

    def __init__(self, path: Path, *, is_main: bool, progress: bool, total_steps: int, peak: PeakMemory,
                 monitor: TrainingMonitor) -> None:
        self.path, self.is_main, self.progress, self.total_steps = path, is_main, progress, total_steps
        self.peak, self.monitor = peak, monitor
        self._file: IO[str] | None = None
        self._bar: tqdm[NoReturn] | None = None
        self._pending: list[dict[str, Any]] = []
        self._written_at = time.monotonic()
        self.throughput: list[tuple[int, float]] = []
        """(samples, seconds) of every window this process ran."""
        self.largest_batch: dict[str, Any] | None = None
        """The largest micro-batch met (step, elements, shapes) and its step's peak."""

    def open(self, *, resumed: bool, step: int) -> None:
        """The log (appended to when resumed) and the progress bar (from ``step``)."""
        from tqdm.auto import tqdm

        self._file = open(self.path, "a" if resumed else "w") if self.is_main else open(os.devnull, "w")
        self._written_at = time.monotonic()
        # disable=None lets tqdm hide the bar when stderr is not a terminal (CI logs, files).
        self._bar = tqdm(total=self.total_steps, initial=step, unit="step", dynamic_ncols=True,
                         disable=None if self.progress and self.is_main else True)

    def close(self) -> None:
        """Close the bar, then write everything queued -- also when a signal, an error or a
        second Ctrl-C ends the run."""
        if self._bar is not None:
            self._bar.close()
        try:
            self.flush()
        finally:
            if self._file is not None:
                self._file.close()

    def log_step(self, step: int, window: _Window, outcome: _WindowOutcome, lr: float) -> None:
        """The step's line of ``metrics.jsonl`` and the progress bar's postfix."""
        self._note_largest_batch(step, outcome)
        samples_per_s = window.global_items / outcome.seconds if outcome.seconds > 0 else None
        self.throughput.append((window.global_items, outcome.seconds))
        record: dict[str, Any] = {
            "type": "step", "step": step, "epoch": window.epoch,
            "loss": outcome.loss,
            "lr": lr, "samples_per_s": samples_per_s, "grad_norm": outcome.grad_norm,
            "peak_memory_bytes": self.peak.run(), "skipped": outcome.nonfinite,
        }
        if outcome.scaler_skipped:
            record["scaler_skipped"] = True
        record.update(self.monitor.fields())  # NVML readings; per-layer gradient norms when taken
        self.log(record)
        bar = self._bar
        assert bar is not None
        bar.update(1)
        if not bar.disable:  # formatting a postfix nobody sees costs ~25 us a step
            postfix = {"loss": f"{outcome.loss:.4g}", "lr": f"{lr:.3g}"}
            if samples_per_s:
                postfix["samples/s"] = f"{samples_per_s:.1f}"
            if record["peak_memory_bytes"]:
                postfix["mem"] = format_size(record["peak_memory_bytes"])
            bar.set_postfix(postfix, refresh=False)

    def log(self, record: dict[str, Any]) -> None:
        """Queue a line of ``metrics.jsonl``. Step records are written in batches, at most
        ``_LOG_WRITE_SECONDS`` after they were logged; any other record (evaluation, resume, OOM
        recovery), every checkpoint and the end of the run -- normal, by a signal or by an
        error -- write everything queued at once. Serialising and flushing a line per step
        cost ~0.15 ms of a ~12 ms step (examples/digits.py) where a hand-written loop pays
        nothing; and the log on disk still holds every line up to the last checkpoint, which
        is all a resumed run continues from (it logs the later steps again)."""
        self._pending.append(record)
        if record["type"] != "step" or time.monotonic() - self._written_at >= _LOG_WRITE_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Write the queued metrics lines and flush them to the OS (before :meth:`open`: nothing)."""
        if self._file is None:
            return
        if self._pending:
            self._file.write("".join(json.dumps(_json_safe(r)) + "\n" for r in self._pending))
            self._pending.clear()
        self._file.flush()
        self._written_at = time.monotonic()

    @property
    def shown(self) -> bool:
        """The progress bar is on a terminal (rank 0, progress on, stderr a terminal)."""
        return self._bar is not None and not self._bar.disable

    def say(self, text: str, postfix: dict[str, Any] | None = None) -> None:
        """A line above the progress bar (and its postfix), when the bar is shown."""
        if self._bar is None or self._bar.disable:
            return
        self._bar.write(text)
        if postfix is not None:
            self._bar.set_postfix(postfix, refresh=False)

    def _note_largest_batch(self, step: int, outcome: _WindowOutcome) -> None:
        """Keep the largest micro-batch met so far (by tensor elements: padded items vary) and
        the peak of the step it was in, for the summary: how close the plan came."""
        if outcome.largest_batch is None:
            return
        elements, shapes = outcome.largest_batch
        if self.largest_batch is not None and elements <= self.largest_batch["elements"]:
            return
        self.largest_batch = {"step": step, "elements": elements, "shapes": shapes,
                              "peak_memory_bytes": self.peak.window()}
        self.log({"type": "largest_batch", **self.largest_batch})

    def samples_per_s(self) -> float | None:
        items = sum(n for n, _ in self.throughput)
        seconds = sum(s for _, s in self.throughput)
        return items / seconds if seconds > 0 else None


def run_summary(*, task: Task, config: TrainConfig, options: TrainOptions, device: torch.device, world_size: int,
                state: TrainState, total_steps: int, wall_s: float, interrupted: bool, stop_signal: str | None,
                resumed_from: int | None, recoveries: list[dict[str, Any]], peak: int | None,
                metrics: Metrics, files: Mapping[str, Path]) -> dict[str, Any]:
    """``summary.json``'s content; ``peak`` is the fullest device's, ``files`` the paths of
    ``model``, ``checkpoint`` and ``metrics``."""
    predicted = options.predicted_peak_bytes
    final_metrics: dict[str, float] = {}
    if state.last_train_loss is not None:
        final_metrics["train_loss"] = state.last_train_loss
    final_metrics.update(state.last_metrics)
    summary: dict[str, Any] = {
        "task": task.name,
        "config": config.to_dict(),
        "options": options.to_dict(),
        "device": str(device),
        "world_size": world_size,
        "torch": torch.__version__,
        "steps": state.step,
        "total_steps": total_steps,
        "epochs_completed": state.epoch,
        "samples_seen": state.samples_seen,
        "wall_s": wall_s,
        "samples_per_s": metrics.samples_per_s(),
        "interrupted": interrupted,
        "stop_signal": stop_signal,
        "stopped_early": state.stopped_early,
        "resumed_from_step": resumed_from,
        "recoveries": list(recoveries),
        "skipped_steps": state.skipped_steps,
        "scaler_skipped_steps": state.scaler_skipped_steps,
        "monitor": options.monitor,
        "best_metric": state.best_metric,
        "best_step": state.best_step,
        "final_metrics": final_metrics,
        "peak_memory_bytes": peak,
        "predicted_peak_bytes": predicted,
        "peak_over_predicted": peak / predicted if peak and predicted else None,
        "largest_batch": metrics.largest_batch,
        "model_path": str(files["model"]),
        "checkpoint_path": str(files["checkpoint"]),
        "metrics_path": str(files["metrics"]),
    }
    target = task.settings.get("target")
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

