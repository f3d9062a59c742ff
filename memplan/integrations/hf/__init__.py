"""Hugging Face ``transformers``: the plan as ``TrainingArguments`` keywords, and a callback
that checks and reports the plan inside its ``Trainer`` (needs ``memplan[hf]``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._export import training_args

__all__ = ["training_args", "MemplanCallback"]

if TYPE_CHECKING:
    from ._callback import MemplanCallback


def __getattr__(name: str) -> Any:
    if name == "MemplanCallback":
        from ._callback import MemplanCallback
        return MemplanCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
