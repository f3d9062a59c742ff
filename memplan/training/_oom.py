"""In-process out-of-memory recovery: catch, free, step down the ladder, replay the window.

With ``ladder=`` (e.g. ``Plan.ladder()``) an OOM in forward, backward, the optimizer step or
evaluation is caught by type (``is_oom_error``); outside the ``except`` block the step's
references are dropped, gradients freed, a half-applied optimizer step undone (from a host copy
taken before each of the first steps), ``gc.collect()`` and ``torch.cuda.empty_cache()`` run;
the trainer switches to the next rung (same global batch, less memory) and replays the window
from its start (same samples, same RNG state), so no micro-batch is counted twice or skipped.
When the ladder ends, ``TrainingError`` says what failed and where the last good checkpoint is.
Without a ladder an OOM propagates. A rank of a distributed run does not recover in-process:
it writes an :class:`OOMRecord` and leaves (:mod:`memplan.training._launch` relaunches all).

A part of :class:`~memplan.training.Trainer`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from estimators import ConfigError, TrainConfig, TrainingError, checkpoint_more, format_size, is_oom_error

from ._data import _EpochBatches, _seed_torch, _Window, _window_seed
from ._recovery import (
    DistributedOOM,
    OOMRecord,
    RecoveryEvent,
    free_memory,
    pick_rung,
    restore_buffers,
    restore_optimizer,
    snapshot_buffers,
)
from ._window import _WindowOutcome

if TYPE_CHECKING:
    from tqdm.auto import tqdm

    from estimators import BuiltModel, Task

    from ._options import TrainOptions
    from ._recovery import _Snapshot
    from ._state import TrainState

__all__: list[str] = []

log = logging.getLogger("memplan.trainer")

Batch = Any


class _SaveCheckpoint(Protocol):
    """The signature of ``_Checkpoints._save_checkpoint`` (keyword-only arguments, which
    ``Callable`` cannot say)."""

    def __call__(self, *, collective: bool = True, pending_evaluation: bool = False) -> None: ...


class _InProcessRecovery:
    """OOM recovery (reads ``ladder``, ``memory_guard``, ``recoveries``; calls the step)."""

    # Set by the Trainer and its other parts; annotations only (nothing at runtime), for the type checker.
    task: Task
    config: TrainConfig
    options: TrainOptions
    state: TrainState
    device: torch.device
    rank: int
    distributed: bool  # _RankAgreement's (read-only) property
    is_main: bool  # _RankAgreement's (read-only) property
    memory_guard: AbstractContextManager[Any] | None
    out_dir: Path
    checkpoint_path: Path
    last_checkpoint_step: int | None
    model: nn.Module
    forward_model: nn.Module
    _built: BuiltModel
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    sampler: _EpochBatches
    val_loader: DataLoader | None
    ladder: list[TrainConfig]
    _ladder_peaks: dict[TrainConfig, int]
    _tried: list[TrainConfig]
    recoveries: list[dict[str, Any]]
    _recovering: bool
    _decided: dict[str, Any] | None
    _phase: str
    _optimizer_undo: _Snapshot | None
    _peak_floor: int | None
    _bar: tqdm[NoReturn]
    _run_window: Callable[[_Window, Iterator[Batch], TrainConfig], _WindowOutcome]
    _collate_window: Callable[[_Window], Iterator[Batch]]
    _val_loader_for: Callable[[Dataset], DataLoader]
    _make_scaler: Callable[[str], torch.amp.GradScaler | None]
    evaluate: Callable[[], dict[str, float]]
    _window_peak: Callable[[], int | None]
    _peak_memory: Callable[[], int | None]
    _log: Callable[[dict[str, Any]], None]
    _save_checkpoint: _SaveCheckpoint

    def _set_phase(self, phase: str) -> None:
        """Name the part of the step that runs (for the recovery log and the guard's injector)."""
        self._phase = phase
        guard = self.memory_guard
        if guard is None:
            return
        for attr in ("phase", "phase_label"):  # MemoryGuard, OOMInjector
            if hasattr(type(guard), attr):
                setattr(guard, attr, phase)
                return

    def _run_window_recovering(self, window: _Window, batches: Iterator[Batch]) -> _WindowOutcome:
        """:meth:`_run_window`, stepping down the ladder and replaying the window from its start
        after an out-of-memory error (any phase), until it fits or the ladder ends."""
        if self.distributed:
            # Every rank draws its own dropout masks, and a relaunched replay draws the same ones.
            _seed_torch(_window_seed(self.options.seed, self.state.step, self.rank))
        if not self._recovering:
            self._reset_window_peak()  # so that the largest batch's step has its own peak
            return self._run_window(window, batches, self.config)
        # Undo state for a replay: the buffers that forward updates (BatchNorm's statistics and
        # its integer num_batches_tracked: all of them, in host memory, outside the traced step)
        # and the RNG that dropout draws from, so that a replay sees what the first try saw and
        # the failed try's forwards leave nothing in the model.
        saved_buffers = snapshot_buffers(self.model)
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        while True:
            message = None
            self._reset_window_peak()
            try:
                return self._run_window(window, batches, self.config)
            except Exception as exc:
                if not self._recovering or not is_oom_error(exc):
                    raise
                message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            # Outside the except block: the traceback and its frames (and their tensors) are gone.
            t0 = time.perf_counter()
            batches = iter(())  # drop the half-read micro-batches
            phase, peak = self._phase, self._window_peak()
            self._set_phase("recovery")
            undo, self._optimizer_undo = self._optimizer_undo, None
            self.optimizer.zero_grad(set_to_none=True)
            if undo is not None:  # the optimizer step may have been half applied
                restore_optimizer(self.model, self.optimizer, self.scaler, undo)
            intact = undo is not None or phase != "optimizer"  # else the step may be half applied
            del undo
            if saved_buffers is not None:
                restore_buffers(saved_buffers)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
            free_memory(self.device, optimizer=self.optimizer)  # gc.collect(), torch.cuda.empty_cache()
            if self.distributed:
                self._fail_distributed(step=self.state.step + 1, phase=phase, peak=peak, message=message, intact=intact)
            self._step_down(step=self.state.step + 1, phase=phase, peak=peak, message=message, t0=t0)
            window = window.recut(self.config.micro_batch_size)
            batches = self._collate_window(window)

    def _evaluate_recovering(self) -> dict[str, float]:
        while True:
            message = None
            self._reset_window_peak()
            try:
                return self.evaluate()
            except Exception as exc:
                if not self._recovering or not is_oom_error(exc):
                    raise
                message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            t0 = time.perf_counter()
            peak = self._window_peak()
            self._set_phase("recovery")
            free_memory(self.device, optimizer=self.optimizer)
            if self.distributed:
                # The window is done and counted: the state is consistent; evaluate again on resume.
                self._fail_distributed(step=self.state.step, phase="evaluation", peak=peak, message=message, intact=True)
            self._step_down(step=self.state.step, phase="evaluation", peak=peak, message=message, t0=t0)

    def _reset_window_peak(self) -> None:
        """Start the peak anew for this attempt (so that an OOM reports the peak of the step that
        failed); the run's peak so far is kept in ``_peak_floor`` for the summary."""
        peak = self._peak_memory()
        if peak is not None:
            self._peak_floor = max(self._peak_floor or 0, peak)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.memory_guard is not None and hasattr(self.memory_guard, "reset_peak"):
            self.memory_guard.reset_peak()

    def _budget(self) -> int | None:
        budget = getattr(self.memory_guard, "budget_bytes", None)
        return int(budget) if budget is not None else None

    def _step_down(self, *, step: int, phase: str, peak: int | None, message: str | None, t0: float) -> None:
        """Switch to the next rung of the ladder, or stop with a TrainingError when none is left."""
        old = self.config
        if not self.ladder:
            raise self._exhausted(step, phase, peak, message)
        new, skipped = pick_rung(self.ladder, self._ladder_peaks, self._budget())
        self._switch_config(new)
        self._tried.append(new)
        event = RecoveryEvent(
            step=step,
            phase=phase,
            from_config=old.to_dict(),
            to_config=new.to_dict(),
            peak_at_failure=peak,
            seconds=time.perf_counter() - t0,
            error=message or "",
            skipped=[c.to_dict() for c in skipped],
        )
        record = event.to_dict()
        self.recoveries.append(record)
        self._log({"type": "oom_recovery", **record})
        text = (
            f"out of memory at step {step} in {phase} with {old.describe()}"
            + (f" (peak {format_size(peak)})" if peak else "")
            + f"; replaying with {new.describe()}"
        )
        log.warning("%s", text)
        bar = getattr(self, "_bar", None)
        if bar is not None and not bar.disable:
            bar.write(text)
            bar.set_postfix(
                {"oom_recoveries": len(self.recoveries), "micro": new.micro_batch_size, "accum": new.grad_accum_steps},
                refresh=False,
            )

    def _switch_config(self, new: TrainConfig) -> None:
        """Apply ``new`` (same global batch) to the running model, scaler and loaders."""
        old = self.config
        if new.global_batch != old.global_batch:
            raise ConfigError(f"cannot switch from global batch {old.global_batch} to {new.global_batch}")
        if new.checkpoint_segments > old.checkpoint_segments or (
            new.checkpoint_policy == "full" and old.checkpoint_policy != "full"
        ):
            # Idempotent per block: blocks checkpointed already stay so (only ever stepping down);
            # a compiled forward is compiled again from the same wrapper as at setup.
            self.forward_model = checkpoint_more(
                self._built, self.task, new.checkpoint_segments, policy=new.checkpoint_policy
            ).forward_model
        if new.precision != old.precision:
            # fp16 needs a GradScaler (a fresh one calibrates its scale in a few steps); bf16 and
            # fp32 need none. Keep an existing one when both use it.
            self.scaler = self._make_scaler(new.precision)
        self.config = new
        self.sampler.micro = new.micro_batch_size
        if self.val_loader is not None and new.micro_batch_size != old.micro_batch_size:
            self.val_loader = self._val_loader_for(self.val_loader.dataset)

    def _exhausted(self, step: int, phase: str, peak: int | None, message: str | None) -> TrainingError:
        """The error that ends the run when the ladder is used up; writes a checkpoint of the
        consistent state (nothing of the failed window is applied) only when none exists yet."""
        c = self.config
        if not self.checkpoint_path.exists():
            try:
                self._save_checkpoint()
            except Exception as exc:  # noqa: BLE001 - the OOM is the error to report
                log.warning("could not write a checkpoint after the OOM: %s", exc)
        where = (
            f"the last good checkpoint is {self.checkpoint_path} (step {self.last_checkpoint_step})"
            if self.checkpoint_path.exists()
            else "no checkpoint could be written"
        )
        budget = self._budget()
        measured = f"measured peak at failure {format_size(peak)}" if peak is not None else "peak at failure unknown"
        if budget is not None:
            measured += f" of budget {format_size(budget)}"
        tried = "; ".join(t.describe() for t in self._tried)
        return TrainingError(
            f"ran out of memory at step {step} in {phase} with micro-batch {c.micro_batch_size}, "
            f"{c.grad_accum_steps} accumulation steps, {c.precision}, {c.checkpoint_segments} checkpoint segments"
            f" ({message}); no smaller configuration with the same global batch of {c.global_batch} is left "
            f"(tried: {tried}); {where}; {measured} -- raise --vram or reduce the model"
        )

    def _fail_distributed(
        self, *, step: int, phase: str, peak: int | None, message: str | None, intact: bool
    ) -> NoReturn:
        """An OOM on this rank of a distributed run: record it for the launcher, write a checkpoint
        of the window's start when this rank alone can (DDP, nothing of the window applied), and
        leave. Exiting closes this rank's connections, so the other ranks' collectives fail at
        once and they exit too -- without writing anything from the middle of a window."""
        written = False
        if intact and self.config.strategy == "ddp":
            try:
                self._save_checkpoint(collective=False, pending_evaluation=phase == "evaluation")
                written = True
            except Exception as exc:  # noqa: BLE001 - the OOM is what gets reported
                log.warning("rank %d could not write a checkpoint after the OOM: %s", self.rank, exc)
        record = OOMRecord(
            rank=self.rank,
            step=step,
            phase=phase,
            config=self.config.to_dict(),
            peak_at_failure=peak,
            budget=self._budget(),
            error=message or "",
            time=time.time(),
            resume_step=self.state.step if written else self.last_checkpoint_step,
            window_start_checkpoint=written,
        )
        record.write(self.out_dir)
        raise DistributedOOM(
            f"rank {self.rank} ran out of memory at step {step} in {phase} with {self.config.describe()}; "
            + (
                "a checkpoint of the window's start was written"
                if written
                else f"resuming from the last checkpoint (step {self.last_checkpoint_step})"
            )
        )

    def _log_decided_recovery(self) -> None:
        """A relaunch after an OOM: take over the launcher's record of the switch and log it."""
        if self._decided is None:
            return
        self.recoveries = [dict(r) for r in self._decided.get("recoveries", [])]
        self._tried = [TrainConfig.from_dict(dict(c)) for c in self._decided.get("tried", [])] or [self.config]
        if not self.recoveries:
            return
        event = self.recoveries[-1]
        failed_at = self._decided.get("failed_at")
        if failed_at is not None:  # from the OOM to the replay, the relaunch included
            event["seconds"] = time.time() - float(failed_at)
        self._log({"type": "oom_recovery", **event})
        if self.is_main:
            old, new = TrainConfig.from_dict(event["from"]), TrainConfig.from_dict(event["to"])
            text = (
                f"out of memory at step {event['step']} in {event['phase']} with {old.describe()}"
                + (f" (peak {format_size(event['peak_at_failure'])})" if event.get("peak_at_failure") else "")
                + f"; all ranks replay from step {self.state.step + 1} with {new.describe()}"
            )
            log.warning("%s", text)
            if not self._bar.disable:
                self._bar.write(text)
