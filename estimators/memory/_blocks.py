"""The pieces of the caching-allocator model: CUDA's constants, blocks, pools, stats, OOM.

Kept apart from the allocator's algorithm (``_allocator``) and its expandable segments
(``_expandable``); the rules and their sources are in ``_allocator``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import MemplanError

__all__ = ["AllocatorStats", "SimulatedOOM", "allocation_size", "round_size"]

# Constants of c10/cuda/CUDACachingAllocator.cpp.
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1 << 20  # largest "small" allocation is 1 MiB
kSmallBuffer = 2 << 20  # "small" allocations are packed in 2 MiB blocks
kLargeBuffer = 20 << 20  # "large" allocations may be packed in 20 MiB blocks
kMinLargeAlloc = 10 << 20  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2 << 20  # round up large allocations to 2 MiB

_NO_CAPACITY_VA = 1 << 40  # virtual size of an expandable segment without a capacity
_SHIFT = 64  # free-block index key: (size << _SHIFT) | address
_MASK = (1 << _SHIFT) - 1


def round_size(nbytes: int) -> int:
    """Round a request up the way ``round_size()`` does: to a multiple of 512 B, at least 512.

    Example:
        >>> round_size(1), round_size(512), round_size(513)
        (512, 512, 1024)
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes < kMinBlockSize:
        return kMinBlockSize
    return -(-nbytes // kMinBlockSize) * kMinBlockSize


def allocation_size(nbytes: int) -> int:
    """Size of the segment ``cudaMalloc``'d for a request (``get_allocation_size``).

    ``nbytes`` is rounded with :func:`round_size` first (idempotent for rounded sizes).

    Example:
        >>> [allocation_size(n) >> 20 for n in (1, 1 << 20, (1 << 20) + 1, 12 << 20, 21 << 19)]
        [2, 2, 20, 12, 12]
    """
    size = round_size(nbytes)
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return -(-size // kRoundLarge) * kRoundLarge


def _fmt(nbytes: int | None) -> str:
    if nbytes is None:
        return "unlimited"
    return f"{nbytes / (1 << 20):.2f} MiB"


class SimulatedOOM(MemplanError):
    """The simulated allocator ran out of ``capacity`` even after flushing its cache.

    Attributes are bytes: ``requested`` (as passed to ``malloc``), ``alloc_size`` (what the
    failing ``cudaMalloc`` asked for), ``allocated`` and ``reserved`` (after the flush, as
    torch reports them in its message), ``capacity`` and the ``stream``.
    """

    def __init__(self, *, requested: int, alloc_size: int, allocated: int, reserved: int,
                 capacity: int | None, stream: int) -> None:
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {_fmt(alloc_size)} for a "
            f"{requested}-byte request on stream {stream}; capacity {_fmt(capacity)}, "
            f"{_fmt(allocated)} allocated, {_fmt(reserved - allocated)} reserved but unallocated"
        )
        self.requested = requested
        self.alloc_size = alloc_size
        self.allocated = allocated
        self.reserved = reserved
        self.capacity = capacity
        self.stream = stream


@dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of the simulated allocator's counters; bytes are ``int``."""

    allocated: int
    """Bytes in live blocks (``allocated_bytes.all.current``; ``memory_allocated()``)."""
    reserved: int
    """Bytes in segments / mapped pages (``reserved_bytes.all.current``; ``memory_reserved()``)."""
    requested: int
    """Unrounded bytes the live blocks were requested with (``requested_bytes.all.current``)."""
    peak_allocated: int
    """``max_memory_allocated()`` since construction or :meth:`CachingAllocatorSim.reset_peak`."""
    peak_reserved: int
    """``max_memory_reserved()`` since construction or :meth:`CachingAllocatorSim.reset_peak`."""
    peak_requested: int
    """Peak of ``requested`` over the same window."""
    num_segments: int
    """Segments held now: cudaMalloc'd ones plus live expandable segments."""
    num_allocs: int
    """Successful non-empty ``malloc`` calls so far (``allocation.all.allocated``)."""
    num_live_allocs: int
    """Blocks allocated now (``allocation.all.current``)."""
    num_device_allocs: int
    """``cudaMalloc`` calls, or page-mapping calls with expandable segments."""
    num_device_frees: int
    """``cudaFree`` calls, or unmapping calls (``num_device_free``)."""
    num_alloc_retries: int
    """Times the whole cache was flushed to retry a failed allocation (``num_alloc_retries``)."""
    num_ooms: int
    """``malloc`` calls that raised :class:`SimulatedOOM` (``num_ooms``)."""
    num_ooms_avoided_by_cache_flush: int
    """Allocations that failed first and succeeded after releasing cached blocks."""


class _Seg:
    """An expandable segment: a virtual range mapped in ``page``-sized pieces."""

    __slots__ = ("ptr", "size", "page")

    def __init__(self, ptr: int, size: int, page: int) -> None:
        self.ptr = ptr
        self.size = size
        self.page = page


class _Pool:
    """Free blocks of one (pool, stream): mapped ones by (size, address), unmapped by address."""

    __slots__ = ("small", "stream", "keys", "unmapped")

    def __init__(self, small: bool, stream: int) -> None:
        self.small = small
        self.stream = stream
        self.keys: list[int] = []  # sorted (size << _SHIFT) | ptr of free mapped blocks
        self.unmapped: list[int] = []  # sorted ptr of unmapped blocks (expandable only)


class _Block:
    __slots__ = ("ptr", "size", "pool", "prev", "next", "allocated", "mapped", "seg", "requested")

    def __init__(self, ptr: int, size: int, pool: _Pool, seg: _Seg | None = None,
                 mapped: bool = True) -> None:
        self.ptr = ptr
        self.size = size
        self.pool = pool
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = mapped
        self.seg = seg
        self.requested = 0
