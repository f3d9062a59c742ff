"""Segments of the caching-allocator model: the free-block index, releasing cached
segments (``release_cached_blocks``, ``release_available_cached_blocks``) and expandable
segments.

``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``find_expandable_block`` /
``map_block`` / ``unmap_block`` in ``CUDACachingAllocator.cpp``): one virtual segment per
(pool, stream), mapped in pages; see ``_allocator``'s docstring for the rules. A mixin of
``CachingAllocatorSim``, whose state (``_free``, ``_unmapped``, ``_reserved``, counters) it
reads and writes.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING

from ._blocks import _MASK, _SHIFT, _Block, _Pool, _Seg, kLargeBuffer, kSmallBuffer

__all__ = ["Segments"]


class Segments:
    """The segment half of ``CachingAllocatorSim``: its free-block index, cache releases
    and expandable segments."""

    if TYPE_CHECKING:
        _free: dict[int, _Block]
        _unmapped: dict[int, _Block]
        _capacity: int | None
        _va_size: int
        _next_addr: int
        _reserved: int
        _peak_reserved: int
        _num_segments: int
        _num_device_allocs: int
        _num_device_frees: int
        _ms: int
        _pools: dict[tuple[bool, int], _Pool]

    # ------------------------------------------------------------------ free-block index

    def _index_insert(self, block: _Block) -> None:
        insort(block.pool.keys, (block.size << _SHIFT) | block.ptr)
        self._free[block.ptr] = block

    def _index_remove(self, block: _Block) -> None:
        keys = block.pool.keys
        del keys[bisect_left(keys, (block.size << _SHIFT) | block.ptr)]
        del self._free[block.ptr]

    def _unmapped_insert(self, block: _Block) -> None:
        insort(block.pool.unmapped, block.ptr)
        self._unmapped[block.ptr] = block

    def _unmapped_remove(self, block: _Block) -> None:
        lst = block.pool.unmapped
        del lst[bisect_left(lst, block.ptr)]
        del self._unmapped[block.ptr]

    def _merge(self, dst: _Block, src: _Block) -> None:
        """try_merge_blocks: ``src`` (free, same mapped state, neighbour) joins ``dst``.

        ``dst`` must not be in an index (its key changes); ``src`` is removed from its own.
        """
        if src.mapped:
            self._index_remove(src)
        else:
            self._unmapped_remove(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # ------------------------------------------------------------------ releasing cached segments

    def _release_block(self, block: _Block) -> None:
        self._index_remove(block)
        self._reserved -= block.size
        self._num_segments -= 1
        self._num_device_frees += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        ms = self._ms
        key_size = max(size, ms)
        keys = pool.keys
        free = self._free
        i = bisect_left(keys, key_size << _SHIFT)
        if i < len(keys):
            block = free[keys[i] & _MASK]
            if block.seg is not None or block.prev is not None or block.next is not None:
                return False
            self._release_block(block)
            return True
        # No single block is large enough: free oversize blocks, largest first.
        released = 0
        j = len(keys) - 1
        while released < key_size and j >= 0:
            block = free[keys[j] & _MASK]
            if block.size < ms:
                break
            if block.seg is None and block.prev is None and block.next is None:
                released += block.size
                self._release_block(block)
            j -= 1
        return released >= key_size

    def _release_cached_blocks(self) -> None:
        # release_blocks(large_blocks) then release_blocks(small_blocks), every stream.
        pools = sorted(self._pools.values(), key=lambda p: (p.small, p.stream))
        free = self._free
        for pool in pools:
            to_unmap = []
            for key in list(pool.keys):
                block = free[key & _MASK]
                if block.seg is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if not block.mapped and block.prev is None and block.next is None:
                    self._unmapped_remove(block)  # release_expandable_segment
                    self._num_segments -= 1

    # ------------------------------------------------------------------ expandable segments

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt  # map_block merged the old candidate into it
        self._index_remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        unmapped = self._unmapped
        for ptr in pool.unmapped:
            c = unmapped[ptr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            avail = 0
            b: _Block | None = c
            while avail < size and b is not None and not b.allocated:
                avail += b.size
                b = b.next
            if avail >= size:
                return c
        page = kSmallBuffer if pool.small else kLargeBuffer
        va = -(-self._va_size // page) * page
        seg = _Seg(self._next_addr, va, page)
        self._next_addr += va
        self._num_segments += 1
        candidate = _Block(seg.ptr, va, pool, seg, mapped=False)
        self._unmapped_insert(candidate)
        return candidate

    def _map_block(self, block: _Block, size: int) -> bool:
        seg = block.seg
        assert seg is not None and not block.mapped and size <= block.size
        page = seg.page
        offset = block.ptr - seg.ptr  # unmapped blocks start on a page boundary
        nbytes = -(-(offset + size) // page) * page - offset
        cap = self._capacity
        if cap is not None and self._reserved + nbytes > cap:
            return False  # cuMemCreate fails; torch releases this call's pages
        self._unmapped_remove(block)
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.ptr + nbytes, block.size - nbytes, block.pool, seg, mapped=False)
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = nbytes
            self._unmapped_insert(rest)
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped:
            self._merge(block, prev)
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            self._merge(block, nxt)
        self._index_insert(block)
        self._reserved += nbytes
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        self._num_device_allocs += 1
        return True

    def _unmap_block(self, block: _Block) -> None:
        seg = block.seg
        assert seg is not None
        page = seg.page
        lo = block.ptr - seg.ptr
        hi = lo + block.size
        begin = -(-lo // page) * page
        end = hi // page * page
        if begin >= end:
            return
        self._index_remove(block)
        pool = block.pool
        if begin > lo:
            before = _Block(block.ptr, begin - lo, pool, seg)
            before.prev = block.prev
            if block.prev is not None:
                block.prev.next = before
            before.next = block
            block.prev = before
            self._index_insert(before)
        if hi > end:
            after = _Block(seg.ptr + end, hi - end, pool, seg)
            after.next = block.next
            if block.next is not None:
                block.next.prev = after
            after.prev = block
            block.next = after
            self._index_insert(after)
        block.ptr = seg.ptr + begin
        block.size = end - begin
        block.mapped = False
        prev = block.prev
        if prev is not None and not prev.allocated and not prev.mapped:
            self._merge(block, prev)
        nxt = block.next
        if nxt is not None and not nxt.allocated and not nxt.mapped:
            self._merge(block, nxt)
        self._unmapped_insert(block)
        self._reserved -= end - begin
        self._num_device_frees += 1
