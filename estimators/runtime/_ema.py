"""An exponential moving average of the weights: one more copy of the floating-point state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.nn as nn

__all__ = ["EMA"]


class EMA:
    """Exponential moving average of the floating-point state (parameters and float buffers
    such as BatchNorm statistics); integer buffers are taken from the live model.

    The shadow is as large as the floating-point state dict, so the trace builds it too (on
    fake tensors) and the estimate holds it for the whole step. Under ``bf16-true`` and
    ``fp16-true`` it is kept in fp32 (twice the weights' size): a decay of 0.999 moves a bf16
    average by 0.1% of the gap a step, far below bf16's 0.4% resolution, so a bf16 shadow
    would never move.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().to(_averaged_dtype(v.dtype), copy=True)
                       for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        state = model.state_dict()
        for name, avg in self.shadow.items():
            avg.lerp_(state[name].detach().to(avg.dtype), 1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[None]:
        """The EMA weights in the model for the duration (evaluation, saving)."""
        backup = {k: v.detach().clone() for k, v in model.state_dict().items() if k in self.shadow}
        model.load_state_dict(self.shadow, strict=False)
        try:
            yield
        finally:
            model.load_state_dict(backup, strict=False)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.shadow.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for name, value in state.items():
            self.shadow[name].copy_(value)


def _averaged_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
