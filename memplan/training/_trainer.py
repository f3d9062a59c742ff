"""The built-in trainer: runs one ``TrainConfig`` on one device -- or as one rank of a DDP/FSDP2
run (:mod:`memplan.training._launch` starts the ranks) -- exactly as the estimator predicted it.

Read :meth:`Trainer.run` top to bottom: set up (data, model, optimizer, schedule and the
parts), resume if asked, then :meth:`Trainer._train_loop` over *optimizer-step windows* --
``grad_accum_steps`` micro-batches and one optimizer step (:mod:`~memplan.training._window`) --
evaluating and checkpointing at window boundaries, and finish by writing the weights and a
summary. The parts are objects, each in its module (see :mod:`memplan.training`), each given
what it uses; the progress they share is the :class:`TrainState`, passed to them.

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
    checkpoint_more,
    default_loss,
    make_optimizer,
    recomputes_more,
    training_loss,
)

from ._checkpoint_io import out_of_space
from ._checkpoints import CheckpointManager
from ._data import TrainData, _seed_everything, _Window
from ._distributed import RankAgreement
from ._evaluation import Evaluator
from ._memory import PeakMemory, Phase
from ._metrics import Metrics, _write_json_atomic, run_summary
from ._monitor import TrainingMonitor
from ._oom import InProcessRecovery
from ._options import TrainOptions
from ._out_dir import run_holds
from ._precision import TrainPrecision
from ._recovery import Ladder
from ._schedules import ExternalSchedule, LRSchedule, make_schedule
from ._signals import StopSignals
from ._state import TrainResult, TrainState
from ._window import WindowStep, _WindowOutcome

__all__ = ["Trainer", "train"]

log = logging.getLogger("memplan.trainer")


class Trainer:
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

    The trainer holds the loop and its parts: ``data`` (:class:`TrainData`), ``window_step``
    (:class:`WindowStep`), ``recovery`` (:class:`InProcessRecovery` along ``ladder``),
    ``evaluator``, ``checkpoints`` (:class:`CheckpointManager`), ``metrics``, ``signals``,
    ``ranks`` (:class:`RankAgreement`) and ``precision``; the progress is ``state``.
    """

    def __init__(self, task: Task, config: TrainConfig, options: TrainOptions, *,
                 memory_guard: AbstractContextManager[Any] | None = None,
                 ladder: Sequence[Any] | None = None,
                 recovery_state: Mapping[str, Any] | None = None) -> None:
        self.rank, self.world_size = _ranks(config)
        _check_task(task, options)
        self.task, self.options = task, options
        self.memory_guard = memory_guard
        self.device = torch.device(options.device)
        self.out_dir = options.out_dir
        self.checkpoint_path = self.out_dir / "checkpoint.pt"
        self.best_path = self.out_dir / "best_model.pt"
        self.model_path = self.out_dir / "model.pt"
        self.metrics_path = options.metrics_path or self.out_dir / "metrics.jsonl"
        # The parts that need no model; the others are made by _setup, inside the guard.
        self.ranks = RankAgreement(self.rank, self.world_size, strategy=config.strategy, device=self.device,
                                   replicas=self.world_size // (config.tp * config.pp))
        self.signals = StopSignals()
        self.phase = Phase(memory_guard)
        self.peak = PeakMemory(self.device, memory_guard)
        # OOM recovery: the running configuration and the rungs still below it, in order.
        self.ladder = Ladder(config, ladder, recovery_state)

    @property
    def config(self) -> TrainConfig:
        """The configuration running now (an OOM recovery's rung after one)."""
        return self.ladder.config

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """The OOM recoveries' records."""
        return self.ladder.recoveries

    @property
    def step(self) -> int:
        """Optimizer steps done (``state.step``)."""
        return self.state.step

    def run(self) -> TrainResult:
        # Rank 0 holds the folder for the run (a launch's ranks leave it to their launcher):
        # two runs writing into one folder would interleave their logs and weights.
        with run_holds(self.out_dir, self.options, holder=self.ranks.is_main):
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
        try:
            return self._run_with_data(t0)
        finally:
            self.data.close()

    def _run_with_data(self, t0: float) -> TrainResult:
        guard = self.memory_guard if self.memory_guard is not None else contextlib.nullcontext()
        with guard, self.signals.caught():
            self.phase.set("setup")
            self._setup()
            resumed_from = self._resume() if self.options.resume else None
            self.metrics.open(resumed=resumed_from is not None, step=self.state.step)
            try:
                if resumed_from is not None:
                    self.metrics.log({"type": "resume", "step": self.state.step, "epoch": self.state.epoch})
                self.recovery.log_decided(self.state)
                if self._pending_evaluation:
                    self._evaluate()  # the evaluation an OOM interrupted before the relaunch
                interrupted = self._train_loop()
                if not interrupted and self.state.step > 0 and self.state.last_train_loss is None:
                    # Every optimizer step was skipped for a NaN/inf loss (fewer of them than the
                    # limit): the weights are untrained, which is no "done".
                    raise self._nonfinite_error()
                if not interrupted and self.data.val_loader is not None and self.state.last_eval_step != self.state.step:
                    self._evaluate()  # the run's last evaluation, unless the last window was just evaluated
                self.checkpoints.save(self.state)
                self.evaluator.write_result_weights(self.state)
            finally:
                self.metrics.close()  # also when a signal, an error or a second Ctrl-C ends the run
            wall_s = time.perf_counter() - t0
            summary = self._summary(wall_s, interrupted, resumed_from)
        if self.ranks.is_main:
            _write_json_atomic(self.out_dir / "summary.json", summary)
        if interrupted:
            log.warning("stopped by %s at step %d; checkpoint %s resumes it (resume=True)",
                        self.signals.received, self.state.step, self.checkpoint_path)
        return TrainResult(
            steps=self.state.step, epochs_completed=self.state.epoch, best_metric=self.state.best_metric,
            final_metrics=dict(summary["final_metrics"]), wall_s=wall_s, interrupted=interrupted,
            skipped_steps=self.state.skipped_steps, out_dir=self.out_dir, summary=summary,
        )

    def _train_loop(self) -> bool:
        """Windows until the run is done; True when a signal interrupted it."""
        state, opts = self.state, self.options
        windows = self.data.windows(state.epoch, state.epoch_offset)
        try:
            while state.step < self.total_steps and not state.stopped_early:
                window, batches = next(windows)
                recovered_before = len(self.ladder.recoveries)
                # forward, backward, optimizer step (replayed one rung down after an OOM)
                outcome = self.recovery.run_window(window, batches, state)
                del batches
                self._after_window(window, outcome)
                epoch_ended = state.epoch_offset == 0
                if _due(opts.eval_every, state.step, epoch_ended) and self.data.val_loader is not None:
                    self._evaluate()
                if _due(opts.checkpoint_every, state.step, epoch_ended) and state.consecutive_nonfinite == 0:
                    # Not during a NaN streak: the last checkpoint before it is the good one.
                    self.checkpoints.save(state)
                if len(self.ladder.recoveries) != recovered_before:
                    # An OOM recovery (in the step or the evaluation) changed the micro-batch: the
                    # windows ahead were cut for the old one; cut them anew from here.
                    windows.close()
                    windows = self.data.windows(state.epoch, state.epoch_offset)
                if self.ranks.any_stop(self.signals.received is not None):
                    if self.signals.received is None:
                        self.signals.received = "peer"  # another rank got the signal first
                    return True
        finally:
            windows.close()  # let go of the half-read epoch's DataLoader iterator
        return False

    def _after_window(self, window: _Window, outcome: _WindowOutcome) -> None:
        """Advance the position and counters, step the schedule and EMA, log the step."""
        state = self.state
        lr = self.schedule.get_last_lr()[0]  # the lr this step used
        state.step += 1
        state.samples_seen += window.global_items
        if window.end >= self.data.n_epoch:
            state.epoch, state.epoch_offset = state.epoch + 1, 0
        else:
            state.epoch_offset = window.end

        if outcome.nonfinite:
            state.skipped_steps += 1
            state.consecutive_nonfinite += 1
        else:
            state.consecutive_nonfinite = 0
            state.last_train_loss = outcome.loss
            # A step the GradScaler skipped still moves the schedule on (as Lightning does):
            # such skips happen while the scale calibrates and are not a training problem.
            self.schedule.step()  # (the step itself updated the EMA when it applied)
            if outcome.scaler_skipped:
                state.scaler_skipped_steps += 1

        self.metrics.log_step(state.step, window, outcome, lr)

        if state.consecutive_nonfinite >= self.options.max_nonfinite:
            raise self._nonfinite_error()

    def _evaluate(self) -> None:
        """Evaluate (stepping down the ladder after an OOM) and count it: best, early stopping."""
        metrics = self.recovery.evaluate(self.evaluator.evaluate, self.state)
        self.evaluator.track(self.state, metrics)

    def _setup_data(self) -> None:
        """Datasets and loaders, first and outside the memory guard (see :class:`TrainData`)."""
        # The ``tp * pp`` ranks of a replica (neighbours: rank // (tp * pp) is the replica) see one batch.
        model_ranks = self.config.tp * self.config.pp
        self.data = TrainData(self.task, self.config, self.options, device=self.device,
                              rank=self.rank // model_ranks, world_size=self.world_size // model_ranks)

    def _setup(self) -> None:
        """Model, optimizer, precision, EMA, schedule, the counters and the parts, inside the guard."""
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
        self.model = self._built.model
        if config.pp > 1 and task.shapes().varying:
            raise ConfigError(f"{task.name}'s items vary in shape, and a pipeline's stages run the shapes they were "
                              "cut at; pad the items to one shape to train with pp, or train without pp")
        if getattr(self._built.wrapped, "has_dropout", False) and self.data.val_loader is not None:
            # The stages are the forward exported in training mode: dropout stays on in them.
            raise ConfigError(f"{task.name} has dropout, which a pipeline's stages keep on in evaluation; set its "
                              "probability to 0 to train with pp, or train without pp")

        # After sharding: FSDP2 replaces the parameters by DTensors, which the optimizer must hold.
        # (Stepped in backward, one parameter at a time, with TrainConfig.optimizer_in_backward.)
        self.optimizer = make_optimizer(task, config, self.model, opts.step_options())
        lr = opts.lr if opts.lr is not None else task.settings.get("lr")
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = float(lr)
        self.precision = TrainPrecision(config.precision, self.device, sharded=config.shards_parameters,
                                        scaler_kwargs=opts.scaler_kwargs())
        self.ema = EMA(self.model, opts.ema_decay) if opts.ema_decay is not None else None

        self.total_steps = self._total_steps()
        self.schedule: LRSchedule = self._make_schedule()
        if self.schedule_needs_val and self.data.val_loader is None:
            raise ConfigError(
                f"the model file's ReduceLROnPlateau scheduler needs validation data; define val_data() in {task.name}"
            )

        self.state = TrainState()  # progress, saved in checkpoints
        self._pending_evaluation = False
        # Per-layer gradient norms every N steps and NVML readings (memplan.training._monitor); FSDP2's
        # gradients are shards, whose per-layer norms would each need a collective.
        monitor = TrainingMonitor(self.device, enabled=not config.shards_parameters and self.ranks.is_main)

        # The parts, each given what it uses.
        self.metrics = Metrics(self.metrics_path, is_main=self.ranks.is_main, progress=opts.progress,
                               total_steps=self.total_steps, peak=self.peak, monitor=monitor)
        self.window_step = WindowStep(
            model=self.model, forward_model=self._built.forward_model, wrapped=self._built.wrapped,
            optimizer=self.optimizer, precision=self.precision, ema=self.ema,
            loss_fn=training_loss(task, opts.label_smoothing), device=self.device, options=opts,
            sharded=config.shards_parameters, ranks=self.ranks, monitor=monitor, phase=self.phase,
            keep_undo=self.ladder.enabled)
        self.evaluator = Evaluator(
            task, model=self.model, forward_model=self._built.forward_model, ema=self.ema,
            val_loader=self.data.val_loader, precision=self.precision, sharded=config.shards_parameters, device=self.device,
            options=opts, schedule=self.schedule, ranks=self.ranks, metrics=self.metrics, phase=self.phase,
            best_path=self.best_path, model_path=self.model_path)
        self.checkpoints = CheckpointManager(
            self.out_dir, task=task, options=opts, n_train=self.data.n_train, model=self.model,
            optimizer=self.optimizer, schedule=self.schedule, ema=self.ema, precision=self.precision,
            ladder=self.ladder, ranks=self.ranks, metrics=self.metrics, phase=self.phase, best_path=self.best_path)
        self.recovery = InProcessRecovery(
            self.ladder, window_step=self.window_step, data=self.data, checkpoints=self.checkpoints,
            switch_config=self._switch_config, model=self.model, optimizer=self.optimizer, precision=self.precision,
            device=self.device, seed=opts.seed, ranks=self.ranks, peak=self.peak, phase=self.phase,
            metrics=self.metrics, out_dir=self.out_dir)

    def _total_steps(self) -> int:
        """Length of the run, in optimizer steps (windows)."""
        opts, task, config = self.options, self.task, self.config
        self.steps_per_epoch = math.ceil(self.data.n_epoch / config.global_batch)
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

    def _resume(self) -> int | None:
        """Continue from ``checkpoint.pt`` if there is one; returns its step (None: fresh start)."""
        ckpt = self.checkpoints.load(self.device)
        if ckpt is None:
            return None
        saved = TrainConfig.from_dict(ckpt["config"])
        resume_on = self.ladder.resume(ckpt.get("recovery") or {}, saved)
        if resume_on != self.config:
            # The run stepped down after an OOM: continue on the configuration that worked
            # (before the tensors are loaded: a switch to fp16 makes the GradScaler they fill).
            log.warning("resuming on %s, the configuration an OOM recovery switched to", resume_on.describe())
            self._switch_config(resume_on)
        self._pending_evaluation = bool(ckpt.get("pending_evaluation")) and self.data.val_loader is not None
        return self.checkpoints.restore(ckpt, self.state)

    def _switch_config(self, new: TrainConfig) -> None:
        """Apply ``new`` (same global batch) to the running parts: the step's forward, the
        precision, the data's micro-batches; it becomes ``config``."""
        old = self.config
        if new.global_batch != old.global_batch:
            raise ConfigError(f"cannot switch from global batch {old.global_batch} to {new.global_batch}")
        if new.checkpoint_segments > old.checkpoint_segments or recomputes_more(
            new.checkpoint_policy, old.checkpoint_policy
        ):
            # Idempotent per block: blocks checkpointed already stay so (only ever stepping down);
            # a compiled forward is compiled again from the same wrapper as at setup.
            forward_model = checkpoint_more(
                self._built, self.task, new.checkpoint_segments, policy=new.checkpoint_policy
            ).forward_model
            self.window_step.forward_model = self.evaluator.forward_model = forward_model
        self.precision.switch(new.precision)
        self.data.set_micro_batch_size(new.micro_batch_size)
        self.evaluator.val_loader = self.data.val_loader
        self.ladder.config = new

    def _summary(self, wall_s: float, interrupted: bool, resumed_from: int | None) -> dict[str, Any]:
        return run_summary(
            task=self.task, config=self.config, options=self.options, device=self.device, world_size=self.world_size,
            state=self.state, total_steps=self.total_steps, wall_s=wall_s, interrupted=interrupted,
            stop_signal=self.signals.received, resumed_from=resumed_from, recoveries=self.ladder.recoveries,
            peak=self.ranks.max_over_ranks(self.peak.run()),  # the fullest device's
            metrics=self.metrics,
            files={"model": self.model_path, "checkpoint": self.checkpoint_path, "metrics": self.metrics_path})

    def _nonfinite_error(self) -> TrainingError:
        last = self.checkpoints.last_step
        where = (
            f"the last good checkpoint is {self.checkpoint_path} (step {last})"
            if last is not None
            else "no checkpoint was written before it (set checkpoint_every to keep one)"
        )
        return TrainingError(
            f"loss was NaN/inf for {self.state.consecutive_nonfinite} consecutive steps at step {self.state.step}; "
            f"{self.precision.nonfinite_advice}; {where}"
        )


def _due(every: int | None, step: int, epoch_ended: bool) -> bool:
    return epoch_ended if every is None else step % every == 0


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
    if config.strategy != "single" or config.ranks > 1:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"{config.describe()} runs one process per device; launch it "
                f"with memplan train MODEL.py --plan plan.json --nproc {config.ranks} (or torchrun), "
                "or use TrainConfig(strategy='single', world_size=1, tp=1)"
            )
        if dist.get_world_size() != config.ranks:
            raise ConfigError(
                f"the configuration needs {config.ranks} processes but {dist.get_world_size()} were "
                f"launched; launch {config.ranks} (e.g. --nproc {config.ranks})"
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
