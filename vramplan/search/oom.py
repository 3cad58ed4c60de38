"""Out-of-memory errors: which errors mean "did not fit", how to clean up after one, and
how to say it in one line."""

from __future__ import annotations

import gc
import re
import sys

from vramplan.errors import BudgetExceeded


def is_out_of_memory(error: BaseException) -> bool:
    """True for the errors that mean 'did not fit' (CUDA, CPU, our own budget)."""
    if isinstance(error, (BudgetExceeded, MemoryError)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


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
    request = re.search(r"Tried to allocate ([\d.]+ \w+)", text)
    first = text.split(". ")[0].rstrip(".")
    if request is None or request.group(0) in first:
        return first
    return f"{first}: tried to allocate {request.group(1)}"
