"""The built-in trainer: runs one ``TrainConfig`` on one device -- or as one rank of a DDP/FSDP2
run (:mod:`memplan._launch` starts the ranks) -- exactly as the estimator predicted it.

Read :meth:`Trainer.run` top to bottom: set up (model, optimizer, schedule, data), resume if
asked, then loop over *optimizer-step windows* — ``grad_accum_steps`` micro-batches and one
optimizer step — evaluating and checkpointing at window boundaries, and finish by writing the
weights and a summary. Everything the estimator models is applied through the same helpers it
traces with (``estimators.runtime._precision``, ``estimators.runtime._checkpoint``), so the memory that was
predicted is the memory that is used:

* forward and loss under ``forward_context`` (autocast for bf16/fp16), backward through
  ``_precision.backward`` (scaled under fp16), ``_precision.optimizer_step`` (GradScaler step
  and update under fp16), ``zero_grad(set_to_none=True)`` after the step;
* each micro-batch's batch and loss are dropped right after its backward;
* activation checkpointing via ``apply_checkpointing(model, segments, task.checkpoint_blocks)``.

What runs beyond the predicted step, and costs memory the estimate does not include: the EMA
copy of the weights (``ema_decay``), a second copy of the evaluated weights while EMA weights
are swapped in for evaluation, gradient clipping's temporaries (one 0-d tensor per gradient,
freed before the optimizer step: no change of the measured peak in
``benchmarks/results/technique_memory.md``), ``torch.compile``, and the DataLoader's workers and
pinned buffers (host memory). The GradScaler's parameters, the schedules, ``drop_last`` and
early stopping change no memory.

Data order is a pure function of ``(seed, epoch)``: each epoch is a permutation drawn from a
generator seeded with both, cut into micro-batches, grouped into windows of
``micro_batch_size * grad_accum_steps`` samples. A run therefore resumes at any window boundary
by recomputing the permutation and starting at the saved sample offset — even with another
micro-batch size, as long as the global batch is the same (what OOM recovery will need);
``drop_last`` ends each epoch at its last whole window instead of a short one. The
permutation is ``DistributedSampler``'s; with ``W`` ranks the last ``n % W`` items are dropped and
rank ``r`` trains positions ``r::W`` of each window, so a distributed run's step is the same
samples as a single-process step with the same global batch (and matches it to fp32 rounding).

What a run writes to ``out_dir``:

``checkpoint.pt``   everything to resume exactly (weights, optimizer, schedule, GradScaler, EMA,
                    RNG states, data position, counters, config, options); written atomically at
                    ``checkpoint_every``, at the end and on SIGINT/SIGTERM, never during a run of
                    NaN losses and never with non-finite weights.
``best_model.pt``   the best evaluated weights so far (only with validation data).
``model.pt``        the result: best weights with early stopping, else the final ones (EMA's if on).
``metrics.jsonl``   one JSON object a line: ``{"type": "step", "step", "epoch", "loss", "lr",
                    "samples_per_s", "grad_norm", "peak_memory_bytes", "skipped"[, "scaler_skipped",
                    "gpu_util_percent", "gpu_memory_used_bytes", "gpu_power_watts", "gpu_temperature_c",
                    "layer_grad_norms"]}`` per optimizer step (NVML on CUDA; per-layer gradient norms,
                    before clipping, at step 1 and every 50th: ``memplan._monitor``),
                    ``{"type": "eval", "step", "epoch", "val_loss"[, "val_accuracy"], "best",
                    "improved"}`` per evaluation, ``{"type": "oom_recovery", "event": "oom_recovery",
                    "step", "phase", "from", "to", "peak_at_failure", "seconds", "error"}`` per switch
                    to a smaller configuration, ``{"type": "resume", ...}`` when resumed
                    (appended to; lines logged after the last checkpoint of a crashed run repeat).
                    NaN/inf are written as the strings ``"nan"``/``"inf"``. Step lines are written
                    in batches, at most a second late; everything is on disk at each checkpoint and
                    when the run ends (also by a signal or an error).
``checkpoint-dcp/``  FSDP2 runs only: the sharded tensors of the checkpoint (``torch.distributed.checkpoint``).
``oom-rank<R>.json`` / ``failure-rank<R>.json``   distributed runs only: what a failed rank leaves for the launcher.
``summary.json``    wall time, steps, best and final metrics, measured vs predicted peak memory,
                    the OOM ``recoveries``.

Out-of-memory recovery (with ``ladder=``, e.g. ``Plan.ladder()``): an OOM in forward, backward,
the optimizer step or evaluation is caught by type (``is_oom_error``); outside the ``except``
block the step's references are dropped, gradients freed, a half-applied optimizer step undone
(from a host copy taken before each step), ``gc.collect()`` and ``torch.cuda.empty_cache()`` run;
the trainer switches to the next rung (same global batch, less memory: smaller micro-batch and
more accumulation, more checkpoint segments, lower precision) and replays the window from its
start (same samples, same RNG state), so no micro-batch is counted twice or skipped. The
checkpoint stores the configuration that worked, and a resumed run continues on it. When the
ladder ends, ``TrainingError`` says what failed and where the last good checkpoint is. Without a
ladder an OOM propagates.

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
import copy
import itertools
import json
import logging
import math
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Literal, Mapping, NoReturn, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.data import DataLoader, Dataset, TensorDataset

from estimators import ConfigError, ModelFileError, Task, TrainConfig, TrainingError, format_size
from estimators.runtime import _checkpoint, _parallel, _precision
from estimators.probing._probe import is_oom_error
from estimators._task import default_logits_and_targets, default_loss

from ._checkpoint_io import (
    SHARDED_DIR, DamagedCheckpointError, load_checkpoint, load_latest_checkpoint, load_sharded, previous_path,
    remove_stale_sharded, save_checkpoint, save_sharded,
)
from ._monitor import TrainingMonitor
from ._recovery import (
    DistributedOOM, OOMRecord, RecoveryEvent, free_memory, ladder_peaks, pick_rung, restore_optimizer,
    restore_tensors, snapshot_optimizer, snapshot_tensors,
)
from ._schedules import SCHEDULE_ARGS, SCHEDULES, ExternalSchedule, LRSchedule, ScheduleName, make_schedule

__all__ = ["TrainOptions", "TrainResult", "Trainer", "train", "epoch_permutation", "epoch_items", "DistributedOOM"]

log = logging.getLogger("memplan.trainer")

Batch = Any
CHECKPOINT_FORMAT = 1


# ----------------------------------------------------------------------------------------------
# Options and result
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    """How to train (the *what*, micro-batch/precision/…, is the ``TrainConfig``)."""

    epochs: int | None = None
    """Passes over the training data. With neither ``epochs`` nor ``max_steps``, the model
    file's ``settings["epochs"]``/``settings["max_steps"]`` are used, else one epoch."""
    max_steps: int | None = None
    """Optimizer steps. With ``epochs`` too, whichever comes first ends the run."""
    lr: float | None = None
    """Peak learning rate for every parameter group. ``None``: ``settings["lr"]`` of the model
    file, else the optimizer's own lr per group; ``auto`` (command line, config, settings):
    memplan lr-find's suggestion for the chosen plan."""
    schedule: ScheduleName | None = None
    """Learning-rate schedule, stepped once per optimizer step.
    One of cosine, onecycle, step, multistep, exponential, cosine_restarts, plateau, constant
    (see :mod:`memplan._schedules`). ``None``: the model file's ``scheduler(optimizer,
    total_steps)`` if it defines one, else ``cosine`` (linear warm-up + cosine). A name given
    here is used even when the model file defines ``scheduler()``."""
    schedule_args: Mapping[str, Any] | None = None
    """Further shape arguments of the built-in schedule, by name.
    E.g. ``min_lr_ratio``, ``div_factor``, ``final_div_factor``, ``factor``, ``patience``,
    ``threshold``; those with an option of their own below are set there instead."""
    warmup_steps: int | None = None
    """Linear warm-up, in optimizer steps (onecycle: its rise).
    ``None``: ``settings["warmup_steps"]`` of the model file, else 0."""
    gamma: float | None = None
    """LR multiplier of the step, multistep and exponential schedules.
    step/multistep: at each drop (default 0.1); exponential: at every step (required, e.g. 0.999)."""
    step_size: int | None = None
    """Step schedule: optimizer steps between lr drops.
    ``None``: a third of the steps after the warm-up (two drops)."""
    milestones: tuple[int, ...] | None = None
    """Multistep schedule: the steps at which the lr is multiplied by gamma.
    Required there; increasing optimizer-step counts after the warm-up, e.g. ``(3000, 4000)``."""
    t_0: int | None = None
    """cosine_restarts schedule: optimizer steps of the first cosine period (required there)."""
    t_mult: int | None = None
    """cosine_restarts schedule: factor by which each period is longer than the last (default 1)."""
    min_lr: float | None = None
    """Absolute lowest lr of the cosine, cosine_restarts and plateau schedules.
    cosine_restarts' default is 0 (torch's ``eta_min``); plateau's is torch's ``min_lr``. Replaces
    the schedule's ``min_lr_ratio`` (cosine 0.1, plateau 1e-3 of the base lr)."""
    pct_start: float | None = None
    """Onecycle schedule: fraction of the run spent raising the lr (default 0.3).
    Sets the rise instead of ``warmup_steps`` (set one of the two)."""
    anneal_strategy: Literal["cos", "linear"] | None = None
    """Onecycle schedule: shape of the lr's rise and fall, cos (default) or linear."""
    cycle_momentum: bool = False
    """Onecycle schedule: cycle the momentum against the lr.
    SGD's ``momentum`` or the Adam family's ``betas[0]`` goes from ``max_momentum`` down to
    ``base_momentum`` at the peak lr and back up, as ``torch.optim.lr_scheduler.OneCycleLR``."""
    base_momentum: float | None = None
    """Onecycle with cycle_momentum: the momentum at the peak lr (default 0.85)."""
    max_momentum: float | None = None
    """Onecycle with cycle_momentum: the momentum at the start and the end (default 0.95)."""
    cooldown: int | None = None
    """Plateau schedule: evaluations after a reduction during which no stall is counted (default 0)."""
    grad_clip: float | None = 1.0
    """Gradient clipping threshold (``None``: no clipping).
    The global gradient norm's with ``grad_clip_mode="norm"``, each gradient element's absolute
    value with ``"value"``."""
    grad_clip_mode: Literal["norm", "value", "off"] = "norm"
    """How gradients are clipped: norm (clip_grad_norm_), value (clip_grad_value_) or off.
    Under fp16 the GradScaler unscales the gradients first. Both modes compute the global
    gradient norm (logged; without a GradScaler an inf/NaN norm skips the step): one 0-d
    tensor per gradient, not in the estimate, freed before the optimizer step (measured: no
    change of the peak, ``benchmarks/results/technique_memory.md``)."""
    scaler_init_scale: float = 65536.0
    """fp16 GradScaler: the initial loss scale (torch's default, 2**16)."""
    scaler_growth_factor: float = 2.0
    """fp16 GradScaler: factor the scale grows by after scaler_growth_interval clean steps."""
    scaler_backoff_factor: float = 0.5
    """fp16 GradScaler: factor the scale shrinks by after a step with inf/NaN gradients."""
    scaler_growth_interval: int = 2000
    """fp16 GradScaler: consecutive steps without inf/NaN gradients before the scale grows."""
    label_smoothing: float = 0.0
    """Label smoothing of the training loss. Only with the default loss (cross-entropy of
    ``model(inputs)``); a model file with its own ``loss()`` passes ``label_smoothing`` to
    ``F.cross_entropy`` itself, and setting it here is an error. Validation loss is unsmoothed."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the weights with this decay (e.g. 0.999); the EMA
    weights are evaluated, selected as best and written to ``model.pt``. ``None``: off."""
    early_stopping_patience: int | None = None
    """Stop after this many evaluations without improvement of ``monitor``; the best weights
    are restored at the end. ``None``: train to the end (final weights are written)."""
    early_stopping_min_delta: float = 0.0
    """Early stopping: the least change of monitor that counts as an improvement.
    A gain of at most this over the value at the last counted improvement is a stall toward
    the patience; the best weights still follow every gain."""
    monitor: str = "val_loss"
    """Validation metric for best weights, early stopping and the plateau schedule."""
    monitor_mode: Literal["min", "max"] | None = None
    """``None``: ``min`` for names containing "loss", else ``max``."""
    eval_every: int | None = None
    """Evaluate every this many optimizer steps. ``None``: at the end of each epoch. There is
    always an evaluation at the end of the run."""
    checkpoint_every: int | None = None
    """Write ``checkpoint.pt`` every this many optimizer steps. ``None``: at the end of each epoch.
    There is always one at the end and on SIGINT/SIGTERM."""
    out_dir: Path = Path("memplan-run")
    """Where ``model.pt``, ``checkpoint.pt``, ``metrics.jsonl`` and ``summary.json`` go."""
    resume: bool = False
    """Continue from ``out_dir/checkpoint.pt`` if it exists (else start afresh)."""
    seed: int = 0
    """Seeds model initialisation, dropout and the data order."""
    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N``."""
    compile: bool = False
    """Run the forward pass through ``torch.compile`` (state dicts keep their plain names)."""
    num_workers: int | None = None
    """DataLoader worker processes.
    ``None``: 0 for in-memory ``TensorDataset``s (indexing a tensor is cheaper than shipping it
    between processes), else ``min(2, cpus - 1)`` so that at least one core is left to the
    training process itself. Workers cost host memory, not the device's: not in the estimate."""
    prefetch_factor: int = 2
    """Batches each DataLoader worker loads ahead (with workers only; host memory)."""
    pin_memory: bool | None = None
    """Load batches into page-locked host memory, for asynchronous copies to the GPU.
    ``None``: on CUDA only. Host memory, not the device's: not in the estimate."""
    persistent_workers: bool | None = None
    """Keep the DataLoader workers alive between epochs (``None``: whenever there are workers)."""
    drop_last: bool = False
    """Skip each epoch's last, short optimizer step.
    The items of the epoch's permutation after its last whole global batch (micro-batch x
    accumulation x ranks) are not trained that epoch; the next epoch's permutation leaves out
    others. Validation keeps every item. ``False``: the short last window is trained, weighted
    by its items. A run resumes only with the setting it was started with."""
    max_nonfinite: int = 3
    """Stop with ``TrainingError`` after this many consecutive windows with a NaN/inf loss."""
    progress: bool = True
    """Show a tqdm progress bar (tqdm hides it by itself when stderr is not a terminal)."""
    metrics_path: Path | None = None
    """JSON-lines metrics log. ``None``: ``out_dir/metrics.jsonl``."""
    predicted_peak_bytes: int | None = None
    """The estimate's peak, compared with the measured peak in the summary."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.metrics_path is not None:
            object.__setattr__(self, "metrics_path", Path(self.metrics_path))
        for name in ("epochs", "max_steps", "eval_every", "checkpoint_every", "early_stopping_patience"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"TrainOptions.{name} must be a whole number >= 1 or None, got {value!r}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"TrainOptions.warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ConfigError(f"TrainOptions.schedule {self.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
        if self.milestones is not None and not isinstance(self.milestones, (str, bytes)):
            try:
                object.__setattr__(self, "milestones", tuple(self.milestones))
            except TypeError:
                pass
        _check_schedule_options(self)
        _check_technique_options(self)
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"TrainOptions.lr must be > 0, got {self.lr!r}")
        if self.grad_clip is not None and not (isinstance(self.grad_clip, (int, float)) and self.grad_clip > 0):
            raise ConfigError(f"TrainOptions.grad_clip must be > 0 or None, got {self.grad_clip!r}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"TrainOptions.label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"TrainOptions.ema_decay must be in (0, 1) or None, got {self.ema_decay!r}")
        if self.monitor_mode not in (None, "min", "max"):
            raise ConfigError(f"TrainOptions.monitor_mode must be 'min', 'max' or None, got {self.monitor_mode!r}")
        if self.max_nonfinite < 1:
            raise ConfigError(f"TrainOptions.max_nonfinite must be >= 1, got {self.max_nonfinite!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ConfigError(f"TrainOptions.device {self.device!r} is not a device; use 'cpu' or 'cuda'") from None
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"TrainOptions.device {self.device!r}: the trainer runs on 'cpu' or 'cuda'")

    @property
    def clip_mode(self) -> Literal["norm", "value", "off"]:
        """The clipping that runs: ``off`` also when ``grad_clip`` is ``None``."""
        return "off" if self.grad_clip is None else self.grad_clip_mode

    def schedule_kwargs(self) -> dict[str, Any]:
        """The built-in schedule's shape arguments: ``schedule_args`` and the options set for it."""
        out = dict(self.schedule_args or {})
        for name in _SCHEDULE_FIELDS:
            value = getattr(self, name)
            if value is not None and value is not False:
                out[name] = value
        return out

    def set_schedule_fields(self) -> list[str]:
        """Names of the schedule options (and ``schedule_args`` keys) that are set."""
        return [n for n in _SCHEDULE_FIELDS if getattr(self, n) not in (None, False)] + sorted(self.schedule_args or {})

    def scaler_kwargs(self) -> dict[str, Any]:
        """The fp16 GradScaler's arguments."""
        return {"init_scale": float(self.scaler_init_scale), "growth_factor": float(self.scaler_growth_factor),
                "backoff_factor": float(self.scaler_backoff_factor),
                "growth_interval": int(self.scaler_growth_interval)}

    @property
    def mode(self) -> Literal["min", "max"]:
        if self.monitor_mode is not None:
            return self.monitor_mode
        return "min" if "loss" in self.monitor else "max"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (paths as strings), for checkpoints and the summary."""
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, Path):
                d[k] = str(v)
        if d["schedule_args"] is not None:
            d["schedule_args"] = dict(d["schedule_args"])
        if d["milestones"] is not None:
            d["milestones"] = list(d["milestones"])
        return d


_SCHEDULE_FIELDS = ("gamma", "step_size", "milestones", "t_0", "t_mult", "min_lr", "pct_start",
                    "anneal_strategy", "cycle_momentum", "base_momentum", "max_momentum", "cooldown")
"""TrainOptions fields that are shape arguments of a built-in schedule (same names)."""


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_schedule_options(o: TrainOptions) -> None:
    """Each schedule option's value, and that the chosen schedule takes it (one-line errors)."""
    checks: list[tuple[str, bool, str]] = [
        ("gamma", o.gamma is None or (_number(o.gamma) and o.gamma > 0), "a number > 0"),
        ("step_size", o.step_size is None or _whole(o.step_size, 1), "a whole number >= 1"),
        ("milestones", o.milestones is None or (
            isinstance(o.milestones, tuple) and len(o.milestones) > 0 and all(_whole(m, 1) for m in o.milestones)
            and list(o.milestones) == sorted(set(o.milestones))), "increasing whole numbers >= 1"),
        ("t_0", o.t_0 is None or _whole(o.t_0, 1), "a whole number >= 1"),
        ("t_mult", o.t_mult is None or _whole(o.t_mult, 1), "a whole number >= 1"),
        ("min_lr", o.min_lr is None or (_number(o.min_lr) and o.min_lr >= 0), "a number >= 0"),
        ("pct_start", o.pct_start is None or (_number(o.pct_start) and 0 < o.pct_start < 1), "in (0, 1)"),
        ("anneal_strategy", o.anneal_strategy in (None, "cos", "linear"), "'cos' or 'linear'"),
        ("cycle_momentum", isinstance(o.cycle_momentum, bool), "true or false"),
        ("base_momentum", o.base_momentum is None or (_number(o.base_momentum) and 0 <= o.base_momentum < 1), "in [0, 1)"),
        ("max_momentum", o.max_momentum is None or (_number(o.max_momentum) and 0 <= o.max_momentum < 1), "in [0, 1)"),
        ("cooldown", o.cooldown is None or _whole(o.cooldown, 0), "a whole number >= 0"),
    ]
    for name, ok, what in checks:
        if not ok:
            raise ConfigError(f"TrainOptions.{name} must be {what} or None, got {getattr(o, name)!r}")
    if o.schedule_args is not None and not isinstance(o.schedule_args, Mapping):
        raise ConfigError(f"TrainOptions.schedule_args must be a mapping or None, got {o.schedule_args!r}")
    name = o.schedule or "cosine"
    takes = SCHEDULE_ARGS[name]
    for field_name in _SCHEDULE_FIELDS:
        if getattr(o, field_name) not in (None, False):
            if field_name not in takes:
                users = ", ".join(repr(k) for k, v in SCHEDULE_ARGS.items() if field_name in v)
                raise ConfigError(f"TrainOptions.{field_name} applies to schedule {users}, not {name!r}; "
                                  f"set schedule or leave {field_name} unset")
            if field_name in (o.schedule_args or {}):
                raise ConfigError(f"TrainOptions.{field_name} is also in schedule_args; set it once")
    unknown = sorted(set(o.schedule_args or {}) - set(takes))
    if unknown:
        raise ConfigError(f"TrainOptions.schedule_args {unknown} are not arguments of schedule {name!r}; "
                          f"it takes: {', '.join(takes) or 'none'}")
    kwargs = o.schedule_kwargs()
    required = {"exponential": "gamma", "cosine_restarts": "t_0", "multistep": "milestones"}.get(name)
    if required is not None and kwargs.get(required) is None:
        raise ConfigError(f"TrainOptions.{required} is required by schedule {name!r}; set it")
    if name == "exponential" and kwargs["gamma"] > 1:
        raise ConfigError(f"TrainOptions.gamma must be <= 1 for schedule 'exponential', got {kwargs['gamma']!r}")
    if (o.base_momentum is not None or o.max_momentum is not None) and not o.cycle_momentum:
        raise ConfigError("TrainOptions.base_momentum/max_momentum apply with cycle_momentum=True only; set it")
    if o.base_momentum is not None and o.max_momentum is not None and o.base_momentum > o.max_momentum:
        raise ConfigError(f"TrainOptions.base_momentum ({o.base_momentum}) must be <= max_momentum ({o.max_momentum})")
    if name == "onecycle" and o.pct_start is not None and o.warmup_steps:
        raise ConfigError("TrainOptions.pct_start and warmup_steps both set the onecycle rise; set one of them")


def _check_technique_options(o: TrainOptions) -> None:
    """Early stopping, clipping, GradScaler and DataLoader options (one-line errors)."""
    checks: list[tuple[str, bool, str]] = [
        ("early_stopping_min_delta", _number(o.early_stopping_min_delta) and o.early_stopping_min_delta >= 0,
         "a number >= 0"),
        ("grad_clip_mode", o.grad_clip_mode in ("norm", "value", "off"), "'norm', 'value' or 'off'"),
        ("scaler_init_scale", _number(o.scaler_init_scale) and o.scaler_init_scale > 0, "a number > 0"),
        ("scaler_growth_factor", _number(o.scaler_growth_factor) and o.scaler_growth_factor > 1, "a number > 1"),
        ("scaler_backoff_factor", _number(o.scaler_backoff_factor) and 0 < o.scaler_backoff_factor < 1, "in (0, 1)"),
        ("scaler_growth_interval", _whole(o.scaler_growth_interval, 1), "a whole number >= 1"),
        ("num_workers", o.num_workers is None or _whole(o.num_workers, 0), "a whole number >= 0 or None"),
        ("prefetch_factor", _whole(o.prefetch_factor, 1), "a whole number >= 1"),
        ("pin_memory", o.pin_memory is None or isinstance(o.pin_memory, bool), "true, false or None"),
        ("persistent_workers", o.persistent_workers is None or isinstance(o.persistent_workers, bool),
         "true, false or None"),
        ("drop_last", isinstance(o.drop_last, bool), "true or false"),
    ]
    for name, ok, what in checks:
        if not ok:
            raise ConfigError(f"TrainOptions.{name} must be {what}, got {getattr(o, name)!r}")
    if o.early_stopping_min_delta and o.early_stopping_patience is None:
        raise ConfigError("TrainOptions.early_stopping_min_delta needs early_stopping_patience; set it")
    if o.persistent_workers and o.num_workers == 0:
        raise ConfigError("TrainOptions.persistent_workers needs worker processes; set num_workers >= 1")


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


def train(
    task: Task,
    config: TrainConfig,
    options: TrainOptions | None = None,
    *,
    memory_guard: ContextManager[Any] | None = None,
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


# ----------------------------------------------------------------------------------------------
# Data: a resumable order
# ----------------------------------------------------------------------------------------------

def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the ``n`` training items in ``epoch``: a pure function of ``(seed, epoch)``,
    and the very permutation ``DistributedSampler(shuffle=True, seed=seed)`` draws after
    ``set_epoch(epoch)`` -- so that a distributed run and a single-process run see one order."""
    g = torch.Generator().manual_seed(int(seed) + int(epoch))
    return torch.randperm(n, generator=g)


def _epoch_seed(seed: int, epoch: int) -> int:
    # The DataLoader's worker base seed; any injective-enough mix of (seed, epoch) works.
    return (int(seed) * 1_000_003 + int(epoch) * 7_919 + 12_345) % (2**63 - 1)


def _window_seed(seed: int, step: int, rank: int) -> int:
    """The torch RNG seed of a distributed window: a pure function of (seed, step, rank), so
    that every rank draws its own dropout masks, a replayed window draws the same ones, and no
    checkpoint needs every rank's RNG state."""
    return (int(seed) * 1_000_003 + int(step) * 104_729 + int(rank) * 15_485_863 + 7) % (2**63 - 1)


def epoch_items(n: int, world_size: int) -> int:
    """Items of an epoch that are trained on: all of them on one process; with ``world_size``
    ranks the last ``n % world_size`` of the permutation are dropped, as
    ``DistributedSampler(drop_last=True)`` does, so that every rank has as many samples in every
    window (and every rank runs as many forward passes: none waits alone in a collective)."""
    return n if world_size == 1 else n - n % world_size


class _EpochBatches:
    """DataLoader batch sampler: this rank's micro-batches of one epoch from a sample offset on.

    The epoch's permutation is cut into windows of ``global_batch`` consecutive items (the last
    one may be short); rank ``r`` of ``world_size`` takes the window's positions ``r::world_size``
    -- exactly the items ``DistributedSampler`` gives it -- and cuts them into micro-batches. With
    one process this is the window itself. Set the position with :meth:`set_position` *before*
    each ``iter(loader)``; the sampler is read in the main process, so this works with
    persistent workers too.
    """

    def __init__(self, n: int, micro_batch_size: int, seed: int, *, global_batch: int,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False) -> None:
        self.n, self.micro, self.seed = n, micro_batch_size, seed
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        self.n_epoch = epoch_items(n, world_size)
        if drop_last:
            # Whole windows only: the permutation's tail after the last full global batch rests.
            self.n_epoch -= self.n_epoch % global_batch
        self.slices: list[list[int]] = []
        self.sizes: Any = None
        """Every item's size vector (``Task.shapes().sizes``) for a length-grouped order."""

    def windows(self, epoch: int, start: int) -> list[_Window]:
        """The windows of ``epoch`` from sample offset ``start`` on, with this rank's share."""
        order = epoch_permutation(self.n, self.seed, epoch)
        if self.sizes is not None:
            # Length-grouped: the same permutation, sorted by size within mega-batches of 50
            # global batches (the longest batch first); a pure function of (seed, epoch), so
            # a resumed run meets the same windows.
            from estimators._shapes import grouped_order
            order = torch.as_tensor(grouped_order(self.sizes, order.numpy(), self.global_batch))
        order = order.tolist()
        out: list[_Window] = []
        for begin in range(start, self.n_epoch, self.global_batch):
            chunk = order[begin:min(begin + self.global_batch, self.n_epoch)]
            mine = chunk[self.rank::self.world_size]
            micro = [mine[i:i + self.micro] for i in range(0, len(mine), self.micro)]
            out.append(_Window(epoch=epoch, start=begin, micro_indices=micro, n_total=len(chunk)))
        return out

    def set_position(self, epoch: int, start: int) -> list[_Window]:
        windows = self.windows(epoch, start)
        self.slices = [m for w in windows for m in w.micro_indices]
        return windows

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.slices)

    def __len__(self) -> int:
        return len(self.slices)


@dataclass(frozen=True)
class _Window:
    """One optimizer step's worth of data: the dataset indices of each of this rank's micro-batches.

    A window is the unit that OOM recovery replays: its indices identify the samples, so it can
    be re-cut into micro-batches of another size (same global batch) and run again.
    """

    epoch: int
    start: int
    """Offset of the window's first sample in the epoch's permutation."""
    micro_indices: list[list[int]]
    n_total: int = -1
    """Samples of the window over all ranks (-1: this rank's, i.e. one process)."""

    @property
    def n_items(self) -> int:
        """This rank's samples."""
        return sum(len(m) for m in self.micro_indices)

    @property
    def global_items(self) -> int:
        return self.n_total if self.n_total >= 0 else self.n_items

    @property
    def end(self) -> int:
        return self.start + self.global_items

    def recut(self, micro_batch_size: int) -> _Window:
        """The same samples in micro-batches of another size (same global batch)."""
        flat = [i for m in self.micro_indices for i in m]
        micro = [flat[k:k + micro_batch_size] for k in range(0, len(flat), micro_batch_size)]
        return _Window(epoch=self.epoch, start=self.start, micro_indices=micro, n_total=self.n_total)


@dataclass
class _WindowOutcome:
    loss: float
    """Mean training loss over the window's samples (NaN/inf when non-finite)."""
    applied: bool
    """The optimizer step changed the weights."""
    nonfinite: bool = False
    """Skipped: NaN/inf loss (or gradient norm without a GradScaler)."""
    scaler_skipped: bool = False
    """fp16: the GradScaler found inf/NaN gradients and skipped the step (normal early on)."""
    grad_norm: float | None = None
    seconds: float = 0.0
    largest_batch: tuple[int, list[list[int]]] | None = None
    """(tensor elements, tensor shapes) of the window's largest micro-batch."""


# ----------------------------------------------------------------------------------------------
# EMA of the weights
# ----------------------------------------------------------------------------------------------

class _EMA:
    """Exponential moving average of the floating-point state (parameters and float buffers
    such as BatchNorm statistics); integer buffers are taken from the live model."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        state = model.state_dict()
        for name, avg in self.shadow.items():
            avg.lerp_(state[name].detach(), 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[None]:
        """The EMA weights in the model for the duration (evaluation, saving)."""
        backup = {k: v.detach().clone() for k, v in model.state_dict().items() if k in self.shadow}
        model.load_state_dict(self.shadow, strict=False)
        try:
            yield
        finally:
            model.load_state_dict(backup, strict=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for name, value in state.items():
            self.shadow[name].copy_(value)


# ----------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------

_UNDO_STEPS = 2
"""Optimizer steps guarded by an undo copy (see ``_run_window``)."""

_LOG_WRITE_SECONDS = 1.0
"""Longest time a step's metrics line waits in memory before it is written (see ``Trainer._log``)."""


class Trainer:
    """Trainer for one :class:`TrainConfig`: one device, or one rank of a DDP/FSDP2 run.

    After :meth:`run`, ``self.model`` holds the written weights (best or final, EMA if on).
    ``memory_guard`` is entered around the run (model, optimizer, every step; not the dataset), so that a
    CPU memory budget covers what the estimate covers; its ``peak_bytes`` attribute, if it has
    one, is reported as the measured peak.

    ``strategy="ddp"``/``"fsdp"`` need the default process group to be initialised with
    ``config.world_size`` ranks (``memplan train --nproc N`` does it, see :mod:`memplan._launch`).
    Each rank trains its share of every window; rank 0 alone writes the log, the progress bar,
    the summary and the weights. An OOM on any rank is not recovered in-process (the other ranks
    are blocked in, or heading for, a collective): the rank writes an OOM record -- and, under
    DDP, a checkpoint of the window's start -- to ``out_dir`` and raises
    :class:`DistributedOOM`; the launcher chooses the next rung and starts every rank again.
    ``recovery_state`` is how it hands its decision over (``{"recoveries": [...], "tried":
    [...]}``): the run keeps ``config`` instead of switching back to the checkpoint's.
    """

    def __init__(self, task: Task, config: TrainConfig, options: TrainOptions, *,
                 memory_guard: ContextManager[Any] | None = None,
                 ladder: Sequence[Any] | None = None,
                 recovery_state: Mapping[str, Any] | None = None) -> None:
        self.rank, self.world_size = 0, 1
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
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if task.train_data is None:
            raise ModelFileError(f"{task.name}: define train_data() to train")
        if options.label_smoothing and task.loss_fn is not default_loss:
            raise ConfigError(
                f"label_smoothing applies only to the default loss, and {task.name} defines its own "
                "loss(); pass it there instead: F.cross_entropy(logits, targets, label_smoothing=0.1)"
            )
        needs_val = [name for name, on in (
            ("schedule='plateau'", options.schedule == "plateau"),
            ("early_stopping_patience", options.early_stopping_patience is not None),
        ) if on]
        if needs_val and task.val_data is None:
            raise ConfigError(f"{', '.join(needs_val)} needs validation data; define val_data() in {task.name}")
        if options.schedule is None and task.build_scheduler is not None:
            # Checked before any data is loaded: the model file's scheduler() owns the lr.
            given = options.set_schedule_fields() + (["warmup_steps"] if options.warmup_steps else [])
            if given or task.settings.get("warmup_steps"):
                what = ", ".join(f"TrainOptions.{n}" for n in given) or 'settings["warmup_steps"]'
                raise ConfigError(
                    f"{what} shapes a built-in schedule, but {task.name} defines scheduler(), which owns the lr; "
                    "drop it (put a warm-up into scheduler()), or name a built-in schedule to use instead")
        if torch.device(options.device).type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked for but torch sees no CUDA GPU; use device='cpu'")
        self.task, self.config, self.options = task, config, options
        self.memory_guard = memory_guard
        self.device = torch.device(options.device)
        self.out_dir = options.out_dir
        self.checkpoint_path = self.out_dir / "checkpoint.pt"
        self.best_path = self.out_dir / "best_model.pt"
        self.model_path = self.out_dir / "model.pt"
        self.metrics_path = options.metrics_path or self.out_dir / "metrics.jsonl"
        self._stop_signal: str | None = None
        # OOM recovery: the rungs still below the running configuration, in order.
        self.ladder: list[TrainConfig] = _ladder_configs(ladder, config)
        self._ladder_peaks = ladder_peaks(ladder)
        self._recovering = ladder is not None  # without a ladder an OOM propagates
        self._optimizer_undo: Any = None
        self._peak_floor: int | None = None
        self.largest_batch: dict[str, Any] | None = None
        """The largest micro-batch met (step, elements, shapes) and its step's peak."""
        self.recoveries: list[dict[str, Any]] = []
        self._tried: list[TrainConfig] = [config]
        self._phase = "setup"
        self._decided = dict(recovery_state) if recovery_state is not None else None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.config.strategy != "single"

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs and writes files."""
        return self.rank == 0

    # -- the run, top to bottom ------------------------------------------------------------
    def run(self) -> TrainResult:
        t0 = time.perf_counter()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._setup_data()
        guard = self.memory_guard if self.memory_guard is not None else contextlib.nullcontext()
        with guard, self._stop_on_signals():
            self._set_phase("setup")
            self._setup()
            resumed_from = self._resume() if self.options.resume else None
            # Rank 0 alone writes the log; the others write to nowhere.
            self._metrics_file = (open(self.metrics_path, "a" if resumed_from is not None else "w")
                                  if self.is_main else open(os.devnull, "w"))
            self._pending_log: list[dict[str, Any]] = []
            self._log_written_at = time.monotonic()
            self._bar = self._progress_bar()
            try:
                if resumed_from is not None:
                    self._log({"type": "resume", "step": self.step, "epoch": self.epoch})
                self._log_decided_recovery()
                if self._pending_evaluation:
                    self._evaluate_and_track()  # the evaluation an OOM interrupted before the relaunch
                interrupted = self._train_loop()
                if not interrupted and self.step > 0 and self.last_train_loss is None:
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
                        self._stop_signal, self.step, self.checkpoint_path)
        return TrainResult(
            steps=self.step, epochs_completed=self.epoch, best_metric=self.best_metric,
            final_metrics=dict(summary["final_metrics"]), wall_s=wall_s, interrupted=interrupted,
            skipped_steps=self.skipped_steps, out_dir=self.out_dir, summary=summary,
        )

    def _train_loop(self) -> bool:
        """Windows until the run is done; True when a signal interrupted it."""
        windows = self._windows()
        try:
            while self.step < self.total_steps and not self.stopped_early:
                window, batches = next(windows)
                recovered_before = len(self.recoveries)
                outcome = self._run_window_recovering(window, batches)
                del batches
                self._after_window(window, outcome)
                epoch_ended = self.epoch_offset == 0
                if self._due(self.options.eval_every, epoch_ended) and self.val_loader is not None:
                    self._evaluate_and_track()
                if self._due(self.options.checkpoint_every, epoch_ended) and self.consecutive_nonfinite == 0:
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

    # -- setup -----------------------------------------------------------------------------
    def _setup_data(self) -> None:
        """Datasets and loaders. Runs first and outside the memory guard: the dataset is not
        part of the training step's memory (on a GPU it is not even on the device), and dataset
        code may draw random numbers -- whether it already ran in this process (the estimator
        caches datasets) must not change the model's initialisation."""
        opts, task, config = self.options, self.task, self.config
        dataset = task.dataset()
        assert dataset is not None
        self.n_train = len(dataset)  # type: ignore[arg-type]
        if self.n_train == 0:
            raise ModelFileError(f"{task.name}: train_data() is empty; it must hold at least one item")
        if self.n_train < self.world_size:
            raise ConfigError(f"{task.name}: {self.n_train} training items cannot be shared by {self.world_size} ranks")
        self.sampler = _EpochBatches(self.n_train, config.micro_batch_size, opts.seed,
                                     global_batch=config.global_batch, rank=self.rank, world_size=self.world_size,
                                     drop_last=opts.drop_last)
        if self.sampler.n_epoch == 0:
            raise ConfigError(
                f"TrainOptions.drop_last leaves no step: {task.name} has {self.n_train} training items, fewer than "
                f"one global batch of {config.global_batch}; set drop_last=False or use a smaller global batch")
        if config.length_grouped:
            shapes = task.shapes()
            if not shapes.groupable:
                raise ConfigError(
                    f"{task.name}: length-grouped batching needs every item's size and batches padded to "
                    "their longest item; define item_sizes(dataset) in the model file, or train without it")
            self.sampler.sizes = shapes.sizes
        # The loader's own generator: DataLoader draws its worker base seed from it at every
        # iter(); drawing from the global RNG instead would shift dropout after a resume.
        self._loader_generator = torch.Generator()
        self.train_loader = self._make_loader(dataset, batch_sampler=self.sampler)
        self.val_loader = self._make_val_loader()

    def _setup(self) -> None:
        """Model, optimizer, precision, EMA, schedule and the counters, inside the guard."""
        opts, task, config = self.options, self.task, self.config
        # Seed everything the model's initialisation and dropout draw from; the data order has
        # its own generators and does not depend on this state.
        _seed_everything(opts.seed)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the summary's peak is this run's
        model = copy.deepcopy(task.prebuilt) if task.prebuilt is not None else task.build_model()
        self.model = model.to(self.device)
        self.model.train()
        _checkpoint.apply_checkpointing(self.model, config.checkpoint_segments, task.checkpoint_blocks)
        # DDP/FSDP2 through the helper the estimator traces with, after checkpointing (as traced).
        # ``self.model`` stays the user's module (FSDP2 shards it in place; DDP wraps it): state
        # dicts, evaluation and EMA use it; ``forward_model`` is what the training step calls.
        device_ids = [self.device.index] if self.device.type == "cuda" and self.device.index is not None else None
        wrapped = _parallel.parallelize(self.model, config, finder=task.checkpoint_blocks, device_ids=device_ids)
        self.model = _parallel.unwrap(wrapped)
        # The compiled module shares the parameters; state dicts are taken from the plain one so
        # that their keys do not depend on whether the run was compiled.
        self._wrapped = wrapped
        self.forward_model: nn.Module = torch.compile(wrapped) if opts.compile else wrapped  # type: ignore[assignment]

        # After sharding: FSDP2 replaces the parameters by DTensors, which the optimizer must hold.
        self.optimizer = task.make_optimizer(self.model)
        lr = opts.lr if opts.lr is not None else task.settings.get("lr")
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = float(lr)
        self.scaler = self._make_scaler(config.precision)
        self.ema = _EMA(self.model, opts.ema_decay) if opts.ema_decay is not None else None
        self._loss_fn = self._training_loss()

        # Length of the run, in optimizer steps (windows).
        self.steps_per_epoch = math.ceil(self.sampler.n_epoch / config.global_batch)
        epochs, max_steps = opts.epochs, opts.max_steps
        if epochs is None and max_steps is None:
            epochs = task.settings.get("epochs")
            max_steps = task.settings.get("max_steps")
            if epochs is None and max_steps is None:
                epochs = 1
        candidates = [int(epochs) * self.steps_per_epoch] if epochs else []
        candidates += [int(max_steps)] if max_steps else []
        self.total_steps = min(candidates)
        self.schedule: LRSchedule = self._make_schedule()
        if self.schedule_needs_val and self.val_loader is None:
            raise ConfigError(f"the model file's ReduceLROnPlateau scheduler needs validation data; define val_data() in {task.name}")

        # Progress, saved in checkpoints.
        self.step = 0
        self.epoch = 0  # = epochs completed
        self.epoch_offset = 0  # samples of the current epoch already consumed
        self.samples_seen = 0
        self.skipped_steps = 0
        self.scaler_skipped_steps = 0
        self.consecutive_nonfinite = 0
        self.best_metric: float | None = None
        self.best_step: int | None = None
        self.best_metrics: dict[str, float] = {}
        self.bad_evaluations = 0
        self.stop_reference: float | None = None  # early stopping's last significant value
        self.stopped_early = False
        self.last_metrics: dict[str, float] = {}
        self.last_eval_step: int | None = None
        self.last_train_loss: float | None = None
        self.last_checkpoint_step: int | None = None
        self._last_dcp: str | None = None  # the sharded folder the last checkpoint.pt names
        self._pending_evaluation = False
        # This process only.
        self._throughput: list[tuple[int, float]] = []
        # Per-layer gradient norms every N steps and NVML readings (memplan._monitor); FSDP2's
        # gradients are shards, whose per-layer norms would each need a collective.
        self._monitor = TrainingMonitor(self.device, enabled=self.config.strategy != "fsdp" and self.is_main)

    def _make_schedule(self) -> LRSchedule:
        """The model file's ``scheduler()`` when it has one and no schedule is named, else the
        named built-in one (``cosine`` by default) with its warm-up."""
        opts, task = self.options, self.task
        self.schedule_needs_val = False
        if opts.schedule is None and task.build_scheduler is not None:
            try:
                made = task.build_scheduler(self.optimizer, self.total_steps)
            except Exception as exc:  # noqa: BLE001 - the user's code, reported with the fix
                raise ModelFileError(f"{task.name}: scheduler(optimizer, total_steps) raised "
                                     f"{type(exc).__name__}: {exc}; fix scheduler()") from None
            schedule = ExternalSchedule(made, self.optimizer, name=task.name)
            self.schedule_needs_val = schedule.on_metric
            return schedule
        warmup = opts.warmup_steps if opts.warmup_steps is not None else int(task.settings.get("warmup_steps", 0))
        name = opts.schedule or "cosine"
        if name == "onecycle" and opts.pct_start is not None and opts.warmup_steps is None:
            warmup = 0  # pct_start sets the rise; the model file's default warm-up gives way to it
        schedule_args = opts.schedule_kwargs()
        if name == "plateau":
            schedule_args.setdefault("mode", opts.mode)
        return make_schedule(name, self.optimizer, warmup_steps=warmup, total_steps=self.total_steps, **schedule_args)

    def _make_scaler(self, precision: str) -> Any:
        kwargs = self.options.scaler_kwargs()
        scaler = _precision.make_grad_scaler(precision, self.device.type, **kwargs)
        if scaler is not None and self.config.strategy == "fsdp":
            # Every rank sees only its gradient shards: the sharded scaler all-reduces whether
            # any rank found inf/NaN, so that all of them skip (or take) the same step.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(self.device.type, **kwargs)
        return scaler

    def _training_loss(self) -> Callable[[nn.Module, Batch], torch.Tensor]:
        smoothing = self.options.label_smoothing
        if not smoothing:
            return self.task.compute_loss

        def smoothed(model: nn.Module, batch: Batch) -> torch.Tensor:
            logits, targets = _logits_and_targets(model, batch)
            return F.cross_entropy(logits, targets, label_smoothing=smoothing)
        return smoothed

    def _num_workers(self, dataset: Dataset) -> int:
        if self.options.num_workers is not None:
            return self.options.num_workers
        if isinstance(dataset, TensorDataset):
            return 0
        return min(2, max(0, (os.cpu_count() or 1) - 1))

    def _make_loader(self, dataset: Dataset, **kwargs: Any) -> DataLoader:
        opts = self.options
        workers = self._num_workers(dataset)
        persistent = workers > 0 if opts.persistent_workers is None else opts.persistent_workers
        if persistent and workers == 0:
            raise ConfigError("TrainOptions.persistent_workers needs worker processes, and this dataset gets "
                              "none by default; set num_workers >= 1")
        return DataLoader(
            dataset,
            collate_fn=self.task.collate,
            num_workers=workers,
            # page-locked host memory: asynchronous copies to the GPU
            pin_memory=self.device.type == "cuda" if opts.pin_memory is None else opts.pin_memory,
            persistent_workers=persistent,  # no worker start-up cost at every epoch
            prefetch_factor=opts.prefetch_factor if workers > 0 else None,
            **{"generator": self._loader_generator, **kwargs},
        )

    def _make_val_loader(self) -> DataLoader | None:
        if self.task.val_data is None:
            return None
        try:
            data = self.task.val_data()
        except Exception as exc:  # noqa: BLE001 - the user's code, reported with the fix
            raise ModelFileError(f"{self.task.name}: val_data() raised {type(exc).__name__}: {exc}; fix the dataset code") from None
        if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
            raise ModelFileError(f"{self.task.name}: val_data() returned {type(data).__name__}; return a map-style Dataset")
        if len(data) == 0:
            return None
        return self._val_loader_for(data)

    def _val_loader_for(self, data: Dataset) -> DataLoader:
        # Validation needs no gradients, so the training micro-batch always fits. Its own
        # generator: evaluating must not move anything the training data order depends on.
        # Distributed: rank r evaluates items r::W (every item once; sums are all-reduced).
        sampler = None if self.world_size == 1 else list(range(self.rank, len(data), self.world_size))  # type: ignore[arg-type]
        return self._make_loader(data, batch_size=self.config.micro_batch_size, shuffle=False, drop_last=False,
                                 sampler=sampler, generator=torch.Generator().manual_seed(self.options.seed))

    # -- the data, window by window --------------------------------------------------------
    def _windows(self) -> Iterator[tuple[_Window, Iterator[Batch]]]:
        """Windows from the current data position on, across epochs, without end.

        Each comes with an iterator over its collated micro-batches, read lazily from the
        DataLoader: only one micro-batch is held at a time, as the estimator assumes.
        """
        epoch, start = self.epoch, self.epoch_offset
        while True:
            windows = self.sampler.set_position(epoch, start)
            self._loader_generator.manual_seed(_epoch_seed(self.options.seed, epoch) + self.rank)
            loader_iter = iter(self.train_loader)
            for window in windows:
                yield window, itertools.islice(loader_iter, len(window.micro_indices))
            del loader_iter
            epoch, start = epoch + 1, 0

    def _collate_window(self, window: _Window) -> Iterator[Batch]:
        """The window's micro-batches straight from the dataset, one at a time: for replaying a
        window (``window.recut(new_micro)``) without the DataLoader; a plain run never does."""
        dataset = self.task.dataset()
        for indices in window.micro_indices:
            yield self.task.collate([dataset[i] for i in indices])  # type: ignore[index]

    # -- one optimizer step ----------------------------------------------------------------
    def _run_window(self, window: _Window, batches: Iterator[Batch], config: TrainConfig) -> _WindowOutcome:
        """Forward/backward every micro-batch of ``window``, then one optimizer step.

        Nothing of the window is applied before ``optimizer_step``, and gradients start from
        ``None``: if this raises before the step (an OOM, say), the window can be run again
        from its start with another ``config`` of the same global batch::

            window = window.recut(new_config.micro_batch_size)
            self._run_window(window, self._collate_window(window), new_config)
        """
        t0 = time.perf_counter()
        self._optimizer_undo = None
        self.optimizer.zero_grad(set_to_none=True)  # a no-op normally; makes a replay start clean
        window_loss: torch.Tensor | None = None
        last = len(window.micro_indices) - 1
        largest: tuple[int, list[list[int]]] | None = None
        for k, (indices, batch) in enumerate(zip(window.micro_indices, batches)):
            batch = self._to_device(batch)
            size = _batch_size_of(batch)
            if largest is None or size[0] > largest[0]:
                largest = size
            # Weight each micro-batch by its share of the window's samples (this rank's), so that
            # the summed gradients are those of the mean loss over the whole window -- the large
            # batch's gradient exactly, also for a short last window or a short last micro-batch.
            # With full micro-batches this is the usual loss / grad_accum_steps. Every rank has
            # as many samples, so DDP's and FSDP's mean over ranks is the mean over the window.
            weight = len(indices) / window.n_items
            # DDP reduces gradients across ranks in the last micro-batch's backward only; FSDP2
            # reduce-scatters every micro-batch (its gradients stay sharded); _parallel decides.
            with _parallel.gradient_sync(self._wrapped, k == last):
                self._set_phase("forward")
                with _precision.forward_context(config.precision, self.device.type):
                    loss = self._loss_fn(self.forward_model, batch)
                    if weight != 1.0:  # one micro-batch per window: x * 1.0 is x, skip the op and its backward
                        loss = loss * weight
                self._set_phase("backward")
                _precision.backward(loss, self.scaler)
            part = loss.detach().float()
            window_loss = part if window_loss is None else window_loss + part
            del batch, loss, part  # free the batch and the graph now, as the estimate assumes
        self._set_phase("optimizer")
        if window_loss is None:  # no micro-batch (cannot happen with the sampler's windows)
            window_loss = torch.zeros((), device=self.device)

        if self.distributed:
            # The window's mean loss over all ranks: what is logged, and one skip decision for all.
            window_loss = window_loss.clone()  # reduced in place: not the loss tensor's own storage
            dist.all_reduce(window_loss)
            window_loss /= self.world_size
        loss_value = float(window_loss)  # waits for the device once per step; the log needs it anyway
        if not math.isfinite(loss_value):
            # Skip: nothing applied (weights, optimizer state, scaler and schedule untouched).
            self.optimizer.zero_grad(set_to_none=True)
            return _WindowOutcome(loss_value, applied=False, nonfinite=True, seconds=time.perf_counter() - t0)

        grad_norm = None
        if self._recovering and self.step < _UNDO_STEPS and self.config.strategy != "fsdp":
            # An OOM inside the optimizer step may leave it half applied (AdamW updates its
            # moments in place before it allocates its temporaries): keep an undo copy in host
            # memory so that the window can be replayed from its start. Only the first steps
            # pay for it: the first creates the optimizer state, and from the second on the
            # step's memory is the same every time (the estimator traces exactly this). Not under
            # FSDP: a rank's shards alone cannot make a window-start checkpoint anyway.
            self._optimizer_undo = snapshot_optimizer(self.model, self.optimizer, self.scaler)
        clip = self.options.clip_mode
        if clip != "off":
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            norm = _clip_gradients(self.model, clip, float(self.options.grad_clip))  # type: ignore[arg-type]
            full = getattr(norm, "full_tensor", None)  # FSDP2: the norm over all shards, replicated
            grad_norm = float(full() if full is not None else norm)
            if self.scaler is None and not math.isfinite(grad_norm):
                # Without a scaler nobody else would stop inf gradients from reaching the weights.
                self.optimizer.zero_grad(set_to_none=True)
                return _WindowOutcome(loss_value, applied=False, nonfinite=True, grad_norm=grad_norm,
                                      seconds=time.perf_counter() - t0)
        self._monitor.capture(self.model, self.step + 1, grad_norm=grad_norm, clip=self.options.grad_clip)
        applied = _precision.optimizer_step(self.optimizer, self.scaler)
        self._optimizer_undo = None
        self.optimizer.zero_grad(set_to_none=True)  # gradients are dead weight until the next backward
        return _WindowOutcome(loss_value, applied=applied, scaler_skipped=not applied,
                              grad_norm=grad_norm, seconds=time.perf_counter() - t0, largest_batch=largest)

    # -- out-of-memory recovery ------------------------------------------------------------
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
            _seed_torch(_window_seed(self.options.seed, self.step, self.rank))
        if not self._recovering:
            self._reset_window_peak()  # so that the largest batch's step has its own peak
            return self._run_window(window, batches, self.config)
        # Undo state for a replay: buffers that forward updates in place (BatchNorm statistics)
        # and the RNG that dropout draws from, so that a replay sees what the first try saw.
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        saved_buffers = snapshot_tensors(buffers) if buffers else None
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
            phase, peak = self._phase, self._failure_peak()
            self._set_phase("recovery")
            undo, self._optimizer_undo = self._optimizer_undo, None
            self.optimizer.zero_grad(set_to_none=True)
            if undo is not None:  # the optimizer step may have been half applied
                restore_optimizer(self.model, self.optimizer, self.scaler, undo)
            intact = undo is not None or phase != "optimizer"  # else the step may be half applied
            del undo
            if saved_buffers is not None:
                restore_tensors(buffers, saved_buffers)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, self.device)
            free_memory(self.device, optimizer=self.optimizer)  # gc.collect(), torch.cuda.empty_cache()
            if self.distributed:
                self._fail_distributed(step=self.step + 1, phase=phase, peak=peak, message=message, intact=intact)
            self._step_down(step=self.step + 1, phase=phase, peak=peak, message=message, t0=t0)
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
            peak = self._failure_peak()
            self._set_phase("recovery")
            free_memory(self.device, optimizer=self.optimizer)
            if self.distributed:
                # The window is done and counted: the state is consistent; evaluate again on resume.
                self._fail_distributed(step=self.step, phase="evaluation", peak=peak, message=message, intact=True)
            self._step_down(step=self.step, phase="evaluation", peak=peak, message=message, t0=t0)

    def _reset_window_peak(self) -> None:
        """Start the peak anew for this attempt (so that an OOM reports the peak of the step that
        failed); the run's peak so far is kept in ``_peak_floor`` for the summary."""
        peak = self._peak_memory()
        if peak is not None:
            self._peak_floor = max(self._peak_floor or 0, peak)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif hasattr(self.memory_guard, "reset_peak"):
            self.memory_guard.reset_peak()  # type: ignore[union-attr]

    def _failure_peak(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        peak = getattr(self.memory_guard, "peak_bytes", None)
        return int(peak) if peak is not None else None

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
        event = RecoveryEvent(step=step, phase=phase, from_config=old.to_dict(), to_config=new.to_dict(),
                              peak_at_failure=peak, seconds=time.perf_counter() - t0, error=message or "",
                              skipped=[c.to_dict() for c in skipped])
        record = event.to_dict()
        self.recoveries.append(record)
        self._log({"type": "oom_recovery", **record})
        text = (f"out of memory at step {step} in {phase} with {old.describe()}"
                + (f" (peak {format_size(peak)})" if peak else "")
                + f"; replaying with {new.describe()}")
        log.warning("%s", text)
        bar = getattr(self, "_bar", None)
        if bar is not None and not bar.disable:
            bar.write(text)
            bar.set_postfix({"oom_recoveries": len(self.recoveries), "micro": new.micro_batch_size,
                             "accum": new.grad_accum_steps}, refresh=False)

    def _switch_config(self, new: TrainConfig) -> None:
        """Apply ``new`` (same global batch) to the running model, scaler and loaders."""
        old = self.config
        if new.global_batch != old.global_batch:
            raise ConfigError(f"cannot switch from global batch {old.global_batch} to {new.global_batch}")
        if new.checkpoint_segments > old.checkpoint_segments:
            # Idempotent per block: blocks checkpointed already stay so (only ever stepping down).
            _checkpoint.apply_checkpointing(self.model, new.checkpoint_segments, self.task.checkpoint_blocks)
            if self.options.compile:
                self.forward_model = torch.compile(self.model)  # type: ignore[assignment]
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
        where = (f"the last good checkpoint is {self.checkpoint_path} (step {self.last_checkpoint_step})"
                 if self.checkpoint_path.exists() else "no checkpoint could be written")
        budget = self._budget()
        measured = (f"measured peak at failure {format_size(peak)}" if peak is not None else "peak at failure unknown")
        if budget is not None:
            measured += f" of budget {format_size(budget)}"
        tried = "; ".join(t.describe() for t in self._tried)
        return TrainingError(
            f"ran out of memory at step {step} in {phase} with micro-batch {c.micro_batch_size}, "
            f"{c.grad_accum_steps} accumulation steps, {c.precision}, {c.checkpoint_segments} checkpoint segments"
            f" ({message}); no smaller configuration with the same global batch of {c.global_batch} is left "
            f"(tried: {tried}); {where}; {measured} -- raise --vram or reduce the model"
        )

    def _after_window(self, window: _Window, outcome: _WindowOutcome) -> None:
        """Advance the position and counters, step the schedule and EMA, log the step."""
        lr = self.schedule.get_last_lr()[0]  # the lr this step used
        self.step += 1
        self.samples_seen += window.global_items
        if window.end >= self.sampler.n_epoch:
            self.epoch, self.epoch_offset = self.epoch + 1, 0
        else:
            self.epoch_offset = window.end

        if outcome.nonfinite:
            self.skipped_steps += 1
            self.consecutive_nonfinite += 1
        else:
            self.consecutive_nonfinite = 0
            self.last_train_loss = outcome.loss
            # A step the GradScaler skipped still moves the schedule on (as Lightning does):
            # such skips happen while the scale calibrates and are not a training problem.
            self.schedule.step()
            if outcome.applied and self.ema is not None:
                self.ema.update(self.model)
            if outcome.scaler_skipped:
                self.scaler_skipped_steps += 1

        self._note_largest_batch(outcome)
        samples_per_s = window.global_items / outcome.seconds if outcome.seconds > 0 else None
        self._throughput.append((window.global_items, outcome.seconds))
        record: dict[str, Any] = {
            "type": "step", "step": self.step, "epoch": window.epoch,
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

        if self.consecutive_nonfinite >= self.options.max_nonfinite:
            raise self._nonfinite_error()

    def _nonfinite_error(self) -> TrainingError:
        where = (f"the last good checkpoint is {self.checkpoint_path} (step {self.last_checkpoint_step})"
                 if self.last_checkpoint_step is not None
                 else "no checkpoint was written before it (set checkpoint_every to keep one)")
        # fp16's narrow range overflows where bf16 and fp32 do not; a run already in bf16 or
        # fp32 has a NaN of its own making (the model, the data or the learning rate).
        fix = {"fp16-mixed": "lower the learning rate or use bf16-mixed/fp32 instead of fp16",
               "bf16-mixed": "lower the learning rate, or try fp32"}.get(
            self.config.precision, "lower the learning rate, and check the model's outputs and the data for NaN/inf")
        return TrainingError(
            f"loss was NaN/inf for {self.consecutive_nonfinite} consecutive steps at step {self.step}; {fix}; {where}"
        )

    def _note_largest_batch(self, outcome: _WindowOutcome) -> None:
        """Keep the largest micro-batch met so far (by tensor elements: padded items vary) and
        the peak of the step it was in, for the summary: how close the plan came."""
        if outcome.largest_batch is None:
            return
        elements, shapes = outcome.largest_batch
        if self.largest_batch is not None and elements <= self.largest_batch["elements"]:
            return
        self.largest_batch = {"step": self.step, "elements": elements, "shapes": shapes,
                              "peak_memory_bytes": self._window_peak()}
        self._log({"type": "largest_batch", **self.largest_batch})

    def _window_peak(self) -> int | None:
        """The peak since the window started (``_reset_window_peak``), without the run's floor."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        value = getattr(self.memory_guard, "peak_bytes", None)
        return int(value) if value is not None else None

    def _due(self, every: int | None, epoch_ended: bool) -> bool:
        return epoch_ended if every is None else self.step % every == 0

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss (mean over samples) and, with the default loss and class targets,
        accuracy (per token for ``(B, T, V)`` outputs). Uses the EMA weights when on."""
        self._set_phase("evaluation")
        assert self.val_loader is not None
        default = self.task.loss_fn is default_loss
        total_loss, total_weight, correct, counted = 0.0, 0, 0, 0
        # DDP: the module itself (its wrapper's forward would broadcast buffers, a collective that
        # ranks with fewer validation batches would not join). FSDP2: the sharded module, whose
        # forward all-gathers, so every rank runs as many forward passes (see the padding below).
        # Compiled single-device runs evaluate the compiled module.
        eval_model = self.model if self.distributed else self.forward_model
        self.model.eval()
        swap = self.ema.swapped_in(self.model) if self.ema is not None else contextlib.nullcontext()
        try:
            with swap:
                batches: Iterator[tuple[Batch, bool]] = ((b, True) for b in self.val_loader)
                if self.config.strategy == "fsdp":
                    batches = self._padded_val_batches()
                for batch, counts in batches:
                    batch = self._to_device(batch)
                    with _precision.forward_context(self.config.precision, self.device.type):
                        if default:
                            logits, targets = _logits_and_targets(eval_model, batch)
                            loss = F.cross_entropy(logits.float(), targets)
                        else:
                            loss = self.task.compute_loss(eval_model, batch)
                    if not counts:
                        continue  # a padding pass: it only keeps this rank in step with the others
                    if default and not targets.is_floating_point():
                        valid = targets != -100  # cross_entropy's ignore_index
                        n = int(valid.sum())
                        correct += int(((logits.argmax(dim=1) == targets) & valid).sum())
                        counted += n
                    else:
                        n = _batch_len(batch)
                    if n:
                        total_loss += float(loss) * n
                        total_weight += n
        finally:
            self.model.train()
        if self.distributed:
            # Each rank evaluated its share (items r::W): the metrics are of the sums over ranks.
            sums = torch.tensor([total_loss, total_weight, correct, counted], dtype=torch.float64, device=self._comm_device)
            dist.all_reduce(sums)
            total_loss, total_weight, correct, counted = sums[0].item(), int(sums[1].item()), int(sums[2].item()), int(sums[3].item())
        metrics = {"val_loss": total_loss / total_weight if total_weight else float("nan")}
        if counted:
            metrics["val_accuracy"] = correct / counted
        return metrics

    def _padded_val_batches(self) -> Iterator[tuple[Batch, bool]]:
        """This rank's validation batches, then as many padding passes (the first batch again,
        not counted) as it takes to match the rank with the most batches."""
        assert self.val_loader is not None
        n_val = len(self.val_loader.dataset)  # type: ignore[arg-type]
        most = math.ceil(math.ceil(n_val / self.world_size) / self.config.micro_batch_size)
        first, seen = None, 0
        for batch in self.val_loader:
            if first is None:
                first = batch
            seen += 1
            yield batch, True
        if first is None:  # fewer items than ranks: this rank has none
            first = self.task.collate([self.val_loader.dataset[0]])  # type: ignore[index]
        for _ in range(most - seen):
            yield first, False

    def _evaluate_and_track(self) -> None:
        metrics = self._evaluate_recovering()
        self.last_metrics, self.last_eval_step = metrics, self.step
        if self.options.monitor not in metrics:
            raise ConfigError(
                f"monitor {self.options.monitor!r} is not a validation metric of {self.task.name}; "
                f"available: {', '.join(sorted(metrics))}"
            )
        value = metrics[self.options.monitor]
        improved = math.isfinite(value) and (
            self.best_metric is None
            or (value < self.best_metric if self.options.mode == "min" else value > self.best_metric)
        )
        # Early stopping's own yardstick: only a gain of more than min_delta over the value of
        # the last such gain resets the patience (the best weights follow every gain).
        delta = self.options.early_stopping_min_delta
        significant = math.isfinite(value) and (
            self.stop_reference is None
            or (value < self.stop_reference - delta if self.options.mode == "min"
                else value > self.stop_reference + delta)
        )
        if significant:
            self.stop_reference, self.bad_evaluations = value, 0
        else:
            self.bad_evaluations += 1
        if improved:
            self.best_metric, self.best_step, self.best_metrics = value, self.step, dict(metrics)
            # Best weights go to disk, not to RAM: no second copy of the model stays alive.
            best = self._eval_state_dict()
            if self.is_main:
                save_checkpoint(best, self.best_path)
            del best
        self.schedule.observe(value)
        patience = self.options.early_stopping_patience
        if patience is not None and self.bad_evaluations >= patience:
            self.stopped_early = True
        self._log({"type": "eval", "step": self.step, "epoch": self.epoch, **metrics,
                   "best": self.best_metric, "improved": improved})
        if not self._bar.disable:
            self._bar.write(f"step {self.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
                            + (" (best)" if improved else ""))

    def _finish_evaluation(self) -> None:
        """The run's last evaluation, unless the last window was just evaluated."""
        if self.val_loader is not None and self.last_eval_step != self.step:
            self._evaluate_and_track()

    def _eval_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights that are evaluated and written: the EMA's when on, else the model's. Full
        tensors on every rank (FSDP2 gathers its shards: every rank must call this)."""
        state = _full_tensors(self.model.state_dict())
        if self.ema is not None:
            state.update(_full_tensors(self.ema.shadow))
        return state

    def _load_full_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Full (unsharded) weights into the model, whatever its strategy."""
        if self.config.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, dict(state), options=StateDictOptions(full_state_dict=True))
        else:
            self.model.load_state_dict(state)

    # -- checkpoints -----------------------------------------------------------------------
    def _save_checkpoint(self, *, collective: bool = True, pending_evaluation: bool = False) -> None:
        """``checkpoint.pt``; under FSDP2 with the sharded tensors in a ``torch.distributed.checkpoint``
        folder beside it. ``collective=False``: this rank alone writes it (a DDP rank after an
        OOM, whose replicated state is that of every rank; the others cannot be reached)."""
        self._set_phase("checkpoint")
        self._flush_log()  # a resume continues from here: the lines before it must be on disk
        finite = _all_finite(self.model)
        if collective:
            finite = self._agree(finite)  # FSDP: each rank checked its own shards
        if not finite:
            raise TrainingError(
                f"the weights became NaN/inf by step {self.step}; not overwriting the last good "
                f"checkpoint {self.checkpoint_path}; lower the learning rate, set grad_clip, or use "
                "bf16/fp32 instead of fp16"
            )
        sharded = self.config.strategy == "fsdp"
        if collective and not sharded and not self.is_main:
            self.last_checkpoint_step = self.step  # DDP: rank 0 writes the replicated state
            return
        dcp_dir = self._save_sharded() if sharded else None
        if not self.is_main and collective:
            self.last_checkpoint_step = self.step
            return
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "epoch": self.epoch,
            "epoch_sample_offset": self.epoch_offset,
            "epoch_micro_batches": math.ceil(self.epoch_offset / self.config.micro_batch_size),
            "n_train": self.n_train,
            # FSDP2: the tensors are in dcp_dir (resharded on load, at any world size).
            "model": None if sharded else self.model.state_dict(),
            "optimizer": None if sharded else self.optimizer.state_dict(),
            "dcp": dcp_dir,
            "world_size": self.world_size,
            "pending_evaluation": pending_evaluation,
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "ema": self.ema.state_dict() if self.ema is not None and not sharded else None,
            "rng": _rng_state(),
            "config": self.config.to_dict(),
            "options": self.options.to_dict(),
            "task": {"name": self.task.name, "source_hash": self.task.source_hash},
            # OOM recovery: "config" above is the configuration running now (the one that worked).
            "recovery": {"recoveries": list(self.recoveries),
                         "ladder": [c.to_dict() for c in self.ladder],
                         "tried": [c.to_dict() for c in self._tried]},
            "best": {
                "metric": self.best_metric, "step": self.best_step, "metrics": self.best_metrics,
                "path": str(self.best_path) if self.best_step is not None else None,
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
        save_checkpoint(state, self.checkpoint_path, keep_previous=True)
        self.last_checkpoint_step = self.step
        if dcp_dir is not None:
            # The kept previous checkpoint.pt points at its own folder: that one stays too.
            keep = {Path(dcp_dir).name} | ({Path(self._last_dcp).name} if self._last_dcp else set())
            remove_stale_sharded(self.out_dir / SHARDED_DIR, keep=keep)
            self._last_dcp = dcp_dir

    def _save_sharded(self) -> str:
        """Every rank writes its shards into a fresh folder (a temporary name, renamed when all
        are done); ``checkpoint.pt``, written afterwards, points at it."""
        token = [f"step-{self.step:08d}-{os.urandom(4).hex()}" if self.is_main else None]
        dist.broadcast_object_list(token, src=0)  # one name for all ranks
        name = str(token[0])
        root = self.out_dir / SHARDED_DIR
        tmp, final = root / f".{name}.tmp", root / name
        if self.is_main:
            root.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        save_sharded(self.model, self.optimizer, tmp, extra=self._sharded_extra())
        dist.barrier()  # every rank's shards are on disk
        if self.is_main:
            os.replace(tmp, final)
        return f"{SHARDED_DIR}/{name}"

    def _sharded_extra(self) -> dict[str, Any]:
        return {"ema": self.ema.shadow} if self.ema is not None else {}

    def _resume(self) -> int | None:
        """Load ``checkpoint.pt`` if there is one; returns its step (None: fresh start)."""
        if not self.checkpoint_path.exists() and not previous_path(self.checkpoint_path).exists():
            log.info("no checkpoint at %s; starting from scratch", self.checkpoint_path)
            return None
        ckpt, source, passed_over = load_latest_checkpoint(self.checkpoint_path, map_location=self.device)
        if passed_over is not None:
            log.warning("%s; resuming from %s (step %s)", passed_over, source, ckpt.get("step"))
        try:
            return self._restore(ckpt)
        except KeyError as exc:
            raise DamagedCheckpointError(
                f"{source} lacks {exc}: not a checkpoint of this memplan; train into another --out") from None

    def _restore(self, ckpt: dict[str, Any]) -> int:
        saved = TrainConfig.from_dict(ckpt["config"])
        if saved.global_batch != self.config.global_batch:
            raise ConfigError(
                f"{self.checkpoint_path} was trained with a global batch of {saved.global_batch}, this "
                f"config has {self.config.global_batch}; resume with the same micro_batch_size x "
                "grad_accum_steps product, or use another out_dir"
            )
        if saved.length_grouped != self.config.length_grouped:
            raise ConfigError(
                f"{self.checkpoint_path} was trained with length_grouped={saved.length_grouped}; resume with "
                "the same data order (length_grouped), or use another out_dir")
        if ckpt["options"]["seed"] != self.options.seed or ckpt["n_train"] != self.n_train:
            raise ConfigError(
                f"{self.checkpoint_path} was written with seed {ckpt['options']['seed']} and "
                f"{ckpt['n_train']} training items; resuming needs the same seed and data "
                f"(got seed {self.options.seed}, {self.n_train} items)"
            )
        if bool(ckpt["options"].get("drop_last", False)) != self.options.drop_last:
            raise ConfigError(
                f"{self.checkpoint_path} was written with drop_last={ckpt['options'].get('drop_last', False)}; "
                "an epoch's length depends on it: resume with the same drop_last, or use another out_dir")
        if ckpt["task"]["source_hash"] != self.task.source_hash:
            log.warning("%s changed since the checkpoint was written", self.task.name)
        recovery = ckpt.get("recovery") or {}
        if recovery.get("recoveries") and self._decided is None:
            # The run stepped down after an OOM: continue on the configuration that worked, with
            # the rungs that were still below it.
            self.recoveries = list(recovery["recoveries"])
            self._tried = [TrainConfig.from_dict(c) for c in recovery.get("tried", [])] or [saved]
            if saved in self.ladder:
                self.ladder = self.ladder[self.ladder.index(saved) + 1:]
            else:
                self.ladder = [TrainConfig.from_dict(c) for c in recovery.get("ladder", [])]
            if saved != self.config:
                log.warning("resuming on %s, the configuration an OOM recovery switched to", saved.describe())
                self._switch_config(saved)
        if ckpt.get("dcp"):
            self._last_dcp = ckpt["dcp"]
            # Written by an FSDP2 run: DCP reshards the tensors to this run's layout -- another
            # world size, or one plain process.
            load_sharded(self.model, self.optimizer, self.out_dir / ckpt["dcp"], extra=self._sharded_extra())
        elif self.config.strategy == "fsdp":
            raise ConfigError(
                f"{self.checkpoint_path} is a single-file checkpoint (a single-device or DDP run); an FSDP run "
                "resumes from FSDP checkpoints only; resume it with strategy 'ddp' or 'single', or use another out_dir"
            )
        else:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        self.schedule.load_state_dict(ckpt["schedule"])  # after the optimizer: it sets the lr
        if self.scaler is not None and ckpt["scaler"] is not None:
            self.scaler.load_state_dict(ckpt["scaler"])
        if self.ema is not None and ckpt["ema"] is not None:
            self.ema.load_state_dict(ckpt["ema"])
        self._pending_evaluation = bool(ckpt.get("pending_evaluation")) and self.val_loader is not None
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
        self.last_checkpoint_step = self.step
        # Last: building the model and loaders above drew from the RNGs.
        _set_rng_state(ckpt["rng"])
        return int(self.step)

    # -- distributed runs ------------------------------------------------------------------
    @property
    def _comm_device(self) -> torch.device:
        """Where small tensors for collectives live: gloo reduces CPU tensors, NCCL CUDA ones."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _agree(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on every rank (one process: ``flag``)."""
        if not self.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _agree_stop(self) -> bool:
        """Stop at this window boundary? All ranks stop together when any got SIGINT/SIGTERM, so
        that they write one checkpoint and none waits alone in the next step's collectives."""
        return not self._agree(self._stop_signal is None)

    def _max_over_ranks(self, value: int | None) -> int | None:
        if not self.distributed:
            return value
        t = torch.tensor([-1 if value is None else int(value)], dtype=torch.int64, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return None if int(t.item()) < 0 else int(t.item())

    def _fail_distributed(self, *, step: int, phase: str, peak: int | None, message: str | None,
                          intact: bool) -> NoReturn:
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
            rank=self.rank, step=step, phase=phase, config=self.config.to_dict(), peak_at_failure=peak,
            budget=self._budget(), error=message or "", time=time.time(),
            resume_step=self.step if written else self.last_checkpoint_step, window_start_checkpoint=written,
        )
        record.write(self.out_dir)
        raise DistributedOOM(
            f"rank {self.rank} ran out of memory at step {step} in {phase} with {self.config.describe()}; "
            + ("a checkpoint of the window's start was written" if written else
               f"resuming from the last checkpoint (step {self.last_checkpoint_step})")
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
            text = (f"out of memory at step {event['step']} in {event['phase']} with {old.describe()}"
                    + (f" (peak {format_size(event['peak_at_failure'])})" if event.get("peak_at_failure") else "")
                    + f"; all ranks replay from step {self.step + 1} with {new.describe()}")
            log.warning("%s", text)
            if not self._bar.disable:
                self._bar.write(text)

    # -- the end ---------------------------------------------------------------------------
    def _write_result_weights(self) -> None:
        """``model.pt``: the best weights with early stopping, else the final ones (EMA if on).
        ``self.model`` is left holding them."""
        if self.options.early_stopping_patience is not None and self.best_step is not None and self.best_path.exists():
            state = load_checkpoint(self.best_path, map_location=self.device)
            self.last_metrics = dict(self.best_metrics)
        else:
            state = self._eval_state_dict()
        self._load_full_state(state)
        if self.is_main:
            save_checkpoint(state, self.model_path)

    def _summary(self, wall_s: float, interrupted: bool, resumed_from: int | None) -> dict[str, Any]:
        items = sum(n for n, _ in self._throughput)
        seconds = sum(s for _, s in self._throughput)
        peak = self._max_over_ranks(self._peak_memory())  # the fullest device's
        predicted = self.options.predicted_peak_bytes
        final_metrics: dict[str, float] = {}
        if self.last_train_loss is not None:
            final_metrics["train_loss"] = self.last_train_loss
        final_metrics.update(self.last_metrics)
        summary: dict[str, Any] = {
            "task": self.task.name,
            "config": self.config.to_dict(),
            "options": self.options.to_dict(),
            "device": str(self.device),
            "world_size": self.world_size,
            "torch": torch.__version__,
            "steps": self.step,
            "total_steps": self.total_steps,
            "epochs_completed": self.epoch,
            "samples_seen": self.samples_seen,
            "wall_s": wall_s,
            "samples_per_s": items / seconds if seconds > 0 else None,
            "interrupted": interrupted,
            "stop_signal": self._stop_signal,
            "stopped_early": self.stopped_early,
            "resumed_from_step": resumed_from,
            "recoveries": list(self.recoveries),
            "skipped_steps": self.skipped_steps,
            "scaler_skipped_steps": self.scaler_skipped_steps,
            "monitor": self.options.monitor,
            "best_metric": self.best_metric,
            "best_step": self.best_step,
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

    # -- small helpers ---------------------------------------------------------------------
    def _to_device(self, batch: Batch) -> Batch:
        if self.device.type == "cpu":
            return batch
        non_blocking = self.device.type == "cuda"  # the loader pins memory on CUDA
        return tree_map(lambda t: t.to(self.device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t, batch)

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

    def _progress_bar(self) -> Any:
        from tqdm.auto import tqdm

        # disable=None lets tqdm hide the bar when stderr is not a terminal (CI logs, files).
        return tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                    disable=None if self.options.progress and self.is_main else True)

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM set a flag; the loop checkpoints at the next window boundary and
        returns. A second SIGINT stops at once (KeyboardInterrupt), as people expect of Ctrl-C."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return

        def handler(signum: int, frame: Any) -> None:
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_signal = signal.Signals(signum).name

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old if old is not None else signal.SIG_DFL)


# ----------------------------------------------------------------------------------------------
# Module helpers
# ----------------------------------------------------------------------------------------------

def _ladder_configs(ladder: Sequence[Any] | None, config: TrainConfig) -> list[TrainConfig]:
    """``Plan.ladder()`` entries or configs -> the configs with ``config``'s global batch, in order."""
    out: list[TrainConfig] = []
    for rung in ladder or ():
        c = getattr(rung, "config", rung)
        if isinstance(c, Mapping):
            c = TrainConfig.from_dict(dict(c))
        if not isinstance(c, TrainConfig):
            raise ConfigError(f"ladder entries must be TrainConfig or PlanEntry, got {type(rung).__name__}")
        if c.global_batch == config.global_batch and c != config and c not in out:
            out.append(c)
    return out


def _clip_gradients(model: nn.Module, mode: Literal["norm", "value"], threshold: float) -> torch.Tensor:
    """Clip in place; returns the global gradient norm before clipping (logged either way)."""
    if mode == "norm":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), threshold)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    torch.nn.utils.clip_grad_value_(model.parameters(), threshold)
    return norm


def _logits_and_targets(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The default loss's view of a batch (one definition, shared with the estimator)."""
    return default_logits_and_targets(model, batch)


def _batch_size_of(batch: Batch) -> tuple[int, list[list[int]]]:
    """(tensor elements, tensor shapes) of a batch."""
    from torch.utils._pytree import tree_flatten
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    return sum(t.numel() for t in tensors), [list(t.shape) for t in tensors]


def _batch_len(batch: Batch) -> int:
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def _all_finite(model: nn.Module) -> bool:
    flags = [torch.isfinite(p).all() for p in model.parameters() if p.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def _full_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies; FSDP2's sharded DTensors gathered into full tensors (a collective)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        full = getattr(v, "full_tensor", None)
        out[k] = (full() if full is not None else v).detach().clone()
    return out


def _seed_torch(seed: int) -> None:
    torch.manual_seed(seed)  # seeds every CUDA device too


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    """Every global RNG the model can draw from, as plain data (loadable with weights_only)."""
    np_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": random.getstate(),
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state({
        "bit_generator": n["bit_generator"],
        "state": {"key": n["key"].cpu().numpy().astype(np.uint32), "pos": n["pos"]},
        "has_gauss": n["has_gauss"], "gauss": n["gauss"],
    })
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


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
