"""A model of PyTorch's CUDA caching allocator, replayed over a trace's alloc/free sequence.

Rules from c10/cuda/CUDACachingAllocator.cpp (default settings, one stream, no
expandable_segments, no empty_cache):
  * every request is rounded up to a multiple of 512 B (kMinBlockSize);
  * requests <= 1 MiB (kSmallSize) use the small pool, whose segments are 2 MiB
    (kSmallBuffer); larger requests use the large pool: a new segment is 20 MiB
    (kLargeBuffer) for requests < 10 MiB (kMinLargeAlloc), else the request rounded up to
    2 MiB (kRoundLarge);
  * a request takes the smallest cached free block of its pool that is large enough
    (best fit, ties by address); the block is split when the remainder is >= 512 B (small
    pool) or > 1 MiB (large pool), otherwise the whole block is handed out;
  * a freed block merges with free neighbours of the same segment; segments are never
    returned to the driver, so reserved memory only grows -- until a new segment would not
    fit on the device: then the allocator releases every wholly free cached segment and
    retries before it reports out of memory (release_cached_blocks, then alloc again in
    DeviceCachingAllocator::malloc), so with a `capacity` reserved stays within it whenever
    the live blocks allow.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from vramplan.units import MiB

MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB
SMALL_BUFFER = 2 * MiB
LARGE_BUFFER = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB


def round_size(nbytes: int) -> int:
    """What the allocator hands out (and counts as allocated) for a request of nbytes."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


class CachingAllocator:
    """Replays malloc/free of rounded sizes; tracks allocated and reserved bytes and peaks."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity  # bytes the device can give this process (None: no limit)
        self._free = {True: [], False: []}  # pool(small?) -> sorted [(size, addr, block)]
        self._in_use: dict[object, _Block] = {}
        self._next_addr = 0
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.segments = 0

    def malloc(self, key: object, nbytes: int) -> None:
        size = round_size(nbytes)
        if size == 0:
            return
        small = size <= SMALL_SIZE
        block = self._take_free(size, small) or self._new_segment(size, small)
        block.free = False
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.addr + size, remaining, small, prev=block, next=block.next)
            if block.next:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert_free(rest)
        self._in_use[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        block = self._in_use.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour)
                block = self._merge(block, neighbour)
        self._insert_free(block)

    # --- internals --------------------------------------------------------------------------

    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        return pool.pop(i)[2]

    def _new_segment(self, size: int, small: bool) -> _Block:
        seg = segment_size(size)
        if self.capacity is not None and self.reserved + seg > self.capacity:
            self._release_cached_segments()
        block = _Block(self._next_addr, seg, small)
        self._next_addr += seg
        self.reserved += seg
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _release_cached_segments(self) -> None:
        """Return every segment that is one free block (nothing of it in use) to the driver."""
        for pool in self._free.values():
            whole = [entry for entry in pool if entry[2].prev is None and entry[2].next is None]
            for entry in whole:
                pool.remove(entry)
                self.reserved -= entry[2].size
                self.segments -= 1

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.addr, block))

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, (block.size, block.addr))
        assert pool[i][2] is block
        pool.pop(i)

    @staticmethod
    def _merge(block: _Block, other: _Block) -> _Block:
        first, second = (block, other) if block.addr < other.addr else (other, block)
        first.size += second.size
        first.next = second.next
        if second.next:
            second.next.prev = first
        return first
