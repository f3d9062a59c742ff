"""The event table: the one shape of a traced step's memory, which every later stage reads.

Each allocation the step makes is a row of ``alloc_bytes``/``alloc_category``; each event is
``event_alloc[i]`` (the allocation it refers to), ``event_sign[i]`` (+1 created, -1 released)
and ``event_phase[i]`` (an index into ``phase_labels``: ``setup``, ``step 1 micro 0 forward``,
…, ``end``). The recorder writes it as lists (:class:`~estimators.tracing._steady.RawEvents`),
a :class:`~estimators.tracing._trace.Trace` holds it as arrays, and
:class:`~estimators.memory._prepare.Prepared` is the same table with the kernel workspaces put in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EventTable"]


@dataclass(kw_only=True)
class EventTable:
    """Allocations and the ordered events that create and release them (see the module)."""

    alloc_bytes: np.ndarray
    """Per allocation: its bytes."""
    alloc_category: np.ndarray
    """Per allocation: its :class:`~estimators.tracing._recorder.Category` (params, activations, …)."""
    event_alloc: np.ndarray
    """Per event: the allocation it creates or releases."""
    event_sign: np.ndarray
    """Per event: +1 creates, -1 releases."""
    event_phase: np.ndarray
    """Per event: its phase, an index into ``phase_labels``."""
    phase_labels: list[str]

    def structure_key(self) -> tuple[int, int]:
        """(events, allocations): tables of one structure have the same."""
        return (len(self.event_alloc), len(self.alloc_bytes))

    def same_structure(self, other: EventTable) -> bool:
        """The same events on allocations of the same categories (sizes may differ)."""
        return (
            self.structure_key() == other.structure_key()
            and np.array_equal(self.event_alloc, other.event_alloc)
            and np.array_equal(self.event_sign, other.event_sign)
            and np.array_equal(self.alloc_category, other.alloc_category)
        )
