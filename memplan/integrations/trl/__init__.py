"""TRL: the plan as ``SFTConfig`` keywords (``TrainingArguments``' and TRL's own)."""

from __future__ import annotations

from ._export import sft_config

__all__ = ["sft_config"]
