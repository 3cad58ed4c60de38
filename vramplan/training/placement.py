"""Memory the step allocates outside torch's caching allocator on the GPU.

The trace runs every tensor on one fake device. Tensors that a real job keeps elsewhere are
created inside `placed(...)`, and the trace's tracker (engines/trace.py) sums them apart
instead of counting them in the allocator's categories and peak:

    UNIFIED  CUDA unified memory (cudaMallocManaged): bitsandbytes' paged optimizer states
    HOST     host memory: offloaded activations, CPU-offloaded optimizer states and
             parameters (pinned or pageable: the GPU does not see it either way)
    FUSED    nowhere: results a torch.compile'd graph computes inside one fused Inductor
             kernel (training/compiled.py), never written to memory

Once a storage is known to be outside, later in-place ops on it stay outside. On a real
device the marker changes nothing: the real libraries put the memory where it belongs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

UNIFIED = "unified"
HOST = "host"
FUSED = "fused"

_PLACE: ContextVar[str | None] = ContextVar("vramplan_placement", default=None)


@contextlib.contextmanager
def placed(where: str | None) -> Iterator[None]:
    """New storages made inside live in `where` (UNIFIED, HOST, FUSED; None: the GPU)."""
    token = _PLACE.set(where)
    try:
        yield
    finally:
        _PLACE.reset(token)


def current_placement() -> str | None:
    return _PLACE.get()
