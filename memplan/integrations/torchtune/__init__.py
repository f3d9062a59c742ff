"""torchtune: the plan as ``key=value`` overrides of a recipe's config (``tune run ... KEY=VALUE``)."""

from __future__ import annotations

from ._export import overrides

__all__ = ["overrides"]
