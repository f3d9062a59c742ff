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
from ._gpus import GPUSpec, detect_local_gpu, get_gpu, gpu_names
from ._task import Task, load_task
from ._units import format_size, parse_count, parse_size
# What memplan's search, plots, lr-find and fit use beyond the estimate itself.
from .memory._snapshot import write_snapshot
from .memory._timeline import Timeline, predicted_timeline
from .probing._probe import prestart, probe
from .probing._race import race
from .runtime._checkpoint import max_checkpoint_segments
from .runtime._guard import MemoryGuard
from .runtime._precision import backward, forward_context, make_grad_scaler, optimizer_step
from .tracing._recorder import Category

__all__ = [
    "PRECISIONS", "Precision", "Strategy", "TrainConfig", "normalize_precision",
    "ConfigError", "MemplanError", "ModelFileError", "NoFeasiblePlanError", "ProbeError",
    "TrainingError", "UnknownGPUError",
    "Estimate", "Estimator", "estimate", "resolve_target",
    "GPUSpec", "detect_local_gpu", "get_gpu", "gpu_names",
    "Task", "load_task",
    "format_size", "parse_count", "parse_size",
    "write_snapshot", "Timeline", "predicted_timeline", "prestart", "probe", "race", "max_checkpoint_segments",
    "MemoryGuard", "backward", "forward_context", "make_grad_scaler", "optimizer_step", "Category",
]
