"""Prediction only: memory and time of PyTorch training configurations, static and probed.

Knows nothing of search or training loops, but owns the training step itself
(``train_step`` and its techniques, in :mod:`estimators.runtime`): the trace records it, the
probes time it and memplan's trainer runs it, so that what is predicted is what runs.

Layers (sub-packages): ``runtime`` (the step and its techniques), ``tracing`` (recording a
step), ``memory`` (from a trace to bytes), ``timing`` (from a trace to seconds), ``probing``
(real steps in a child process). This module is the public surface memplan uses.
"""

from __future__ import annotations

from ._config import CHECKPOINT_POLICIES, PRECISIONS, Precision, Strategy, TrainConfig, normalize_precision
from ._errors import (
    ConfigError,
    MemplanError,
    ModelFileError,
    NoFeasiblePlanError,
    ProbeError,
    TrainingError,
    UnknownGPUError,
)
from ._step_options import StepOptions
from ._units import format_size, parse_count, parse_size
from .estimator._estimate import BatchShapes, Estimate, Estimator, ShapePeak, estimate, resolve_target
from .estimator._snapshot import write_snapshot
from .estimator._timeline import Timeline, predicted_timeline
from .hardware._gpus import GPUSpec, detect_local_gpu, get_gpu, gpu_names
from .probing._probe import prestart, probe
from .probing._race import race
from .runtime._build import BuiltModel, build_for_training, checkpoint_more
from .runtime._checkpoint import max_checkpoint_segments, recomputes_more
from .runtime._ema import EMA
from .runtime._guard import MemoryGuard
from .runtime._oom import is_oom_error
from .runtime._precision import (
    StepPrecision,
    backward,
    convert_input,
    forward_context,
    make_grad_scaler,
    optimizer_step,
    weight_dtype,
)
from .runtime._step import StepHooks, StepParts, StepResult, make_optimizer, to_device, train_step, training_loss
from .task._hf import hf_task, is_hf_source, load_source
from .task._shapes import grouped_order
from .task._task import Task, default_logits_and_targets, default_loss, load_task
from .tracing._recorder import Category
from .tracing._simulated_ranks import fsdp_units

__all__ = [
    # configurations, tasks, errors, units
    "CHECKPOINT_POLICIES", "PRECISIONS", "Precision", "Strategy", "TrainConfig", "normalize_precision",
    "ConfigError", "MemplanError", "ModelFileError", "NoFeasiblePlanError", "ProbeError",
    "TrainingError", "UnknownGPUError",
    "Task", "load_task", "load_source", "hf_task", "is_hf_source", "default_logits_and_targets", "default_loss", "grouped_order",
    "format_size", "parse_count", "parse_size",
    # the estimate, the target, probes and races
    "Estimate", "Estimator", "estimate", "resolve_target", "BatchShapes", "ShapePeak",
    "GPUSpec", "detect_local_gpu", "get_gpu", "gpu_names",
    "prestart", "probe", "race",
    "write_snapshot", "Timeline", "predicted_timeline", "Category",
    # the training step and its techniques
    "train_step", "make_optimizer", "to_device", "StepHooks", "StepParts", "StepResult", "StepOptions", "training_loss",
    "build_for_training", "BuiltModel", "checkpoint_more", "max_checkpoint_segments", "recomputes_more", "EMA",
    "backward", "convert_input", "forward_context", "make_grad_scaler", "optimizer_step", "weight_dtype",
    "StepPrecision",
    "fsdp_units",
    "MemoryGuard", "is_oom_error",
]
