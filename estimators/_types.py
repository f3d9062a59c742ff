"""The names the package gives the user's own data, whose type only the model file knows.

Everything else the package handles has a type of its own (a tensor, a module, an optimizer,
a configuration); these are the exceptions, named once so that they read as what they are.
"""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Batch", "Item", "Setting"]

Batch: TypeAlias = Any
"""A batch as the model file's ``collate`` (or its ``sample``) makes it: a tensor, or any
nesting of tuples, lists and dicts of tensors and other values, passed to ``loss(model, batch)``
as is."""

Item: TypeAlias = Any
"""One item of the model file's dataset (``dataset[i]``), before ``collate`` makes batches of them."""

Setting: TypeAlias = Any
"""A value of the model file's ``settings`` dict (``global_batch``, ``lr``, ``target``, …):
whatever the file wrote, converted (``int(...)``, ``float(...)``) where it is read."""
