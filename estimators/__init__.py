"""Prediction only: memory and time of PyTorch training configurations, static and probed.

Knows nothing of search or training loops; applies precision and checkpointing through the
same helpers the trainer uses (``estimators.precision``, ``estimators.checkpointing``).
"""

from __future__ import annotations

from ._config import PRECISIONS, Precision, Strategy, TrainConfig, normalize_precision
from ._errors import (
    ConfigError, MemplanError, ModelFileError, NoFeasiblePlanError, ProbeError, TrainingError,
    UnknownGPUError,
)
from ._estimate import Estimate, Estimator, estimate, resolve_target
from ._shapes import grouped_order
from ._task import default_logits_and_targets, default_loss
from .probing._probe import is_oom_error
from .runtime import _checkpoint as checkpointing, _parallel as parallel, _precision as precision
from .runtime._guard import MemoryGuard
from ._gpus import GPUSpec, detect_local_gpu, get_gpu, gpu_names
from ._task import Task, load_task
from ._units import format_size, parse_count, parse_size

__all__ = [
    "PRECISIONS", "Precision", "Strategy", "TrainConfig", "normalize_precision",
    "ConfigError", "MemplanError", "ModelFileError", "NoFeasiblePlanError", "ProbeError",
    "TrainingError", "UnknownGPUError",
    "Estimate", "Estimator", "estimate", "resolve_target",
    "GPUSpec", "detect_local_gpu", "get_gpu", "gpu_names",
    "Task", "load_task",
    "format_size", "parse_count", "parse_size",
    # for memplan's trainer: the step's techniques and what the trainer shares with the estimator
    "checkpointing", "parallel", "precision", "MemoryGuard", "is_oom_error", "grouped_order",
    "default_logits_and_targets", "default_loss",
]
