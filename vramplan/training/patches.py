"""Process-wide patches, each a context manager that restores what it replaced.

The trace and CPU runs swap functions that every thread of the process sees (F.dropout,
F.scaled_dot_product_attention, AutocastCPU kernels, FSDP2's storage hooks, transformers'
packed-sequence detection). PATCH_LOCK makes one such step run at a time: a second trace
in another thread waits for the first. The formula engine patches nothing and never
takes the lock, so estimates run beside a trace freely.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from vramplan.training.private_api import transformers_masking

# Re-entrant: a trace's step enters several patches, each of which may take it.
PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def patched(owner: Any, **replacements: Any) -> Iterator[None]:
    """Set attributes of `owner` for the duration, under PATCH_LOCK; restore them after."""
    with PATCH_LOCK:
        originals = {name: getattr(owner, name) for name in replacements}
        for name, value in replacements.items():
            setattr(owner, name, value)
        try:
            yield
        finally:
            for name, value in originals.items():
                setattr(owner, name, value)


@contextlib.contextmanager
def transformers_quirks() -> Iterator[None]:
    """transformers treats every FakeTensor as 'tracing' and then builds masks the real run
    does not: its packed-sequence detection builds a [B, 1, L, L] mask. Our synthetic batches
    hold unpacked sequences, so the detection's real answer is 'none'."""
    masking = transformers_masking()
    if masking is None:
        yield
        return
    with patched(masking, find_packed_sequence_indices=lambda *args, **kwargs: None):
        yield
