"""Out-of-memory errors: which errors mean "did not fit", how to clean up after one, and
how to say it in one line."""

from __future__ import annotations

import gc
import re
import sys

from vramplan.errors import BudgetExceeded, EngineError
from vramplan.units import format_bytes


def is_out_of_memory(error: BaseException) -> bool:
    """True for the errors that mean 'did not fit' (CUDA, CPU, our own budget)."""
    if isinstance(error, (BudgetExceeded, MemoryError)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    # CUDA: "CUDA out of memory"; the CPU allocator: "DefaultCPUAllocator: can't allocate
    # memory: you tried to allocate N bytes" (c10/core/impl/alloc_cpu.cpp)
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text)


def require_complete(report: object, job: object) -> None:
    """Only a completed step's peak may say "fits". A measured run that stopped early (an
    error in user code) leaves a partial peak: an error that stops the search. A run
    interrupted by Ctrl-C stops the search as Ctrl-C does."""
    measured = getattr(report, "measured", None)
    if measured is None or measured.complete:
        return
    if measured.stopped.startswith("interrupted"):
        raise KeyboardInterrupt
    batch, seq = getattr(job, "batch_size", "?"), getattr(job, "seq_len", "?")
    raise EngineError(f"the trial at batch_size={batch}, seq_len={seq} did not complete a "
                      f"step ({measured.stopped}); its partial peak cannot say whether it "
                      "fits: fix the error and search again")


def release_memory() -> None:
    """Drop what a failed trial left behind so the next one starts clean."""
    gc.collect()
    torch = sys.modules.get("torch")  # only if already loaded: never import it here
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe_oom(error: BaseException) -> str:
    """torch's first sentence and the request that failed; torch's paragraph about
    allocator settings is left out."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    # the CPU allocator counts in bytes ("you tried to allocate 123456789 bytes"): say GiB
    text = re.sub(r"\b(\d{4,}) bytes\b", lambda m: format_bytes(int(m.group(1)), "auto"), text)
    request = re.search(r"Tried to allocate ([\d.]+ \w+)", text)
    first = text.split(". ")[0].rstrip(".")
    if request is None or request.group(0) in first:
        return first
    return f"{first}: tried to allocate {request.group(1)}"
