"""PyTorch Lightning: the plan as ``Trainer`` keywords, and a callback that sets the batch
size and accumulation from the plan and reports it (needs ``memplan[lightning]``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._export import trainer_kwargs

__all__ = ["trainer_kwargs", "MemplanCallback"]

if TYPE_CHECKING:
    from ._callback import MemplanCallback


def __getattr__(name: str) -> Any:
    if name == "MemplanCallback":
        from ._callback import MemplanCallback
        return MemplanCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
