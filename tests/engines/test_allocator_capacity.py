"""The caching allocator model frees its cache before it would exceed the device."""

from vramplan.engines.allocator import CachingAllocator
from vramplan.units import MiB


def _replay(capacity):
    alloc = CachingAllocator(capacity=capacity)
    alloc.malloc("a", 15 * MiB)  # >= 10 MiB: its own segment, rounded to 2 MiB: 16 MiB
    alloc.malloc("b", 1 * MiB)   # small pool: a 2 MiB segment, kept in use
    alloc.free("a")              # the 16 MiB segment is cached, wholly free
    alloc.malloc("c", 30 * MiB)  # a new 30 MiB segment
    return alloc


def test_reserved_grows_without_a_capacity():
    alloc = _replay(None)
    assert alloc.reserved == alloc.peak_reserved == (16 + 2 + 30) * MiB


def test_a_full_device_releases_cached_segments_first():
    alloc = _replay(40 * MiB)
    # 18 + 30 > 40: the free 16 MiB segment goes back; the in-use 2 MiB one stays
    assert alloc.reserved == alloc.peak_reserved == (2 + 30) * MiB
    assert alloc.segments == 2 and alloc.allocated == 31 * MiB
