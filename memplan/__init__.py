"""memplan: the fastest way to train a PyTorch model on a GPU without running out of memory.

>>> import memplan
>>> est = memplan.estimate("examples/digits.py", batch_size=64)   # doctest: +SKIP
"""

from __future__ import annotations

from estimators import (
    ConfigError, Estimate, Estimator, MemplanError, ModelFileError, NoFeasiblePlanError, Task,
    TrainConfig, TrainingError, estimate, format_size, load_task, parse_size,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "Estimate", "Estimator", "MemplanError", "ModelFileError", "NoFeasiblePlanError",
    "Task", "TrainConfig", "TrainingError", "estimate", "format_size", "load_task", "parse_size",
    "__version__",
]
