"""What an estimate needs of the model itself: parameter counts, FSDP2 units, DDP buckets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..runtime._checkpoint import find_block_stack
from ..runtime._precision import cast_model
from ..task._task import Task
from ..tracing._fake import build_fake_model, fake_mode
from ..tracing._simulated_ranks import FsdpUnits, ddp_bucket_bytes, fsdp_units

__all__ = ["ModelFacts", "model_facts"]


@dataclass(frozen=True)
class ModelFacts:
    params: int
    trainable: int
    units: FsdpUnits
    ddp_buckets: tuple[int, ...]
    ddp_buckets_low: tuple[int, ...]
    """DDP's buckets under bf16-true/fp16-true (2-byte gradients; batch norm's stay fp32)."""


def model_facts(task: Task) -> ModelFacts:
    """Parameter counts, FSDP2 units and DDP buckets, from the model built on the meta device
    (shapes and dtypes alone; a billion parameters cost no time to allocate), else from a fake
    copy of it."""
    model = _shapes_only(task)
    distinct = list(dict.fromkeys(model.parameters()))
    find_block_stack(model, task.checkpoint_blocks)
    return ModelFacts(
        params=sum(p.numel() for p in distinct),
        trainable=sum(p.numel() for p in distinct if p.requires_grad),
        units=fsdp_units(model, task.checkpoint_blocks),
        ddp_buckets=tuple(ddp_bucket_bytes(model)),
        # DDP's buckets hold the gradients, in the weights' dtype: half under bf16-true.
        ddp_buckets_low=tuple(ddp_bucket_bytes(cast_model(model, "bf16-true"))),
    )


def _shapes_only(task: Task) -> nn.Module:
    """The task's model with tensors of the right shapes and dtypes, ties kept: on the meta
    device when it builds there, else a fake copy."""
    if task.prebuilt is None:
        try:
            with torch.device("meta"):
                model = task.build_model()
            if isinstance(model, nn.Module):
                return model
        except Exception:  # noqa: BLE001 - some models cannot be built on meta
            pass
    return build_fake_model(task, fake_mode())
