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

"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.nn as nn

from estimators import TrainConfig, TrainingError, format_size, is_oom_error

from ._data import _seed_torch, _Window, _window_seed
from ._recovery import (
    DistributedOOM,
    OOMRecord,
    RecoveryEvent,
    free_memory,
    restore_buffers,
    restore_optimizer,
    snapshot_buffers,
)
from ._window import _WindowOutcome

if TYPE_CHECKING:
    from ._checkpoints import CheckpointManager
    from ._data import TrainData
    from ._distributed import RankAgreement
    from ._memory import PeakMemory, Phase
    from ._metrics import Metrics
    from ._precision import TrainPrecision
    from ._recovery import Ladder
    from ._state import TrainState
    from ._window import WindowStep

__all__: list[str] = []

log = logging.getLogger("memplan.trainer")

Batch = Any


class InProcessRecovery:
    """Runs a window (:meth:`run_window`) or an evaluation (:meth:`evaluate`) and, after an OOM,
    steps down the ``ladder`` -- ``switch_config`` applies the rung to the running parts -- and
    tries again; a distributed rank records the OOM and leaves instead.

    It reads the optimizer's undo copy off ``window_step``, the window's micro-batches off
    ``data``, the peak off ``peak``; it writes the last checkpoint through ``checkpoints``
    and its records to ``metrics``.
    """

    def __init__(self, ladder: Ladder, *, window_step: WindowStep, data: TrainData, checkpoints: CheckpointManager,
                 switch_config: Callable[[TrainConfig], None], model: nn.Module, optimizer: torch.optim.Optimizer,
                 precision: TrainPrecision, device: torch.device, seed: int, ranks: RankAgreement,
                 peak: PeakMemory, phase: Phase, metrics: Metrics, out_dir: Path) -> None:
        self.ladder, self.window_step, self.data, self.checkpoints = ladder, window_step, data, checkpoints
        self.switch_config, self.model, self.optimizer, self.precision = switch_config, model, optimizer, precision
        self.device, self.seed, self.ranks, self.peak, self.phase = device, seed, ranks, peak, phase
        self.metrics, self.out_dir = metrics, out_dir

    def run_window(self, window: _Window, batches: Iterator[Batch], state: TrainState) -> _WindowOutcome:
        """The window's step (:meth:`WindowStep.run`), stepping down the ladder and replaying the
        window from its start after an out-of-memory error (any phase), until it fits or the
        ladder ends."""
        if self.ranks.distributed:
            # Every rank draws its own dropout masks, and a relaunched replay draws the same ones.
            _seed_torch(_window_seed(self.seed, state.step, self.ranks.rank))
        if not self.ladder.enabled:
            self.peak.reset_window()  # so that the largest batch's step has its own peak
            return self.window_step.run(window, batches, self.ladder.config, step=state.step + 1)
        # Undo state for a replay: the buffers that forward updates (BatchNorm's statistics and
        # its integer num_batches_tracked: all of them, in host memory, outside the traced step)
        # and the RNG that dropout draws from, so that a replay sees what the first try saw and
        # the failed try's forwards leave nothing in the model.
        saved_buffers = snapshot_buffers(self.model)
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        while True:
            message = None
            self.peak.reset_window()
            try:
                return self.window_step.run(window, batches, self.ladder.config, step=state.step + 1)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            # Outside the except block: the traceback and its frames (and their tensors) are gone.
            t0 = time.perf_counter()
            batches = iter(())  # drop the half-read micro-batches
            phase, peak = self.phase.name, self.peak.window()
            self.phase.set("recovery")
            undo, self.window_step.optimizer_undo = self.window_step.optimizer_undo, None
            self.optimizer.zero_grad(set_to_none=True)
            if undo is not None:  # the optimizer step may have been half applied
                restore_optimizer(self.model, self.optimizer, self.precision.scaler, undo)
            intact = undo is not None or phase != "optimizer"  # else the step may be half applied
            del undo
            if saved_buffers is not None:
                restore_buffers(saved_buffers)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
            free_memory(self.device, optimizer=self.optimizer)  # gc.collect(), torch.cuda.empty_cache()
            if self.ranks.distributed:
                self._fail_distributed(state, step=state.step + 1, phase=phase, peak=peak, message=message,
                                       intact=intact)
            self._step_down(state, step=state.step + 1, phase=phase, peak=peak, message=message, t0=t0)
            window = window.recut(self.ladder.config.micro_batch_size)
            batches = self.data.collate_window(window)

    def evaluate(self, evaluate: Callable[[], dict[str, float]], state: TrainState) -> dict[str, float]:
        """``evaluate()``, stepping down the ladder after an out-of-memory error until it fits."""
        while True:
            message = None
            self.peak.reset_window()
            try:
                return evaluate()
            except Exception as exc:
                if not self.ladder.enabled or not is_oom_error(exc):
                    raise
                message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            t0 = time.perf_counter()
            peak = self.peak.window()
            self.phase.set("recovery")
            free_memory(self.device, optimizer=self.optimizer)
            if self.ranks.distributed:
                # The window is done and counted: the state is consistent; evaluate again on resume.
                self._fail_distributed(state, step=state.step, phase="evaluation", peak=peak, message=message,
                                       intact=True)
            self._step_down(state, step=state.step, phase="evaluation", peak=peak, message=message, t0=t0)

    def _step_down(self, state: TrainState, *, step: int, phase: str, peak: int | None, message: str | None,
                   t0: float) -> None:
        """Switch to the next rung of the ladder, or stop with a TrainingError when none is left."""
        old = self.ladder.config
        if not self.ladder.rungs:
            raise self._exhausted(state, step, phase, peak, message)
        new, skipped = self.ladder.step_down(self.peak.budget())
        self.switch_config(new)
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
        self.ladder.recoveries.append(record)
        self.metrics.log({"type": "oom_recovery", **record})
        text = (
            f"out of memory at step {step} in {phase} with {old.describe()}"
            + (f" (peak {format_size(peak)})" if peak else "")
            + f"; replaying with {new.describe()}"
        )
        log.warning("%s", text)
        self.metrics.say(text, postfix={"oom_recoveries": len(self.ladder.recoveries), "micro": new.micro_batch_size,
                                        "accum": new.grad_accum_steps})

    def _exhausted(self, state: TrainState, step: int, phase: str, peak: int | None,
                   message: str | None) -> TrainingError:
        """The error that ends the run when the ladder is used up; writes a checkpoint of the
        consistent state (nothing of the failed window is applied) only when none exists yet."""
        c, path = self.ladder.config, self.checkpoints.path
        if not path.exists():
            try:
                self.checkpoints.save(state)
            except Exception as exc:  # noqa: BLE001 - the OOM is the error to report
                log.warning("could not write a checkpoint after the OOM: %s", exc)
        where = (
            f"the last good checkpoint is {path} (step {self.checkpoints.last_step})"
            if path.exists()
            else "no checkpoint could be written"
        )
        budget = self.peak.budget()
        measured = f"measured peak at failure {format_size(peak)}" if peak is not None else "peak at failure unknown"
        if budget is not None:
            measured += f" of budget {format_size(budget)}"
        tried = "; ".join(t.describe() for t in self.ladder.tried)
        return TrainingError(
            f"ran out of memory at step {step} in {phase} with micro-batch {c.micro_batch_size}, "
            f"{c.grad_accum_steps} accumulation steps, {c.precision}, {c.checkpoint_segments} checkpoint segments"
            f" ({message}); no smaller configuration with the same global batch of {c.global_batch} is left "
            f"(tried: {tried}); {where}; {measured} -- raise --vram or reduce the model"
        )

    def _fail_distributed(
        self, state: TrainState, *, step: int, phase: str, peak: int | None, message: str | None, intact: bool
    ) -> NoReturn:
        """An OOM on this rank of a distributed run: record it for the launcher, write a checkpoint
        of the window's start when this rank alone can (DDP, nothing of the window applied), and
        leave. Exiting closes this rank's connections, so the other ranks' collectives fail at
        once and they exit too -- without writing anything from the middle of a window."""
        config, rank = self.ladder.config, self.ranks.rank
        written = False
        if intact and config.strategy == "ddp":
            try:
                self.checkpoints.save(state, collective=False, pending_evaluation=phase == "evaluation")
                written = True
            except Exception as exc:  # noqa: BLE001 - the OOM is what gets reported
                log.warning("rank %d could not write a checkpoint after the OOM: %s", rank, exc)
        last = self.checkpoints.last_step
        record = OOMRecord(
            rank=rank,
            step=step,
            phase=phase,
            config=config.to_dict(),
            peak_at_failure=peak,
            budget=self.peak.budget(),
            error=message or "",
            time=time.time(),
            resume_step=state.step if written else last,
            window_start_checkpoint=written,
        )
        record.write(self.out_dir)
        raise DistributedOOM(
            f"rank {rank} ran out of memory at step {step} in {phase} with {config.describe()}; "
            + (
                "a checkpoint of the window's start was written"
                if written
                else f"resuming from the last checkpoint (step {last})"
            )
        )

    def log_decided(self, state: TrainState) -> None:
        """A relaunch after an OOM: take over the launcher's record of the switch and log it."""
        decided = self.ladder.decided
        if decided is None:
            return
        self.ladder.recoveries = [dict(r) for r in decided.get("recoveries", [])]
        self.ladder.tried = [TrainConfig.from_dict(dict(c)) for c in decided.get("tried", [])] or [self.ladder.config]
        if not self.ladder.recoveries:
            return
        event = self.ladder.recoveries[-1]
        failed_at = decided.get("failed_at")
        if failed_at is not None:  # from the OOM to the replay, the relaunch included
            event["seconds"] = time.time() - float(failed_at)
        self.metrics.log({"type": "oom_recovery", **event})
        if self.ranks.is_main:
            old, new = TrainConfig.from_dict(event["from"]), TrainConfig.from_dict(event["to"])
            text = (
                f"out of memory at step {event['step']} in {event['phase']} with {old.describe()}"
                + (f" (peak {format_size(event['peak_at_failure'])})" if event.get("peak_at_failure") else "")
                + f"; all ranks replay from step {state.step + 1} with {new.describe()}"
            )
            log.warning("%s", text)
            self.metrics.say(text)
