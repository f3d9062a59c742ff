"""A predicted timeline in the format of ``torch.cuda.memory._snapshot()``.

PyTorch's memory viewer (pytorch.org/memory_viz, ``python -m torch.cuda._memory_viz``)
reads a pickled dict with ``segments`` (the allocator's state at the end) and
``device_traces`` (one list of events per device: ``alloc``, ``free_requested``,
``free_completed``, ``segment_alloc``). We write the estimate's replay in that format:

* addresses come from the caching-allocator model (``estimators.memory._allocator``), so the
  "Active Cached Memory Timeline" and "Allocator State History" views show the modelled
  segments and their fragmentation;
* each ``alloc``/``free`` carries the byte count the estimate counts (512-byte blocks on
  CUDA), so the "Active Memory Timeline" peaks exactly at ``peak_allocated_bytes``;
* each allocation carries its ``category`` (params, activations, ...; the viewer colours
  by it) and one frame naming its phase, as there is no Python stack to record.

Limitation: one device and one stream; ``time_us`` is the event's position, not a time.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Literal, TypedDict

from ..memory._allocator import CachingAllocatorSim
from ..tracing._recorder import Category
from ._timeline import Timeline

__all__ = ["to_snapshot", "write_snapshot", "snapshot_peak", "Snapshot"]


# The parts of ``torch.cuda.memory._snapshot()`` (its docstring's TypedDicts) that are written here.
class Frame(TypedDict):
    filename: str
    line: int
    name: str


class TraceEntry(TypedDict):
    action: Literal["alloc", "free_requested", "free_completed", "segment_alloc"]
    addr: int
    size: int
    stream: int
    time_us: int
    frames: list[Frame]
    category: str


class Block(TypedDict):
    address: int
    size: int
    requested_size: int
    state: Literal["active_allocated", "inactive"]
    frames: list[Frame]


class Segment(TypedDict):
    device: int
    address: int
    total_size: int
    allocated_size: int
    active_size: int
    requested_size: int
    stream: int
    segment_type: Literal["small", "large"]
    segment_pool_id: tuple[int, int]
    is_expandable: bool
    frames: list[Frame]
    blocks: list[Block]


class Snapshot(TypedDict):
    segments: list[Segment]
    device_traces: list[list[TraceEntry]]
    allocator_settings: dict[str, object]
    external_annotations: list[object]


# The viewer appends "unknown" to the category list with a typo'd name (``categores``) when
# the list lacks it; segment events carry it so the list always has it.
_SEGMENT_CATEGORY = "unknown"


def _frame(name: str) -> list[Frame]:
    return [{"filename": "memplan (predicted)", "line": 0, "name": name}]


def to_snapshot(timeline: Timeline) -> Snapshot:
    """The snapshot dict of ``timeline`` (see the module docstring)."""
    sim = CachingAllocatorSim()
    handles: dict[int, int] = {}  # allocation index -> sim handle
    addr_of: dict[int, int] = {}
    segments: list[tuple[int, int, bool]] = []  # (address, bytes, small pool)
    trace: list[TraceEntry] = []
    sizes = timeline.sizes.tolist()
    cats = timeline.categories.tolist()
    phases = timeline.event_phase.tolist()
    for t, (index, sign) in enumerate(zip(timeline.event_alloc.tolist(), timeline.event_sign.tolist())):
        nbytes = int(sizes[index])
        if nbytes <= 0:
            continue
        category = Category(cats[index]).label
        frames = _frame(f"{timeline.phase_labels[phases[t]]}: {category}")
        if sign > 0:
            reserved = sim._reserved
            handles[index] = handle = sim.malloc(nbytes)
            block = sim._live[handle]
            assert block is not None
            if sim._reserved > reserved:  # the allocation took a fresh segment
                head = block
                while head.prev is not None:
                    head = head.prev
                segments.append((head.ptr, sim._reserved - reserved, block.pool.small))
                trace.append({"action": "segment_alloc", "addr": head.ptr, "size": sim._reserved - reserved,
                              "stream": 0, "time_us": t, "frames": frames, "category": _SEGMENT_CATEGORY})
            addr_of[index] = block.ptr
            trace.append({"action": "alloc", "addr": block.ptr, "size": nbytes, "stream": 0,
                          "time_us": t, "frames": frames, "category": category})
        else:
            if index not in handles:
                continue
            handle = handles.pop(index)
            addr = addr_of.pop(index)
            sim.free(handle)
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": addr, "size": nbytes, "stream": 0,
                              "time_us": t, "frames": frames, "category": category})
    return {
        "segments": _final_segments(sim, handles, segments, timeline),
        "device_traces": [trace],
        "allocator_settings": {},
        "external_annotations": [],
    }


def _final_segments(sim: CachingAllocatorSim, handles: dict[int, int], segments: list[tuple[int, int, bool]],
                    timeline: Timeline) -> list[Segment]:
    """The allocator's state after the last event, as ``_snapshot()["segments"]``."""
    live = sorted(((block, index) for index, h in handles.items() if (block := sim._live[h]) is not None),
                  key=lambda pair: pair[0].ptr)
    out: list[Segment] = []
    for address, size, small in sorted(segments):
        blocks: list[Block] = []
        cursor = address
        allocated = requested = 0
        for block, index in live:
            if not address <= block.ptr < address + size:
                continue
            if block.ptr > cursor:
                blocks.append({"address": cursor, "size": block.ptr - cursor, "requested_size": 0,
                               "state": "inactive", "frames": []})
            want = int(timeline.sizes[index])
            label = Category(int(timeline.categories[index])).label
            blocks.append({"address": block.ptr, "size": block.size, "requested_size": min(want, block.size),
                           "state": "active_allocated", "frames": _frame(f"alive at the end: {label}")})
            allocated += block.size
            requested += want
            cursor = block.ptr + block.size
        if cursor < address + size:
            blocks.append({"address": cursor, "size": address + size - cursor, "requested_size": 0,
                           "state": "inactive", "frames": []})
        out.append({
            "device": 0, "address": address, "total_size": size, "allocated_size": allocated,
            "active_size": allocated, "requested_size": requested, "stream": 0,
            "segment_type": "small" if small else "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks,
        })
    return out


def write_snapshot(timeline: Timeline, path: str | Path) -> Path:
    """Pickle ``to_snapshot(timeline)`` to ``path`` (what ``torch.cuda.memory._dump_snapshot``
    writes) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(to_snapshot(timeline), f)
    return path


def snapshot_peak(snapshot: Snapshot, device: int = 0) -> int:
    """The peak of active memory a snapshot's trace shows, counted as PyTorch's viewer does
    (``process_alloc_data`` in ``torch/utils/viz/MemoryViz.js``): blocks alive in
    ``segments`` without an ``alloc`` in the trace were there from the start; each ``alloc``
    adds its size and each ``free_completed`` of a traced address removes it."""
    live: dict[int, int] = {}
    initially = 0
    events: list[tuple[int, int]] = []
    for e in snapshot["device_traces"][device]:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            events.append((+1, e["size"]))
        elif e["action"] in ("free", "free_completed"):
            if e["addr"] in live:
                events.append((-1, live.pop(e["addr"])))
            else:
                initially += e["size"]
                events.append((-1, e["size"]))
    for seg in snapshot["segments"]:
        if seg.get("device", 0) != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and addr not in live:
                initially += b.get("requested_size", b["size"])
            addr += b["size"]
    total = peak = initially
    for sign, size in events:
        total += sign * size
        peak = max(peak, total)
    return int(peak)
