"""The plan as ``trl.SFTConfig`` keyword arguments: ``TrainingArguments``' and TRL's own."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from .._plan_facts import layout, seq_len
from ..hf._export import _args
from ..hf._export import caveats as hf_caveats

if TYPE_CHECKING:
    from ...planning import Plan

__all__ = ["sft_config", "caveats"]


def sft_config(plan: Plan) -> dict[str, Any]:
    """``SFTConfig(**sft_config(plan), output_dir=...)``: the Trainer's keywords, and
    ``max_length`` when the plan was made at a sequence length (an ``hf:`` model's) with
    packing off, so that every sample is the planned length at most."""
    for line in caveats(plan):
        warnings.warn(f"memplan.integrations.trl: {line}", UserWarning, stacklevel=2)
    out = _args(layout(plan))
    tokens = seq_len(plan)
    if tokens is not None:
        out["max_length"] = tokens
    return out


def caveats(plan: Plan) -> list[str]:
    out = hf_caveats(plan)
    if seq_len(plan) is None:
        out.append("the plan was made from a model file, whose data sets the sequence length: set SFTConfig's "
                   "max_length to the longest sample it planned for")
    return out
