"""What the trainer adds to ``metrics.jsonl`` to watch a run: gradient norms per layer every
N steps and, on CUDA, the GPU's utilisation, memory, power and temperature from NVML.

NVML numbers its devices in PCI order, whatever ``CUDA_VISIBLE_DEVICES`` and
``CUDA_DEVICE_ORDER`` make of them for CUDA, so the device is found by its UUID (what
``torch.cuda.get_device_properties`` reports for the CUDA device really used); without a
UUID, ``CUDA_VISIBLE_DEVICES``'s integer list maps the CUDA ordinal to NVML's. Monitoring
never stops training: on a CPU, without pynvml, or at the first NVML error it is off.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn as nn

__all__ = ["GpuMonitor", "layer_grad_norms", "TrainingMonitor", "GRAD_NORMS_EVERY"]

GRAD_NORMS_EVERY = 50
"""Steps between two per-layer gradient-norm records (and the first step)."""


def layer_grad_norms(model: nn.Module, *, rescale: float = 1.0) -> dict[str, float]:
    """The gradient norm of each module's own parameters (weight and bias together), keyed by
    the module's name; ``rescale`` undoes a clipping that already scaled the gradients."""
    squares: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        layer = name.rsplit(".", 1)[0] if "." in name else "(root)"
        layer = layer.removeprefix("module.").removeprefix("_orig_mod.")  # DDP / compile wrappers
        squares[layer] = squares.get(layer, 0.0) + float(p.grad.detach().float().norm()) ** 2
    return {k: math.sqrt(v) * rescale for k, v in squares.items()}


class GpuMonitor:
    """NVML readings of one CUDA device; :meth:`sample` is ``{}`` wherever they are not to be had."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._nvml: Any = None if self.device.type == "cuda" else False

    def _open(self) -> tuple[Any, Any]:
        import pynvml  # nvidia-ml-py, imported only on CUDA

        pynvml.nvmlInit()
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid:
            text = str(uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index(index))
        return pynvml, handle

    def sample(self) -> dict[str, Any]:
        if self._nvml is False:
            return {}
        try:
            if self._nvml is None:
                self._nvml = self._open()
            nv, handle = self._nvml
            return {
                "gpu_util_percent": int(nv.nvmlDeviceGetUtilizationRates(handle).gpu),
                "gpu_memory_used_bytes": int(nv.nvmlDeviceGetMemoryInfo(handle).used),
                "gpu_power_watts": nv.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # NVML reports mW
                "gpu_temperature_c": int(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)),
            }
        except Exception:  # noqa: BLE001 - monitoring must never stop training
            self._nvml = False
            return {}


def nvml_index(cuda_index: int) -> int:
    """NVML's index of CUDA device ``cuda_index`` from an integer ``CUDA_VISIBLE_DEVICES``
    (UUID lists need :meth:`GpuMonitor._open`'s UUID path)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return cuda_index
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if cuda_index >= len(ids) or not ids[cuda_index].isdigit():
        raise RuntimeError(f"CUDA device {cuda_index} is not an integer of CUDA_VISIBLE_DEVICES={visible!r}")
    return int(ids[cuda_index])


class TrainingMonitor:
    """The trainer's one object for monitoring: call :meth:`capture` after the gradients are
    final (after clipping) and before the optimizer step, and add :meth:`fields` to the step's
    record."""

    def __init__(self, device: torch.device | str, *, every: int | None = None, enabled: bool = True) -> None:
        self.gpu = GpuMonitor(device)
        self.every = every if every is not None else GRAD_NORMS_EVERY
        self.enabled = enabled
        self._norms: dict[str, float] | None = None

    def due(self, step: int) -> bool:
        return self.enabled and bool(self.every) and (step == 1 or step % int(self.every) == 0)

    def capture(self, model: nn.Module, step: int, *, grad_norm: float | None = None,
                clip: float | None = None) -> None:
        """Per-layer norms for optimizer step ``step`` when due; ``grad_norm``/``clip`` say
        whether clipping scaled the gradients (then the norms are scaled back)."""
        if not self.due(step):
            return
        rescale = 1.0
        if clip is not None and grad_norm is not None and math.isfinite(grad_norm) and grad_norm > clip:
            rescale = grad_norm / clip
        self._norms = layer_grad_norms(model, rescale=rescale)

    def fields(self) -> dict[str, Any]:
        out = self.gpu.sample()
        if self._norms is not None:
            out["layer_grad_norms"] = self._norms
            self._norms = None
        return out
