"""`vramplan models` and `vramplan gpus`: the catalogs, filtered."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from vramplan.cli.options import AsJson, console, print_json
from vramplan.errors import JobError
from vramplan.units import GiB, format_count, parse_bytes


def models_command(
    family: Annotated[Optional[str], typer.Option(help="e.g. llama, qwen, bert")] = None,
    contains: Annotated[Optional[str], typer.Option(help="part of the name")] = None,
    min_params: Annotated[Optional[str], typer.Option(help="e.g. 1B")] = None,
    max_params: Annotated[Optional[str], typer.Option(help="e.g. 10B")] = None,
    as_json: AsJson = False,
) -> None:
    """List the model catalog."""
    from rich.table import Table

    from vramplan.models import list_models

    entries = list_models(family=family, name_contains=contains,
                          min_params=parse_count(min_params), max_params=parse_count(max_params))
    if as_json:
        print_json([{"name": e.name, "family": e.family, "params": e.params, "hf_id": e.hf_id,
                     "source": e.source} for e in entries])
        return
    table = Table(title=f"{len(entries)} models")
    for col in ("name", "family", "params", "hf_id", "description"):
        table.add_column(col, justify="right" if col == "params" else "left")
    for e in entries:
        table.add_row(e.name, e.family, format_count(e.params), e.hf_id, e.description)
    console.print(table)


def gpus_command(
    vendor: Annotated[Optional[str], typer.Option(help="nvidia or amd")] = None,
    min_memory: Annotated[Optional[str], typer.Option(help="e.g. 40GB or 48GiB")] = None,
    contains: Annotated[Optional[str], typer.Option(help="part of the name")] = None,
    as_json: AsJson = False,
) -> None:
    """List the GPU catalog (memory, bandwidth, dense TFLOP/s, price)."""
    from rich.table import Table

    from vramplan.hardware import list_gpus

    gpus = list_gpus(vendor=vendor, name_contains=contains,
                     min_memory_bytes=parse_bytes(min_memory) if min_memory else None)
    if as_json:
        print_json([{"name": g.name, "vendor": g.vendor, "memory_bytes": g.memory_bytes,
                     "usable_bytes": g.usable_bytes, "bandwidth_bytes_s": g.bandwidth_bytes_s,
                     "tflops": g.tflops, "price_per_hour": g.price_per_hour,
                     "price_date": g.price_date} for g in gpus])
        return
    table = Table(title=f"{len(gpus)} GPUs (dense TFLOP/s; prices are on-demand USD per hour)")
    for col in ("name", "memory", "usable GiB", "type", "TB/s", "bf16", "fp8", "link",
                "$/h", "price date"):
        table.add_column(col, justify="left" if col in ("name", "type", "link") else "right")
    for g in gpus:
        table.add_row(
            g.name, f"{g.memory_bytes / GiB:.0f} GiB", f"{g.usable_bytes / GiB:.1f}",
            g.memory_type, f"{g.bandwidth_bytes_s / 1e12:.2f}",
            _tf(g.tflops.get("bf16")), _tf(g.tflops.get("fp8")), g.interconnect,
            f"{g.price_per_hour:.2f}" if g.price_per_hour else "-", g.price_date)
    console.print(table)


def _tf(value: float | None) -> str:
    return f"{value:g}" if value else "-"


_SCALE = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_count(text: str | None) -> int | None:
    """'7B' -> 7e9, '350M' -> 3.5e8, '' or None -> no bound."""
    if text is None:
        return None
    cleaned = text.strip()
    try:
        if cleaned and cleaned[-1].upper() in _SCALE:
            value = float(cleaned[:-1]) * _SCALE[cleaned[-1].upper()]
        else:
            value = float(cleaned)
        if not 0 <= value < 1e16:
            raise ValueError
        return int(value)
    except (ValueError, OverflowError):
        raise JobError(f"cannot read {text!r} as a parameter count: write e.g. 7B or "
                       "350M") from None


def register(app: typer.Typer) -> None:
    app.command("models")(models_command)
    app.command("gpus")(gpus_command)
