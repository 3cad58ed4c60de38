"""Figures of reports, sweeps and comparisons (matplotlib), as inline SVG or as files.

Every figure is built on its own `matplotlib.figure.Figure` (no pyplot, no global backend),
so the web app can draw from several threads. Inline SVG keeps text as text (small files)
and carries hover text as SVG <title> elements, which browsers show without JavaScript:
an artist gets a `gid`, and `figure_svg` puts a <title> inside the group of that id.

    >>> fig, tips = breakdown_figure(report)
    >>> svg = figure_svg(fig, tips)          # for an HTML page
    >>> save_figure(fig, "memory.png")       # for --plot (png, svg or pdf by suffix)

matplotlib is imported when a figure is drawn, never by `import vramplan`.
"""

from __future__ import annotations

import html
import io
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramplan.engines.memory_report import (
    CATEGORIES,
    CATEGORY_HELP,
    TENSOR_CATEGORIES,
    MemoryReport,
)
from vramplan.units import GiB, MiB

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PHASES = ("forward", "backward", "optimizer")
# One colour per category, the same in every figure (colour-blind-safe Okabe-Ito order).
COLORS = {
    "weights": "#0072B2", "gradients": "#E69F00", "optimizer_states": "#009E73",
    "activations": "#D55E00", "inputs": "#56B4E9", "temporary": "#CC79A7",
    "allocator_overhead": "#999999", "runtime_context": "#666666",
}
FIT_COLOR, NO_FIT_COLOR, FREE_COLOR = "#009E73", "#D55E00", "#e6e6e6"
Tips = dict[str, str]  # gid -> hover text

_SVG_LOCK = threading.Lock()  # rc_context changes matplotlib's global rcParams
_SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "vramplan", "font.size": 9}


def unit_for(*sizes: int | float | None) -> tuple[str, int]:
    """GiB, or MiB when every size is under 1 GiB (tiny test models)."""
    largest = max((abs(s) for s in sizes if s is not None), default=0)
    return ("GiB", GiB) if largest >= GiB else ("MiB", MiB)


def label(category: str) -> str:
    return category.replace("_", " ")


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


# --- the memory breakdown ------------------------------------------------------------------


def breakdown_figure(report: MemoryReport) -> tuple[Figure, Tips]:
    """Allocated memory per phase. The peak phase is stacked by category; other phases are
    stacked too when the report carries per-phase categories (`phase_categories`), else
    drawn as one total."""
    per_phase: Mapping[str, Mapping[str, int]] = getattr(report, "phase_categories", None) or {}
    phases = [p for p in PHASES if p in report.phase_peaks] or [report.peak_phase or "peak"]
    peak_phase = report.peak_phase if report.peak_phase in phases else phases[-1]
    unit, size = unit_for(report.peak_allocated, *report.phase_peaks.values())
    fig = _figure(6.4, 3.2)
    ax = fig.add_subplot()
    tips: Tips = {}
    for x, phase in enumerate(phases):
        parts = per_phase.get(phase) or (
            {c: report.categories[c] for c in TENSOR_CATEGORIES} if phase == peak_phase else None)
        total = sum(parts.values()) if parts else report.phase_peaks.get(phase, 0)
        if parts is None:
            gid = f"vp-phase-{phase}"
            ax.bar(x, total / size, color="#b8c4d6", edgecolor="white", gid=gid)
            tips[gid] = f"{phase}: {total / size:,.2f} {unit} allocated at its peak"
        else:
            bottom = 0.0
            for category in TENSOR_CATEGORIES:
                value = parts.get(category, 0)
                if not value:
                    continue
                gid = f"vp-bar-{phase}-{category}"
                ax.bar(x, value / size, bottom=bottom, color=COLORS[category],
                       edgecolor="white", linewidth=0.5, gid=gid,
                       label=label(category) if phase == peak_phase else None)
                tips[gid] = (f"{label(category)}: {value / size:,.2f} {unit} "
                             f"({100 * value / max(total, 1):.0f}% of {phase}) - "
                             f"{CATEGORY_HELP[category]}")
                bottom += value / size
        mark = "  (peak)" if phase == peak_phase else ""
        ax.annotate(f"{total / size:,.2f}{mark}", (x, total / size), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(phases)), phases)
    ax.set_ylabel(f"allocated per GPU ({unit})")
    ax.set_title("Memory by phase of the step")
    ax.margins(y=0.15)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return fig, tips


# --- fit per GPU ---------------------------------------------------------------------------


def fit_figure(report: MemoryReport, prices: Mapping[str, float | None] | None = None
               ) -> tuple[Figure, Tips]:
    """Per GPU: the memory the job needs against the GPU's usable memory."""
    fits = sorted(report.fits, key=lambda f: (f.usable_bytes, f.gpu))
    prices = prices or {}
    unit, size = unit_for(*(f.usable_bytes for f in fits), *(f.required_bytes for f in fits))
    fig = _figure(6.4, 0.9 + 0.24 * max(len(fits), 1))
    ax = fig.add_subplot()
    tips: Tips = {}
    for y, fit in enumerate(fits):
        gid = f"vp-fit-{y}"
        ax.barh(y, fit.usable_bytes / size, color=FREE_COLOR, height=0.75)
        ax.barh(y, min(fit.required_bytes, fit.usable_bytes) / size, height=0.75,
                color=FIT_COLOR if fit.fits else NO_FIT_COLOR, gid=gid)
        if not fit.fits:  # the part that does not fit, past the GPU's end
            ax.barh(y, (fit.required_bytes - fit.usable_bytes) / size, height=0.75,
                    left=fit.usable_bytes / size, color=NO_FIT_COLOR, alpha=0.35)
        price = prices.get(fit.gpu)
        price_text = f", ${price:.2f}/h" if price else ""
        tips[gid] = (f"{fit.gpu}: needs {fit.required_bytes / size:,.2f} of "
                     f"{fit.usable_bytes / size:,.2f} {unit} usable; headroom "
                     f"{fit.headroom_bytes / size:,.2f} {unit} "
                     f"({100 * fit.headroom_fraction:.0f}%){price_text}")
    ax.set_yticks(range(len(fits)), [f.gpu for f in fits], fontsize=7)
    ax.set_xlabel(f"memory per GPU ({unit}): needed (colour) of usable (grey)")
    ax.set_title("Does it fit?")
    ax.spines[["top", "right"]].set_visible(False)
    return fig, tips


# --- the trace timeline --------------------------------------------------------------------


def timeline_figure(report: MemoryReport) -> tuple[Figure, Tips]:
    """Live allocated bytes over the traced step, with a marker where each phase starts."""
    events = report.timeline
    unit, size = unit_for(*(b for _, b in events))
    fig = _figure(6.4, 2.8)
    ax = fig.add_subplot()
    tips: Tips = {}
    ax.plot(range(len(events)), [b / size for _, b in events], color="#0072B2", linewidth=1)
    previous = None
    for i, (event, _) in enumerate(events):
        phase = event.split(":", 1)[0]
        if phase != previous:
            gid = f"vp-phase-start-{i}"
            ax.axvline(i, color="#999999", linestyle="--", linewidth=0.8, gid=gid)
            ax.annotate(phase, (i, 1), xycoords=("data", "axes fraction"), fontsize=8,
                        xytext=(3, -10), textcoords="offset points")
            tips[gid] = f"{phase} starts at event {i}: {event}"
            previous = phase
    if events:
        peak = max(range(len(events)), key=lambda i: events[i][1])
        ax.plot([peak], [events[peak][1] / size], "o", color=NO_FIT_COLOR, gid="vp-peak")
        tips["vp-peak"] = f"peak {events[peak][1] / size:,.3f} {unit} at {events[peak][0]}"
    ax.set_xlabel("allocation event")
    ax.set_ylabel(f"allocated ({unit})")
    ax.set_title("Memory over the step (trace)")
    ax.spines[["top", "right"]].set_visible(False)
    return fig, tips


# --- sweeps --------------------------------------------------------------------------------


def sweep_heatmap_figure(rows: Sequence[Mapping[str, Any]],
                         limits: Mapping[str, int] | None = None) -> tuple[Figure, Tips]:
    """Device memory over batch size (x) x sequence length (y); for each GPU in `limits`
    (name -> bytes a point must stay within), a line around the points that fit."""
    import numpy as np

    batches = sorted({r["batch_size"] for r in rows})
    seqs = sorted({r["seq_len"] for r in rows if r["seq_len"] is not None})
    values = {(r["batch_size"], r["seq_len"]): r.get("device_total") for r in rows}
    unit, size = unit_for(*(v for v in values.values()))
    grid = np.full((len(seqs), len(batches)), np.nan)
    for (b, s), v in values.items():
        if v is not None and s in seqs:
            grid[seqs.index(s), batches.index(b)] = v / size
    fig = _figure(6.4, 1.4 + 0.4 * max(len(seqs), 1))
    ax = fig.add_subplot()
    image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis")
    fig.colorbar(image, ax=ax, label=f"device total ({unit})")
    tips: Tips = {}
    for (b, s), v in values.items():
        if s not in seqs:
            continue
        x, y = batches.index(b), seqs.index(s)
        text = "OOM" if v is None else f"{v / size:.1f}"
        gid = f"vp-cell-{x}-{y}"
        ax.text(x, y, text, ha="center", va="center", fontsize=7, color="white", gid=gid)
        tips[gid] = f"batch {b} x seq {s}: " + (
            "out of memory" if v is None else f"{v / size:,.2f} {unit}")
    styles = ["-", "--", ":", "-."]
    for n, (gpu, limit) in enumerate((limits or {}).items()):
        fits = [[values.get((b, s)) is not None and values[(b, s)] <= limit for b in batches]
                for s in seqs]
        xs, ys = _boundary(fits)
        if xs:
            gid = f"vp-boundary-{n}"
            ax.plot(xs, ys, color="white" if n == 0 else "#ffcc00", linewidth=2,
                    linestyle=styles[n % len(styles)], label=gpu, gid=gid)
            tips[gid] = f"{gpu}: points left of / below this line fit in {limit / size:,.2f} {unit}"
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_yticks(range(len(seqs)), [str(s) for s in seqs])
    ax.set_xlabel("batch size")
    ax.set_ylabel("sequence length")
    ax.set_title("Peak device memory; lines: fit boundary per GPU")
    if ax.get_legend_handles_labels()[0]:  # the lines are white / yellow: a dark legend
        # box shows them in the colours they have on the map
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.25, 1), frameon=True,
                  facecolor="#3a4252", edgecolor="#3a4252", labelcolor="white")
    return fig, tips


def _boundary(fits: list[list[bool]]) -> tuple[list[float], list[float]]:
    """A staircase along the right edge of each row's fitting cells (cells are 1 x 1,
    centred on integers); rows that fit nowhere put the line at the left edge."""
    xs: list[float] = []
    ys: list[float] = []
    for y, row in enumerate(fits):
        edge = (max((x for x, ok in enumerate(row) if ok), default=-1)) + 0.5
        xs += [edge, edge]
        ys += [y - 0.5, y + 0.5]
    return (xs, ys) if any(x > -0.5 for x in xs) else ([], [])


# --- comparisons ---------------------------------------------------------------------------


def compare_figure(reports: Mapping[str, MemoryReport]) -> tuple[Figure, Tips]:
    """Grouped bars per category, one bar per engine; the last engine is the reference."""
    names = list(reports)
    figures = [c for c in CATEGORIES if any(r.categories[c] for r in reports.values())]
    unit, size = unit_for(*(r.device_total for r in reports.values()))
    fig = _figure(6.4, 3.0)
    ax = fig.add_subplot()
    tips: Tips = {}
    width = 0.8 / max(len(names), 1)
    reference = reports[names[-1]]
    for n, name in enumerate(names):
        for x, category in enumerate(figures):
            value = reports[name].categories[category]
            gid = f"vp-cmp-{n}-{x}"
            ax.bar(x + (n - (len(names) - 1) / 2) * width, value / size, width,
                   color=f"C{n}", gid=gid, label=name if x == 0 else None)
            ref = reference.categories[category]
            error = f", {100 * (value - ref) / ref:+.1f}% vs {names[-1]}" if (
                ref and name != names[-1]) else ""
            tips[gid] = f"{name}, {label(category)}: {value / size:,.3f} {unit}{error}"
    ax.set_xticks(range(len(figures)), [label(c) for c in figures], rotation=30, ha="right",
                  fontsize=7)
    ax.set_ylabel(unit)
    ax.set_title(f"Engines compared (reference: {names[-1]})")
    ax.legend(fontsize=7, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return fig, tips


# --- plans ---------------------------------------------------------------------------------


def plan_axes(plan) -> tuple[str, str, Any, Any]:
    """What a plan's scatter shows: training time and cost when the amount of training is
    known, else time and cost per million tokens."""
    if any(c.training_time_s is not None and c.cost_usd is not None for c in plan.candidates):
        return ("training time (hours)", "cost (USD)",
                lambda c: c.training_time_s and c.training_time_s / 3600, lambda c: c.cost_usd)
    return ("seconds per million tokens", "USD per million tokens",
            lambda c: c.tokens_per_s and 1e6 / c.tokens_per_s,
            lambda c: c.cost_per_million_tokens)


def plan_figure(plan) -> tuple[Figure, Tips]:
    """Cost against time of every candidate, the Pareto front as a line, and the three
    picks labelled (a vramplan.planning.planner.Plan)."""
    xlabel, ylabel, x_of, y_of = plan_axes(plan)
    fig = _figure(6.4, 3.6)
    ax = fig.add_subplot()
    tips: Tips = {}
    shown = set()  # each kind of point once in the legend, in the colour it is drawn in
    for n, c in enumerate(plan.candidates):
        x, y = x_of(c), y_of(c)
        if x is None or y is None:
            continue
        gid = f"vp-plan-{n}"
        on_front = any(c == f for f in plan.front)
        kind = "on the front" if on_front else "other configurations"
        ax.plot([x], [y], "o", color="#0072B2" if on_front else "#9aa5b8", markersize=6,
                gid=gid, label=None if kind in shown else kind)
        shown.add(kind)
        tips[gid] = (f"{c.num_gpus} x {c.gpu}: {xlabel} {x:,.3g}, {ylabel} {y:,.4g}; step "
                     f"{c.step_time_s:.3g} s, MFU {100 * c.mfu:.0f}%, headroom "
                     f"{100 * c.headroom_fraction:.0f}%; flags: {c.flags}")
    front = sorted((p for p in plan.front if x_of(p) is not None and y_of(p) is not None),
                   key=x_of)
    if front:
        ax.plot([x_of(p) for p in front], [y_of(p) for p in front], "-", color="#0072B2",
                linewidth=1, label="Pareto front (cost vs time)")
    for choice in (plan.cheapest, plan.fastest, plan.recommended):
        if choice is None or x_of(choice.candidate) is None or y_of(choice.candidate) is None:
            continue
        c = choice.candidate
        ax.annotate(f"{choice.label}: {c.num_gpus} x {c.gpu}", (x_of(c), y_of(c)), fontsize=7,
                    xytext=(6, 6 + 8 * ("cheapest", "fastest", "recommended").index(
                        choice.label)), textcoords="offset points")
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{plan.model}: cost against time")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return fig, tips


# --- output --------------------------------------------------------------------------------


def figure_svg(fig: Figure, tips: Tips | None = None) -> str:
    """The figure as an inline <svg> element with hover text; text stays text."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    FigureCanvasSVG(fig)
    buffer = io.StringIO()
    with _SVG_LOCK, rc_context(_SVG_RC):
        fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML declaration and doctype: inline in HTML
    for gid, text in (tips or {}).items():
        svg = re.sub(rf'(<g id="{re.escape(gid)}"[^>]*>)',
                     lambda m, text=text: f"{m.group(1)}<title>{html.escape(text)}</title>",
                     svg, count=1)
    return svg


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write the figure to PNG, SVG or PDF, chosen by the file's suffix."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg", "pdf"):
        from vramplan.errors import VramplanError
        raise VramplanError(f"cannot write a figure to {path.name!r}: use a .png, .svg or "
                            ".pdf file name")
    FigureCanvasAgg(fig)
    with _SVG_LOCK, rc_context_for(fmt):
        fig.savefig(path, format=fmt, dpi=130, metadata=_metadata(fmt))
    return path


def rc_context_for(fmt: str):
    from matplotlib import rc_context

    return rc_context(_SVG_RC if fmt == "svg" else {"font.size": 9})


def _metadata(fmt: str) -> dict | None:
    return {"Date": None, "Creator": None} if fmt == "svg" else None


def report_figures(report: MemoryReport) -> dict[str, tuple[Figure, Tips]]:
    """Every figure a report has data for, by name (breakdown, fit, timeline)."""
    figures = {"breakdown": breakdown_figure(report)}
    if report.fits:
        figures["fit"] = fit_figure(report, gpu_prices(f.gpu for f in report.fits))
    if report.timeline:
        figures["timeline"] = timeline_figure(report)
    return figures


def save_report_figures(report: MemoryReport, path: str | Path) -> list[Path]:
    """--plot PATH: the breakdown goes to PATH; the other figures beside it, named
    PATH's stem + '-fit', '-timeline' with the same suffix."""
    path = Path(path)
    written = []
    for name, (fig, _) in report_figures(report).items():
        target = path if name == "breakdown" else path.with_name(f"{path.stem}-{name}{path.suffix}")
        written.append(save_figure(fig, target))
    return written


def gpu_prices(names) -> dict[str, float | None]:
    """Catalog price per hour of each named GPU (None when unknown or not in the catalog)."""
    from vramplan.errors import VramplanError
    from vramplan.hardware import get_gpu

    prices: dict[str, float | None] = {}
    for name in names:
        try:
            prices[name] = get_gpu(name).price_per_hour
        except VramplanError:
            prices[name] = None
    return prices
