"""How to train: :class:`TrainOptions` and its checks (the *what* is the ``TrainConfig``).

``memplan._option_sources`` reads the fields and their docstrings to make the command-line flags,
the config-file keys and the README's table, so the fields stay one flat dataclass: grouping
them into nested dataclasses would change every flag and key that is derived from a name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from estimators import ConfigError, StepOptions
from estimators.task._settings import DEFAULT_EPOCHS

from ._schedules import SCHEDULE_ARGS, SCHEDULES, ScheduleName

__all__ = ["TrainOptions", "DEFAULT_EPOCHS"]



@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    """How to train (the *what*, micro-batch/precision/…, is the ``TrainConfig``)."""

    epochs: int | None = None
    """Passes over the training data. With neither ``epochs`` nor ``max_steps``, the model
    file's ``settings["epochs"]``/``settings["max_steps"]`` are used, else ``DEFAULT_EPOCHS``
    (3, the Hugging Face Trainer's default); ``training_length`` resolves it."""
    max_steps: int | None = None
    """Optimizer steps. With ``epochs`` too, whichever comes first ends the run."""
    lr: float | None = None
    """Peak learning rate for every parameter group. ``None``: ``settings["lr"]`` of the model
    file, else the optimizer's own lr per group; ``auto`` (command line, config, settings):
    memplan lr-find's suggestion for the chosen plan."""
    schedule: ScheduleName | None = None
    """Learning-rate schedule, stepped once per optimizer step.
    One of cosine, onecycle, step, multistep, exponential, cosine_restarts, plateau, constant
    (see :mod:`memplan.training._schedules`). ``None``: the model file's ``scheduler(optimizer,
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
    """Continue from ``out_dir/checkpoint.pt`` if it exists (else start afresh, with a warning).
    Without it, a folder holding another run's results is refused (see ``overwrite``)."""
    overwrite: bool = False
    """Start afresh in an ``out_dir`` that holds another run's results, deleting them first
    (its checkpoints, weights, metrics, summary and report)."""
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
        if self.resume and self.overwrite:
            raise ConfigError(f"resume (continue the run in {self.out_dir}) and overwrite (replace it) contradict "
                              "each other; give one of them")
        if self.max_nonfinite < 1:
            raise ConfigError(f"TrainOptions.max_nonfinite must be >= 1, got {self.max_nonfinite!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ConfigError(f"TrainOptions.device {self.device!r} is not a device; use 'cpu' or 'cuda'") from None
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"TrainOptions.device {self.device!r}: the trainer runs on 'cpu' or 'cuda'")

    def training_length(self, settings: Mapping[str, Any]) -> tuple[int | None, int | None]:
        """(epochs, max_steps) of the run: these options', else the model file's ``settings``'
        (``epochs``/``max_steps``), else ``DEFAULT_EPOCHS`` epochs; with both, whichever comes
        first ends the run."""
        if self.epochs is not None or self.max_steps is not None:
            return self.epochs, self.max_steps
        epochs, max_steps = settings.get("epochs"), settings.get("max_steps")
        if epochs is None and max_steps is None:
            return DEFAULT_EPOCHS, None
        return (None if epochs is None else int(epochs)), (None if max_steps is None else int(max_steps))

    def with_length(self, settings: Mapping[str, Any]) -> TrainOptions:
        """These options with the run's length set (``training_length``), so that whatever
        trains them trains as long."""
        epochs, max_steps = self.training_length(settings)
        if (epochs, max_steps) == (self.epochs, self.max_steps):
            return self
        return replace(self, epochs=epochs, max_steps=max_steps)

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

    def step_options(self) -> StepOptions:
        """What of these options the training step runs (clipping, EMA, label smoothing): the
        step the estimate is made of (``Task.with_step``)."""
        return StepOptions(clip=self.clip_mode, clip_threshold=float(self.grad_clip or 1.0),
                           ema_decay=self.ema_decay, label_smoothing=float(self.label_smoothing or 0.0),
                           compile=bool(self.compile))

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
        (
            "milestones",
            o.milestones is None
            or (
                isinstance(o.milestones, tuple)
                and len(o.milestones) > 0
                and all(_whole(m, 1) for m in o.milestones)
                and list(o.milestones) == sorted(set(o.milestones))
            ),
            "increasing whole numbers >= 1",
        ),
        ("t_0", o.t_0 is None or _whole(o.t_0, 1), "a whole number >= 1"),
        ("t_mult", o.t_mult is None or _whole(o.t_mult, 1), "a whole number >= 1"),
        ("min_lr", o.min_lr is None or (_number(o.min_lr) and o.min_lr >= 0), "a number >= 0"),
        ("pct_start", o.pct_start is None or (_number(o.pct_start) and 0 < o.pct_start < 1), "in (0, 1)"),
        ("anneal_strategy", o.anneal_strategy in (None, "cos", "linear"), "'cos' or 'linear'"),
        ("cycle_momentum", isinstance(o.cycle_momentum, bool), "true or false"),
        (
            "base_momentum",
            o.base_momentum is None or (_number(o.base_momentum) and 0 <= o.base_momentum < 1),
            "in [0, 1)",
        ),
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
                raise ConfigError(
                    f"TrainOptions.{field_name} applies to schedule {users}, not {name!r}; "
                    f"set schedule or leave {field_name} unset"
                )
            if field_name in (o.schedule_args or {}):
                raise ConfigError(f"TrainOptions.{field_name} is also in schedule_args; set it once")
    unknown = sorted(set(o.schedule_args or {}) - set(takes))
    if unknown:
        raise ConfigError(
            f"TrainOptions.schedule_args {unknown} are not arguments of schedule {name!r}; "
            f"it takes: {', '.join(takes) or 'none'}"
        )
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
        (
            "early_stopping_min_delta",
            _number(o.early_stopping_min_delta) and o.early_stopping_min_delta >= 0,
            "a number >= 0",
        ),
        ("grad_clip_mode", o.grad_clip_mode in ("norm", "value", "off"), "'norm', 'value' or 'off'"),
        ("scaler_init_scale", _number(o.scaler_init_scale) and o.scaler_init_scale > 0, "a number > 0"),
        ("scaler_growth_factor", _number(o.scaler_growth_factor) and o.scaler_growth_factor > 1, "a number > 1"),
        ("scaler_backoff_factor", _number(o.scaler_backoff_factor) and 0 < o.scaler_backoff_factor < 1, "in (0, 1)"),
        ("scaler_growth_interval", _whole(o.scaler_growth_interval, 1), "a whole number >= 1"),
        ("num_workers", o.num_workers is None or _whole(o.num_workers, 0), "a whole number >= 0 or None"),
        ("prefetch_factor", _whole(o.prefetch_factor, 1), "a whole number >= 1"),
        ("pin_memory", o.pin_memory is None or isinstance(o.pin_memory, bool), "true, false or None"),
        (
            "persistent_workers",
            o.persistent_workers is None or isinstance(o.persistent_workers, bool),
            "true, false or None",
        ),
        ("drop_last", isinstance(o.drop_last, bool), "true or false"),
    ]
    for name, ok, what in checks:
        if not ok:
            raise ConfigError(f"TrainOptions.{name} must be {what}, got {getattr(o, name)!r}")
    if o.early_stopping_min_delta and o.early_stopping_patience is None:
        raise ConfigError("TrainOptions.early_stopping_min_delta needs early_stopping_patience; set it")
    if o.persistent_workers and o.num_workers == 0:
        raise ConfigError("TrainOptions.persistent_workers needs worker processes; set num_workers >= 1")
