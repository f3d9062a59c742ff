"""The built-in trainer: runs one ``TrainConfig`` on one device -- or as one rank of a DDP/FSDP2
run (:mod:`memplan.training._launch` starts the ranks) -- exactly as the estimator predicted it.

Read :meth:`Trainer.run` top to bottom: set up (model, optimizer, schedule, data), resume if
asked, then loop over *optimizer-step windows* -- ``grad_accum_steps`` micro-batches and one
optimizer step (:mod:`~memplan.training._window`) -- evaluating and checkpointing at window
boundaries, and finish by writing the weights and a summary. The other parts of the trainer
each live in their module (see :mod:`memplan.training`); this one holds the loop.

Example:
    >>> from estimators import TrainConfig, load_task        # doctest: +SKIP
    >>> task = load_task("examples/digits.py")                # doctest: +SKIP
    >>> result = train(task, TrainConfig(micro_batch_size=32, grad_accum_steps=2),
    ...                TrainOptions(epochs=5, out_dir="runs/digits"))   # doctest: +SKIP
    >>> result.final_metrics["val_accuracy"] > 0.95          # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from estimators import (
    EMA,
    ConfigError,
    ModelFileError,
    Task,
    TrainConfig,
    TrainingError,
    build_for_training,
    default_loss,
    make_optimizer,
    training_loss,
)

from ._checkpoint_io import out_of_space
from ._checkpoints import _Checkpoints
from ._data import _Loaders, _seed_everything, _Window
from ._distributed import _RankAgreement
from ._evaluation import _Evaluation
from ._metrics import _Metrics, _write_json_atomic
from ._monitor import TrainingMonitor
from ._oom import _InProcessRecovery
from ._options import TrainOptions
from ._out_dir import check_out_dir, claim_out_dir
from ._recovery import _Snapshot, ladder_configs, ladder_peaks
from ._schedules import ExternalSchedule, LRSchedule, make_schedule
from ._signals import _Signals
from ._state import TrainResult, TrainState
from ._window import _Step, _WindowOutcome

__all__ = ["Trainer", "train"]

log = logging.getLogger("memplan.trainer")


class Trainer(_Loaders, _Step, _InProcessRecovery, _Evaluation, _Checkpoints, _Metrics, _Signals,
              _RankAgreement):
    """Trainer for one :class:`TrainConfig`: one device, or one rank of a DDP/FSDP2 run.

    After :meth:`run`, ``self.model`` holds the written weights (best or final, EMA if on).
    ``memory_guard`` is entered around the run (model, optimizer, every step; not the dataset), so that a
    CPU memory budget covers what the estimate covers; its ``peak_bytes`` attribute, if it has
    one, is reported as the measured peak.

    ``strategy="ddp"``/``"fsdp"`` need the default process group to be initialised with
    ``config.world_size`` ranks (``memplan train --nproc N`` does it, see :mod:`memplan.training._launch`).
    Each rank trains its share of every window; rank 0 alone writes the log, the progress bar,
    the summary and the weights. An OOM on any rank is not recovered in-process (the other ranks
    are blocked in, or heading for, a collective): the rank writes an OOM record -- and, under
    DDP, a checkpoint of the window's start -- to ``out_dir`` and raises
    :class:`DistributedOOM`; the launcher chooses the next rung and starts every rank again.
    ``recovery_state`` is how it hands its decision over (``{"recoveries": [...], "tried":
    [...]}``): the run keeps ``config`` instead of switching back to the checkpoint's.

    The class holds the loop; its bases are its parts, one module each (data, the step, OOM
    recovery, evaluation, checkpoints, metrics, signals, rank agreement), sharing its
    attributes; the progress counters are ``self.state`` (:class:`TrainState`).
    """

    def __init__(self, task: Task, config: TrainConfig, options: TrainOptions, *,
                 memory_guard: AbstractContextManager[Any] | None = None,
                 ladder: Sequence[Any] | None = None,
                 recovery_state: Mapping[str, Any] | None = None) -> None:
        self.rank, self.world_size = _ranks(config)
        _check_task(task, options)
        self.task, self.config, self.options = task, config, options
        self.memory_guard = memory_guard
        self.device = torch.device(options.device)
        self.out_dir = options.out_dir
        self.checkpoint_path = self.out_dir / "checkpoint.pt"
        self.best_path = self.out_dir / "best_model.pt"
        self.model_path = self.out_dir / "model.pt"
        self.metrics_path = options.metrics_path or self.out_dir / "metrics.jsonl"
        self._stop_signal = None
        # OOM recovery: the rungs still below the running configuration, in order.
        self.ladder: list[TrainConfig] = ladder_configs(ladder, config)
        self._ladder_peaks = ladder_peaks(ladder)
        self._recovering = ladder is not None  # without a ladder an OOM propagates
        self._optimizer_undo: _Snapshot | None = None
        self._peak_floor: int | None = None
        self.largest_batch: dict[str, Any] | None = None
        """The largest micro-batch met (step, elements, shapes) and its step's peak."""
        self.recoveries: list[dict[str, Any]] = []
        self._tried: list[TrainConfig] = [config]
        self._phase = "setup"
        self._decided = dict(recovery_state) if recovery_state is not None else None

    @property
    def step(self) -> int:
        """Optimizer steps done (``state.step``)."""
        return self.state.step

    def run(self) -> TrainResult:
        # Rank 0 holds the folder for the run (a launch's ranks leave it to their launcher):
        # two runs writing into one folder would interleave their logs and weights.
        with claim_out_dir(self.out_dir, "out_dir") if self.is_main else contextlib.nullcontext():
            if self.is_main and not self.options.resume:
                check_out_dir(self.out_dir, resume=False, overwrite=self.options.overwrite,
                              flags=("resume=True", "overwrite=True"))
            try:
                return self._run()
            except OSError as exc:
                # A full disk under the log or the summary: one line that says so (the
                # checkpoints' own writes say it themselves).
                full = out_of_space(exc, exc.filename or self.metrics_path)
                if full is None:
                    raise
                raise full from None

    def _run(self) -> TrainResult:
        t0 = time.perf_counter()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._setup_data()
        guard = self.memory_guard if self.memory_guard is not None else contextlib.nullcontext()
        with guard, self._stop_on_signals():
            self._set_phase("setup")
            self._setup()
            resumed_from = self._resume() if self.options.resume else None
            self._open_log(resumed=resumed_from is not None)
            self._bar = self._progress_bar()
            try:
                if resumed_from is not None:
                    self._log({"type": "resume", "step": self.state.step, "epoch": self.state.epoch})
                self._log_decided_recovery()
                if self._pending_evaluation:
                    self._evaluate_and_track()  # the evaluation an OOM interrupted before the relaunch
                interrupted = self._train_loop()
                if not interrupted and self.state.step > 0 and self.state.last_train_loss is None:
                    # Every optimizer step was skipped for a NaN/inf loss (fewer of them than the
                    # limit): the weights are untrained, which is no "done".
                    raise self._nonfinite_error()
                if not interrupted:
                    self._finish_evaluation()
                self._save_checkpoint()
                self._write_result_weights()
            finally:
                self._bar.close()
                try:
                    self._flush_log()  # also when a signal, an error or a second Ctrl-C ends the run
                finally:
                    self._metrics_file.close()
            wall_s = time.perf_counter() - t0
            summary = self._summary(wall_s, interrupted, resumed_from)
        if self.is_main:
            _write_json_atomic(self.out_dir / "summary.json", summary)
        if interrupted:
            log.warning("stopped by %s at step %d; checkpoint %s resumes it (resume=True)",
                        self._stop_signal, self.state.step, self.checkpoint_path)
        return TrainResult(
            steps=self.state.step, epochs_completed=self.state.epoch, best_metric=self.state.best_metric,
            final_metrics=dict(summary["final_metrics"]), wall_s=wall_s, interrupted=interrupted,
            skipped_steps=self.state.skipped_steps, out_dir=self.out_dir, summary=summary,
        )

    def _train_loop(self) -> bool:
        """Windows until the run is done; True when a signal interrupted it."""
        windows = self._windows()
        try:
            while self.state.step < self.total_steps and not self.state.stopped_early:
                window, batches = next(windows)
                recovered_before = len(self.recoveries)
                outcome = self._run_window_recovering(window, batches)
                del batches
                self._after_window(window, outcome)
                epoch_ended = self.state.epoch_offset == 0
                if self._due(self.options.eval_every, epoch_ended) and self.val_loader is not None:
                    self._evaluate_and_track()
                if self._due(self.options.checkpoint_every, epoch_ended) and self.state.consecutive_nonfinite == 0:
                    # Not during a NaN streak: the last checkpoint before it is the good one.
                    self._save_checkpoint()
                if len(self.recoveries) != recovered_before:
                    # An OOM recovery (in the step or the evaluation) changed the micro-batch: the
                    # windows ahead were cut for the old one; cut them anew from here.
                    windows.close()
                    windows = self._windows()
                if self._agree_stop():
                    if self._stop_signal is None:
                        self._stop_signal = "peer"  # another rank got the signal first
                    return True
        finally:
            windows.close()  # let go of the half-read epoch's DataLoader iterator
        return False

    def _setup(self) -> None:
        """Model, optimizer, precision, EMA, schedule and the counters, inside the guard."""
        opts, task, config = self.options, self.task, self.config
        # Seed everything the model's initialisation and dropout draw from; the data order has
        # its own generators and does not depend on this state.
        _seed_everything(opts.seed)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the summary's peak is this run's
        # Built as the estimate's trace builds it (estimators.build_for_training): moved,
        # checkpointed, then DDP/FSDP2, then compiled. ``self.model`` stays the user's module
        # (FSDP2 shards it in place; DDP wraps it): state dicts, evaluation and EMA use it;
        # ``forward_model`` is what the training step calls.
        device_ids = [self.device.index] if self.device.type == "cuda" and self.device.index is not None else None
        self._built = build_for_training(task, config, self.device, compile=opts.compile, device_ids=device_ids)
        self.model, self._wrapped, self.forward_model = self._built.model, self._built.wrapped, self._built.forward_model

        # After sharding: FSDP2 replaces the parameters by DTensors, which the optimizer must hold.
        # (Stepped in backward, one parameter at a time, with TrainConfig.optimizer_in_backward.)
        self.optimizer = make_optimizer(task, config, self.model, opts.step_options())
        lr = opts.lr if opts.lr is not None else task.settings.get("lr")
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = float(lr)
        self.scaler = self._make_scaler(config.precision)
        self.ema = EMA(self.model, opts.ema_decay) if opts.ema_decay is not None else None
        self._loss_fn = training_loss(task, opts.label_smoothing)

        self.total_steps = self._total_steps()
        self.schedule: LRSchedule = self._make_schedule()
        if self.schedule_needs_val and self.val_loader is None:
            raise ConfigError(
                f"the model file's ReduceLROnPlateau scheduler needs validation data; define val_data() in {task.name}"
            )

        self.state = TrainState()  # progress, saved in checkpoints
        self.last_checkpoint_step: int | None = None
        self._last_dcp: str | None = None  # the sharded folder the last checkpoint.pt names
        self._pending_evaluation = False
        # This process only.
        self._throughput: list[tuple[int, float]] = []
        # Per-layer gradient norms every N steps and NVML readings (memplan.training._monitor); FSDP2's
        # gradients are shards, whose per-layer norms would each need a collective.
        self._monitor = TrainingMonitor(self.device, enabled=self.config.strategy != "fsdp" and self.is_main)

    def _total_steps(self) -> int:
        """Length of the run, in optimizer steps (windows)."""
        opts, task, config = self.options, self.task, self.config
        self.steps_per_epoch = math.ceil(self.sampler.n_epoch / config.global_batch)
        # One rule for the length, whoever trains (fit, memplan train, memplan.train): the options',
        # else the model file's settings', else the default epochs.
        epochs, max_steps = opts.training_length(task.settings)
        candidates = [int(epochs) * self.steps_per_epoch] if epochs else []
        candidates += [int(max_steps)] if max_steps else []
        return min(candidates)

    def _make_schedule(self) -> LRSchedule:
        """The model file's ``scheduler()`` when it has one and no schedule is named, else the
        named built-in one (``cosine`` by default) with its warm-up."""
        opts, task = self.options, self.task
        self.schedule_needs_val = False
        if opts.schedule is None and task.build_scheduler is not None:
            try:
                made = task.build_scheduler(self.optimizer, self.total_steps)
            except Exception as exc:  # noqa: BLE001 - the user's code, reported with the fix
                raise ModelFileError(
                    f"{task.name}: scheduler(optimizer, total_steps) raised "
                    f"{type(exc).__name__}: {exc}; fix scheduler()"
                ) from None
            schedule = ExternalSchedule(made, self.optimizer, name=task.name)
            self.schedule_needs_val = schedule.on_metric
            return schedule
        warmup = opts.warmup_steps if opts.warmup_steps is not None else int(task.settings.get("warmup_steps") or 0)
        name = opts.schedule or "cosine"
        if name == "onecycle" and opts.pct_start is not None and opts.warmup_steps is None:
            warmup = 0  # pct_start sets the rise; the model file's default warm-up gives way to it
        schedule_args = opts.schedule_kwargs()
        if name == "plateau":
            schedule_args.setdefault("mode", opts.mode)
        return make_schedule(name, self.optimizer, warmup_steps=warmup, total_steps=self.total_steps, **schedule_args)

    def _after_window(self, window: _Window, outcome: _WindowOutcome) -> None:
        """Advance the position and counters, step the schedule and EMA, log the step."""
        lr = self.schedule.get_last_lr()[0]  # the lr this step used
        self.state.step += 1
        self.state.samples_seen += window.global_items
        if window.end >= self.sampler.n_epoch:
            self.state.epoch, self.state.epoch_offset = self.state.epoch + 1, 0
        else:
            self.state.epoch_offset = window.end

        if outcome.nonfinite:
            self.state.skipped_steps += 1
            self.state.consecutive_nonfinite += 1
        else:
            self.state.consecutive_nonfinite = 0
            self.state.last_train_loss = outcome.loss
            # A step the GradScaler skipped still moves the schedule on (as Lightning does):
            # such skips happen while the scale calibrates and are not a training problem.
            self.schedule.step()  # (the step itself updated the EMA when it applied)
            if outcome.scaler_skipped:
                self.state.scaler_skipped_steps += 1

        self._log_step(window, outcome, lr)

        if self.state.consecutive_nonfinite >= self.options.max_nonfinite:
            raise self._nonfinite_error()

    def _nonfinite_error(self) -> TrainingError:
        where = (
            f"the last good checkpoint is {self.checkpoint_path} (step {self.last_checkpoint_step})"
            if self.last_checkpoint_step is not None
            else "no checkpoint was written before it (set checkpoint_every to keep one)"
        )
        # fp16's narrow range overflows where bf16 and fp32 do not; a run already in bf16 or
        # fp32 has a NaN of its own making (the model, the data or the learning rate).
        fix = {
            "fp16-mixed": "lower the learning rate or use bf16-mixed/fp32 instead of fp16",
            "bf16-mixed": "lower the learning rate, or try fp32",
            "bf16-true": "lower the learning rate, or try bf16-mixed (fp32 weights)",
            "fp16-true": "use bf16-true or bf16-mixed: fp16 weights without a GradScaler overflow",
        }.get(self.config.precision, "lower the learning rate, and check the model's outputs and the data for NaN/inf")
        return TrainingError(
            f"loss was NaN/inf for {self.state.consecutive_nonfinite} consecutive steps at step {self.state.step}; {fix}; {where}"
        )

    def _due(self, every: int | None, epoch_ended: bool) -> bool:
        return epoch_ended if every is None else self.state.step % every == 0


def train(
    task: Task,
    config: TrainConfig,
    options: TrainOptions | None = None,
    *,
    memory_guard: AbstractContextManager[Any] | None = None,
    ladder: Sequence[Any] | None = None,
) -> TrainResult:
    """Train ``task`` with ``config``; see :class:`Trainer`.

    ``ladder``: configurations to step down to after an out-of-memory error (``Plan.ladder()``'s
    entries or ``TrainConfig``s; only those with ``config``'s global batch are used). Without
    one, an OOM propagates.

    Example:
        >>> result = train(task, TrainConfig(micro_batch_size=8), TrainOptions(epochs=1))  # doctest: +SKIP
    """
    return Trainer(task, config, options or TrainOptions(), memory_guard=memory_guard, ladder=ladder).run()


def _ranks(config: TrainConfig) -> tuple[int, int]:
    """(rank, world size): one process, or the launched process group that the strategy needs."""
    if config.strategy != "single":
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"strategy {config.strategy!r} x{config.world_size} runs one process per device; launch it "
                f"with memplan train MODEL.py --plan plan.json --nproc {config.world_size} (or torchrun), "
                "or use TrainConfig(strategy='single', world_size=1)"
            )
        if dist.get_world_size() != config.world_size:
            raise ConfigError(
                f"the configuration needs {config.world_size} processes but {dist.get_world_size()} were "
                f"launched; launch {config.world_size} (e.g. --nproc {config.world_size})"
            )
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_task(task: Task, options: TrainOptions) -> None:
    """What the options need of the model file (one-line errors, before any data is loaded)."""
    if task.train_data is None:
        raise ModelFileError(f"{task.name}: define train_data() to train")
    if options.label_smoothing and task.loss_fn is not default_loss:
        raise ConfigError(
            f"label_smoothing applies only to the default loss, and {task.name} defines its own "
            "loss(); pass it there instead: F.cross_entropy(logits, targets, label_smoothing=0.1)"
        )
    needs_val = [
        name
        for name, on in (
            ("schedule='plateau'", options.schedule == "plateau"),
            ("early_stopping_patience", options.early_stopping_patience is not None),
        )
        if on
    ]
    if needs_val and task.val_data is None:
        raise ConfigError(f"{', '.join(needs_val)} needs validation data; define val_data() in {task.name}")
    if options.schedule is None and task.build_scheduler is not None:
        # Checked before any data is loaded: the model file's scheduler() owns the lr.
        given = options.set_schedule_fields() + (["warmup_steps"] if options.warmup_steps else [])
        if given or task.settings.get("warmup_steps"):
            what = ", ".join(f"TrainOptions.{n}" for n in given) or 'settings["warmup_steps"]'
            raise ConfigError(
                f"{what} shapes a built-in schedule, but {task.name} defines scheduler(), which owns the lr; "
                "drop it (put a warm-up into scheduler()), or name a built-in schedule to use instead"
            )
    if torch.device(options.device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for but torch sees no CUDA GPU; use device='cpu'")
