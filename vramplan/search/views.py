"""Files written from search and sweep results: CSV, JSON and a PNG plot."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vramplan.search.sweep import SWEEP_FIELDS


def rows_csv(rows: Sequence[dict]) -> str:
    """Sweep rows as CSV text, one header line then one line per row."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else list(SWEEP_FIELDS))
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def write_csv(rows: Sequence[dict], path: str | Path) -> None:
    Path(path).write_text(rows_csv(rows))


def write_json(data: Any, path: str | Path) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def plot(rows: Sequence[dict], path: str | Path, *, x: str | None = None,
         limit_bytes: int | None = None, limit_label: str = "GPU usable memory",
         title: str = "") -> None:
    """PNG of peak memory (GiB) against batch size or sequence length, one line per value
    of the other, with the GPU's usable memory drawn as a horizontal line."""
    import matplotlib  # lazily: plotting is optional and slow to import
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if x is None:  # the axis with more distinct values
        x = "batch_size" if len({r["batch_size"] for r in rows}) >= len(
            {r["seq_len"] for r in rows}) else "seq_len"
    other = "seq_len" if x == "batch_size" else "batch_size"
    gib = 1024**3
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for value in sorted({r[other] for r in rows}):
        pts = sorted((r[x], r["device_total"]) for r in rows
                     if r[other] == value and r["device_total"] is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] / gib for p in pts], marker="o",
                    label=f"{other} = {value}")
        ooms = [r[x] for r in rows if r[other] == value and r["device_total"] is None]
        if ooms and limit_bytes:
            ax.scatter(ooms, [limit_bytes / gib] * len(ooms), marker="x", color="red")
    if limit_bytes:
        ax.axhline(limit_bytes / gib, color="red", linestyle="--", label=limit_label)
    ax.set_xscale("log", base=2)
    ticks = sorted({r[x] for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title(title or "Peak memory")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
