"""Replaying prepared events: the peak the target's allocator sees, and what holds it.

On ``cpu`` sizes are counted as asked (the CPU allocator's live bytes); on ``cuda`` each
request is rounded to 512 bytes (``max_memory_allocated``) and replayed through the caching
allocator model (``max_memory_reserved``); host allocations count nothing on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..tracing._recorder import Category
from ._allocator import simulate
from ._prepare import Prepared

__all__ = ["MemoryPeak", "replay", "replay_sizes"]


@dataclass(frozen=True)
class MemoryPeak:
    """The peak of one replay: bytes allocated and reserved (None on cpu), and at the
    allocated peak the bytes of each category and the phase it falls in."""

    allocated: int
    reserved: int | None
    breakdown: dict[str, int]
    phase: str
    host: int = 0
    """On cuda: the peak of the allocations in host memory (CPU offload's states, offloaded
    activations, RNG states); 0 on cpu, where all is one memory."""


def replay(p: Prepared, device: str) -> MemoryPeak:
    """The peak of ``p``'s events on ``device``."""
    sizes = replay_sizes(p, device)
    signed = sizes[p.event_alloc] * p.event_sign.astype(np.int64)
    running = np.cumsum(signed)
    peak_index = int(np.argmax(running)) if len(running) else 0
    peak_allocated = int(running[peak_index]) if len(running) else 0
    cats = p.alloc_category[p.event_alloc[: peak_index + 1]].astype(np.int64)
    by_cat = np.bincount(cats, weights=signed[: peak_index + 1], minlength=len(Category))
    breakdown = {Category(i).label: int(round(v)) for i, v in enumerate(by_cat)}
    reserved = _simulate_reserved(sizes, p.event_alloc, p.event_sign) if device == "cuda" else None
    phase = p.phase_labels[int(p.event_phase[peak_index])] if len(running) else "setup"
    host = _host_peak(p) if device == "cuda" else 0  # on cpu the host is the device: counted above
    return MemoryPeak(peak_allocated, reserved, breakdown, phase, host)


def _host_peak(p: Prepared) -> int:
    on_host = np.isin(p.event_alloc, p.host_allocs)
    if not on_host.any():
        return 0
    signed = p.alloc_bytes[p.event_alloc[on_host]] * p.event_sign[on_host].astype(np.int64)
    return int(np.cumsum(signed).max(initial=0))


def replay_sizes(p: Prepared, device: str) -> np.ndarray:
    """Bytes of each allocation as the target's allocator counts them (one place, so that
    the estimate and its timeline export cannot disagree)."""
    sizes = p.alloc_bytes
    if device == "cuda":
        sizes = np.where(sizes > 0, ((sizes + 511) // 512) * 512, 0)
        if len(p.host_allocs):
            sizes = sizes.copy()
            sizes[p.host_allocs] = 0  # host memory, not the GPU's
    return sizes


def _simulate_reserved(sizes: np.ndarray, event_alloc: np.ndarray, event_sign: np.ndarray) -> int:
    """The caching allocator's peak reserved bytes over the trace's events (the one replay,
    :func:`~estimators.memory._allocator.simulate`; empty allocations take no block)."""
    nbytes = sizes.tolist()
    events = ((index, nbytes[index] if sign > 0 else 0)
              for index, sign in zip(event_alloc.tolist(), event_sign.tolist()) if nbytes[index] > 0)
    return simulate(events).peak_reserved
