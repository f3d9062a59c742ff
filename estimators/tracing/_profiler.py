"""The one way memplan starts torch's profiler: CPU activity with memory events, quietly.

libkineto prints ``USDT ... profiler_start`` / ``profiler_stop`` on stderr each time a
profiler starts or stops, at a log level that its default threshold keeps. memplan profiles
many small real runs (workspaces, probes, measurements): on a user's terminal that is noise.
``KINETO_LOG_LEVEL`` above kineto's highest level (USDT, 5) silences it; kineto reads it when
the process first starts a profiler, so it is set (unless the user set it) before that.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from torch._C._profiler import _ExtraFields_Allocation

if TYPE_CHECKING:
    from torch._C._profiler import _ProfilerEvent
    from torch.profiler import profile

__all__ = ["memory_profile", "collector_paused", "event_tree", "walk_events", "allocated_bytes"]

_QUIET_LEVEL = "6"


def memory_profile(*, collect: bool = True) -> profile:
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


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The garbage collector off for a profiled window (as it was, after): no garbage from
    before the window is freed inside it, without the full collection ``memory_profile`` makes
    first (a quarter second in a process that has imported a large library: the estimator
    profiles many short real steps)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def event_tree(prof: profile) -> list[_ProfilerEvent]:
    """The top events of a finished profile (each with its ``children``)."""
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    assert results is not None, "the profile has not run"
    return results.experimental_event_tree()


def walk_events(events: Iterable[_ProfilerEvent]) -> Iterator[_ProfilerEvent]:
    """``events`` and all their descendants, depth first."""
    for event in events:
        yield event
        yield from walk_events(event.children)


def allocated_bytes(event: _ProfilerEvent) -> int | None:
    """The bytes an allocation event allocated (negative when it freed), None for other events."""
    fields = event.extra_fields
    return fields.alloc_size if isinstance(fields, _ExtraFields_Allocation) else None
