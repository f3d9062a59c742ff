"""memplan: the fastest way to train a PyTorch model on a GPU without running out of memory.

>>> import memplan
>>> est = memplan.estimate("examples/digits.py", batch_size=64)   # doctest: +SKIP
"""

from __future__ import annotations

from estimators import (
    ConfigError,
    Estimate,
    Estimator,
    MemplanError,
    ModelFileError,
    NoFeasiblePlanError,
    Task,
    TrainConfig,
    TrainingError,
    estimate,
    format_size,
    load_task,
    parse_size,
)

from . import nn as nn  # memplan.nn: init_weights and DropPath for model files
from ._fit import fit, train_plan  # noqa: E402
from ._version import __version__
from .diagnostics._doctor import doctor  # noqa: E402
from .diagnostics._lr_find import lr_find  # noqa: E402
from .planning import Plan, PlanEntry, SearchInterrupted, search  # noqa: E402
from .training import LaunchSpec, Trainer, TrainOptions, TrainResult, keep_global_batch, launch_training, train  # noqa: E402,I001

__all__ = [
    "ConfigError",
    "Estimate",
    "Estimator",
    "MemplanError",
    "ModelFileError",
    "NoFeasiblePlanError",
    "Task",
    "TrainConfig",
    "TrainingError",
    "estimate",
    "format_size",
    "load_task",
    "parse_size",
    "LaunchSpec",
    "Plan",
    "PlanEntry",
    "SearchInterrupted",
    "TrainOptions",
    "TrainResult",
    "Trainer",
    "fit",
    "keep_global_batch",
    "search",
    "train",
    "train_plan",
    "launch_training",
    "doctor",
    "lr_find",
    "__version__",
]
