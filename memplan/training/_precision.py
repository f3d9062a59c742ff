"""The run's precision as one object: the step's :class:`estimators.StepPrecision` (its name
and, under ``fp16-mixed``, its ``GradScaler``), which OOM recovery may switch to a rung's.

Chosen once by the trainer and handed to the parts that need it (the step, the checkpoints,
the evaluation). How a precision runs -- the forward's autocast or default dtype, the scaled
backward, the scaler's optimizer step -- is the shared step's precision object itself, so that
the trainer's step is the step the estimator traces, byte for byte.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from estimators import StepPrecision
from estimators.runtime._precision import ScalerSettings

__all__: list[str] = []


class TrainPrecision(StepPrecision):
    """The step's precision on ``device`` that a rung switch can replace: ``name`` (a
    ``TrainConfig.precision``) and ``scaler`` (None but under ``fp16-mixed``)."""

    def __init__(self, name: str, device: torch.device, *, sharded: bool, scaler_kwargs: dict[str, Any]) -> None:
        super().__init__(name, device.type, sharded=sharded, scaler_settings=cast(ScalerSettings, scaler_kwargs))
        self.device = device

    def switch(self, name: str) -> None:
        """Another precision (an OOM recovery's rung). fp16 needs a GradScaler (a fresh one
        calibrates its scale in a few steps); bf16 and fp32 need none."""
        if name != self.name:
            StepPrecision.__init__(self, name, self.device_type, sharded=self.sharded,
                                   scaler_settings=self.scaler_settings)

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
