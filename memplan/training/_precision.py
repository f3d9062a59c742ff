"""The run's precision as one object: its name and, under ``fp16-mixed``, its ``GradScaler``.

Chosen once by the trainer and handed to the parts that need it (the step, the checkpoints,
the evaluation); OOM recovery may switch it to a rung's precision. How a precision runs -- the
forward's autocast or default dtype, the scaled backward, the scaler's optimizer step -- stays
in the shared step (``estimators.train_step``, which takes the name and the scaler), so that
the trainer's step is the step the estimator traces, byte for byte.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from estimators import convert_input, forward_context, make_grad_scaler

__all__: list[str] = []

Batch = Any


class TrainPrecision:
    """``name`` (a ``TrainConfig.precision``) and ``scaler`` (None but under ``fp16-mixed``)."""

    def __init__(self, name: str, device: torch.device, *, sharded: bool, scaler_kwargs: dict[str, Any]) -> None:
        self.device, self.sharded, self.scaler_kwargs = device, sharded, scaler_kwargs
        self.name = name
        self.scaler = self._make_scaler(name)

    def _make_scaler(self, name: str) -> torch.amp.GradScaler | None:
        return make_grad_scaler(name, self.device.type, sharded=self.sharded, **self.scaler_kwargs)

    def switch(self, name: str) -> None:
        """Another precision (an OOM recovery's rung). fp16 needs a GradScaler (a fresh one
        calibrates its scale in a few steps); bf16 and fp32 need none."""
        if name != self.name:
            self.name, self.scaler = name, self._make_scaler(name)

    def forward_context(self) -> AbstractContextManager[None]:
        """Around a forward pass outside the step (evaluation), as the step runs its own."""
        return forward_context(self.name, self.device.type)

    def convert_input(self, batch: Batch) -> Batch:
        """bf16-true/fp16-true: the batch's floating-point tensors in the weights' dtype."""
        return convert_input(batch, self.name)

    def state_dict(self) -> dict[str, Any] | None:
        """The scaler's state (None without a scaler): the checkpoint's ``scaler`` entry."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)

    @property
    def nonfinite_advice(self) -> str:
        """What to change after a run of NaN/inf losses. fp16's narrow range overflows where bf16
        and fp32 do not; a run already in bf16 or fp32 has a NaN of its own making (the model,
        the data or the learning rate)."""
        return {
            "fp16-mixed": "lower the learning rate or use bf16-mixed/fp32 instead of fp16",
            "bf16-mixed": "lower the learning rate, or try fp32",
            "bf16-true": "lower the learning rate, or try bf16-mixed (fp32 weights)",
            "fp16-true": "use bf16-true or bf16-mixed: fp16 weights without a GradScaler overflow",
        }.get(self.name, "lower the learning rate, and check the model's outputs and the data for NaN/inf")
