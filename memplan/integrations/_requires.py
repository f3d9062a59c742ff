"""The one-line install hint of an optional extra that is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str, what: str) -> ModuleType:
    """``module`` imported, or an ImportError that names ``what`` needs it and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{what} needs {module.split('.')[0]}, which is not installed; pip install 'memplan[{extra}]'"
        ) from exc
