"""Accelerate: the plan as an ``accelerate launch`` config (a dict, or its YAML), and a
``reduce_batch_size_fn`` for ``find_executable_batch_size`` that steps down the plan's ladder
and keeps the global batch."""

from __future__ import annotations

from ._batch import accumulation_for, reduce_batch_size_fn
from ._export import config, config_yaml

__all__ = ["config", "config_yaml", "reduce_batch_size_fn", "accumulation_for"]
