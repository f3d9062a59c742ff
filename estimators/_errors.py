"""The one exception hierarchy of memplan.

Every error a user can cause derives from :class:`MemplanError`; the CLI turns each into a
single line on stderr and exit code 2. Messages name the problem *and* the fix.
"""

from __future__ import annotations

__all__ = [
    "MemplanError",
    "ConfigError",
    "ModelFileError",
    "UnknownGPUError",
    "NoFeasiblePlanError",
    "ProbeError",
    "TrainingError",
]


class MemplanError(Exception):
    """Base class of every error memplan raises on purpose."""


class ConfigError(MemplanError, ValueError):
    """A configuration value is out of range or unknown (batch size, precision, size string)."""


class ModelFileError(MemplanError):
    """A model file (or an in-memory task) breaks the model-file contract."""


class UnknownGPUError(ConfigError):
    """A ``--gpu`` name that is not in the spec table."""


class NoFeasiblePlanError(MemplanError):
    """Nothing in the search space fits the memory budget.

    ``nearest`` is the configuration that came closest (an ``estimators.Estimate``) and
    ``needed_bytes`` what it needs; the message says what would make it fit.
    """

    def __init__(self, message: str, *, nearest: object = None, needed_bytes: int | None = None,
                 budget_bytes: int | None = None) -> None:
        super().__init__(message)
        self.nearest = nearest
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes


class ProbeError(MemplanError):
    """A probe subprocess crashed, hung or could not start (not an OOM: that is a result)."""


class TrainingError(MemplanError):
    """Training stopped for a reason the user must act on (repeated NaN losses, ladder exhausted)."""
