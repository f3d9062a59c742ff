"""The one way memplan starts torch's profiler: CPU activity with memory events, quietly.

libkineto prints ``USDT ... profiler_start`` / ``profiler_stop`` on stderr each time a
profiler starts or stops, at a log level that its default threshold keeps. memplan profiles
many small real runs (workspaces, probes, measurements): on a user's terminal that is noise.
``KINETO_LOG_LEVEL`` above kineto's highest level (USDT, 5) silences it; kineto reads it when
the process first starts a profiler, so it is set (unless the user set it) before that.
"""

from __future__ import annotations

import gc
import os
from typing import Any

__all__ = ["memory_profile"]

_QUIET_LEVEL = "6"


def memory_profile(*, collect: bool = True) -> Any:
    """``torch.profiler.profile`` of CPU activity with memory events, kineto's logs off.
    ``collect=False`` skips the garbage collection (a quarter second in a large process) for
    a caller that keeps the collector off inside its window."""
    os.environ.setdefault("KINETO_LOG_LEVEL", _QUIET_LEVEL)
    # Garbage from before the window, collected inside it, frees blocks the profiler never saw
    # allocated: c10 warns of each such block on stderr ("Memory block of unknown size was
    # allocated before the profiling started"). Collected now, it is freed before the window.
    if collect:
        gc.collect()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)
