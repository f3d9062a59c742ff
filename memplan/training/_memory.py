"""What the trainer tells the memory guard and asks of the device: the phase that runs (for
the recovery log and the guard's injector) and the measured peak (of this window's try, and of
the run).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

__all__: list[str] = []


class Phase:
    """The part of the step that runs now (``setup``, ``data``, ``forward``, ``backward``,
    ``optimizer``, ``evaluation``, ``checkpoint``, ``recovery``), told to the guard too."""

    def __init__(self, memory_guard: AbstractContextManager[Any] | None) -> None:
        self.memory_guard = memory_guard
        self.name = "setup"

    def set(self, phase: str) -> None:
        self.name = phase
        guard = self.memory_guard
        if guard is None:
            return
        for attr in ("phase", "phase_label"):  # MemoryGuard, OOMInjector
            if hasattr(type(guard), attr):
                setattr(guard, attr, phase)
                return


class PeakMemory:
    """The device's peak (CUDA), else the guard's ``peak_bytes`` if it has one (None: unknown).

    OOM recovery starts the peak anew for each try of a window (so that an OOM reports the peak
    of the step that failed); the run's peak before that is kept in ``floor`` for the summary.
    """

    def __init__(self, device: torch.device, memory_guard: AbstractContextManager[Any] | None) -> None:
        self.device, self.memory_guard = device, memory_guard
        self.floor: int | None = None

    def window(self) -> int | None:
        """The peak since the window's try started (:meth:`reset_window`), without the floor."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        value = getattr(self.memory_guard, "peak_bytes", None)
        return int(value) if value is not None else None

    def run(self) -> int | None:
        """The run's peak so far."""
        peak = self.window()
        if self.floor is not None:  # the peak before OOM recovery last reset it
            peak = max(peak or 0, self.floor)
        return peak

    def reset_window(self) -> None:
        peak = self.run()
        if peak is not None:
            self.floor = max(self.floor or 0, peak)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.memory_guard is not None and hasattr(self.memory_guard, "reset_peak"):
            self.memory_guard.reset_peak()

    def budget(self) -> int | None:
        """The guard's budget, if it has one."""
        budget = getattr(self.memory_guard, "budget_bytes", None)
        return int(budget) if budget is not None else None
