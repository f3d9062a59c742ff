"""The plan handed to the trainers people already use, and memplan inside their loops.

One public module per tool, each an optional extra imported lazily (``pip install
'memplan[hf]'`` and the like); what only builds a dict or a text needs no extra:

``hf``          ``training_args(plan)`` (``TrainingArguments``), ``MemplanCallback`` (its ``Trainer``)
``trl``         ``sft_config(plan)`` (``SFTConfig``)
``lightning``   ``trainer_kwargs(plan)`` (``Trainer``), ``MemplanCallback``
``accelerate``  ``config(plan)``, ``config_yaml(plan)``, ``reduce_batch_size_fn(plan)``
``torchtune``   ``overrides(plan)`` (``key=value`` for ``tune run``)

``emit(plan, tool)`` is the text ``memplan plan --emit TOOL`` prints, ``caveats(plan, tool)``
what that tool cannot express of the plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["TOOLS", "emit", "caveats"]

TOOLS = ("hf", "trl", "lightning", "accelerate", "torchtune")
"""The tools a plan exports to (``memplan plan --emit``)."""

if TYPE_CHECKING:
    from ._emit import caveats, emit


def __getattr__(name: str) -> Any:
    if name in ("emit", "caveats"):
        from . import _emit
        return getattr(_emit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
