"""Bytes <-> text. Bytes are ints everywhere; units appear only at the edges.

Binary units (KiB, MiB, GiB) are powers of 1024, decimal ones (KB, MB, GB) powers of 1000,
and each is always named explicitly, so "24 GB" on a datasheet and "22.5 GiB" in a report
are never confused.
"""

from __future__ import annotations

import math
import re

from vramplan.errors import JobError

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
KB, MB, GB, TB = 1000, 1000**2, 1000**3, 1000**4

_UNITS = {
    "b": 1, "": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": KB, "mb": MB, "gb": GB, "tb": TB,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


# No memory this tool plans comes near an exbibyte; larger sizes are typos (and overflow floats).
MAX_BYTES = 2**60


def parse_bytes(text: str | int | float) -> int:
    """'24GB' -> 24_000_000_000, '4 GiB' -> 4294967296, 1024 -> 1024."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text != text or text < 0:
            raise JobError(f"a memory size cannot be negative or NaN (got {text})")
        return _in_range(text, text)
    shown = str(text) if len(str(text)) <= 40 else str(text)[:37] + "..."
    match = _SIZE.match(str(text)) if len(str(text)) <= 1000 else None
    if not match or match.group(2).lower() not in _UNITS:
        raise JobError(
            f"cannot read {shown!r} as a memory size: write a number and a unit, "
            "e.g. '24GB' (decimal) or '22.5GiB' (binary)"
        )
    number = match.group(1)
    value = (int(number) if number.isdigit() else float(number)) * _UNITS[match.group(2).lower()]
    return _in_range(value, shown)


def _in_range(value: int | float, shown: object) -> int:
    if value > MAX_BYTES:
        raise JobError(f"memory size {shown} is larger than 1 EiB: check the number and unit")
    return int(value)


def format_bytes(n: int, unit: str = "GiB", digits: int = 2) -> str:
    """format_bytes(3 * GiB) -> '3.00 GiB'; unit is one of the names above or 'auto'."""
    if unit == "auto":
        unit = next((u for u, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
                     if abs(n) >= size), "B")
    size = _UNITS[unit.lower()] if unit != "B" else 1
    return f"{n / size:.{digits}f} {unit}" if unit != "B" else f"{n} B"


def format_count(n: int) -> str:
    """Parameter counts: 8030261248 -> '8.03B', 124439808 -> '124.44M'."""
    for suffix, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{suffix}"
    return str(n)


def p90(values: list[float]) -> float | None:
    """90th percentile (nearest rank) of step times."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
