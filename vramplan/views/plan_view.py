"""Terminal views of predicted performance and of a plan (rich)."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vramplan.planning.results import Performance

GiB = 2**30


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.3g} s"


def money(usd: float | None) -> str:
    return "-" if usd is None else f"${usd:,.0f}" if usd >= 100 else f"${usd:,.2f}"


def cost_words(perf: Performance) -> str:
    """The training's cost with its 80% interval; without an amount (--tokens ...), the cost
    of a million tokens; '-' without a price."""
    if perf.cost_usd is not None:
        return money(perf.cost_usd) + _ranges((perf.cost_range_usd, money))
    if perf.cost_per_million_tokens_usd is not None:
        return per_million(perf.cost_per_million_tokens_usd) + " / M tokens"
    return "-"


def per_million(usd: float) -> str:
    """A million tokens' cost: cents matter (an L4's is about $0.05), so three decimals."""
    return f"${usd:.3f}"


def print_performance(perf: Performance, console: Console) -> None:
    console.print(f"\n[bold]Performance[/bold] on {perf.num_gpus} x {perf.gpu} "
                  f"({perf.compute_dtype} {perf.cores}; factors: {escape(perf.factors)})")
    table = Table(show_header=True, header_style="bold")
    for column in ("phase", "time", "x per step", "bound"):
        table.add_column(column, justify="left" if column in ("phase", "bound") else "right")
    for p in perf.phases:
        table.add_row(p.phase, f"{1000 * p.time_s:,.1f} ms", str(p.per_step), p.bound)
    console.print(table)
    span = ""
    if perf.step_time_range_s:
        lo, hi = perf.step_time_range_s
        span = f" (80%: {1000 * lo:,.1f}-{1000 * hi:,.1f} ms)"
    console.print(f"step {1000 * perf.step_time_s:,.1f} ms{span}, "
                  f"{perf.tokens_per_s:,.0f} tokens/s "
                  f"({perf.tokens_per_s_per_gpu:,.0f} per GPU), {perf.samples_per_s:,.2f} "
                  f"samples/s, MFU {100 * perf.mfu:.0f}%, bound by {perf.bound}")
    if perf.training_time_s is not None:
        t_span = _ranges((perf.training_time_range_s, duration))
        c_span = _ranges((perf.cost_range_usd, money))
        console.print(f"training: {perf.steps:,.0f} steps, {duration(perf.training_time_s)}"
                      f"{t_span}, {perf.gpu_hours:,.1f} GPU-hours, "
                      + (f"{money(perf.cost_usd)}{c_span} at ${perf.price_per_hour:g}/GPU-hour"
                         if perf.cost_usd is not None else "no price known (--price-per-hour)"))
    elif perf.cost_per_million_tokens_usd is not None:
        console.print(f"cost: {per_million(perf.cost_per_million_tokens_usd)} per million "
                      f"tokens at ${perf.price_per_hour:g}/GPU-hour (--tokens for a training's "
                      "cost)")
    for note in perf.notes:
        console.print(f"  note: {escape(note)}")


def print_plan(plan, console: Console) -> None:
    """The plan: candidates with the picks marked, the reasons, what was ruled out."""
    if plan.status == "nothing-fits":
        console.print(f"[bold red]Nothing fits.[/bold red] Closest: {plan.closest_miss}")
        for fix in plan.to_fit:
            console.print(f"  would fit with {fix}")
    elif plan.status == "constraints-unmet":
        console.print(f"[bold red]Nothing meets the cost or deadline.[/bold red] "
                      f"{plan.closest_miss}")
    else:
        marks = {}
        for choice in (plan.recommended, plan.cheapest, plan.fastest):
            key = (choice.candidate.gpu, choice.candidate.num_gpus)
            marks[key] = ", ".join(filter(None, [marks.get(key), choice.label]))
        front = {(c.gpu, c.num_gpus) for c in plan.front}
        table = Table(show_header=True, header_style="bold")
        for column in ("#", "GPUs", "time", "cost", "tokens/s", "MFU", "bound", "memory",
                       "pick"):
            table.add_column(column, justify="left" if column in ("GPUs", "bound", "pick")
                             else "right")
        for i, c in enumerate(plan.candidates, 1):
            key = (c.gpu, c.num_gpus)
            owned = " (owned)" if c.hardware == "owned" else ""
            table.add_row(str(i), f"{c.num_gpus} x {c.gpu}{owned}", duration(c.training_time_s),
                          money(c.cost_usd) if c.cost_usd is not None else (
                              per_million(c.cost_per_million_tokens) + "/Mtok"
                              if c.cost_per_million_tokens else "-"),
                          f"{c.tokens_per_s:,.0f}", f"{100 * c.mfu:.0f}%", c.bound,
                          f"{c.device_total_bytes / GiB:.0f}/{c.usable_bytes / GiB:.0f}G",
                          marks.get(key, "front" if key in front else ""))
        console.print(table)
        for i, c in enumerate(plan.candidates, 1):
            console.print(f"{i}. {c.flags or '(as given)'}", soft_wrap=True)
        for choice in (plan.recommended, plan.cheapest, plan.fastest):
            c = choice.candidate  # the table ranks by the central estimates
            console.print(f"[bold]{choice.label}[/bold]: {choice.reason}" + _ranges(
                (c.training_time_range_s, duration), (c.cost_range_usd, money)))
    if plan.ruled_out:
        console.print("\nRuled out:")
        for r in plan.ruled_out:
            console.print(f"  {r.gpu}: {r.reason}")
    for note in plan.notes:
        console.print(f"note: {escape(note)}")


def _ranges(*intervals: tuple[tuple[float, float] | None, Callable[[float], str]]) -> str:
    """' (80%: low-high, ...)' of the intervals that exist, each shown by its formatter."""
    spans = [f"{show(span[0])}-{show(span[1])}" for span, show in intervals if span]
    return f" (80%: {', '.join(spans)})" if spans else ""


def print_per_gpu(rows, console: Console) -> None:
    """Time and cost per GPU type (estimate without --gpu)."""
    table = Table(show_header=True, header_style="bold")
    amount = any(perf is not None and perf.cost_usd is not None for _, perf in rows)
    for column in ("GPU", "fits", "headroom", "step", "tokens/s", "time",
                   "cost" if amount else "$/M tokens"):
        table.add_column(column, justify="left" if column in ("GPU", "fits") else "right")
    for fit, perf in rows:
        table.add_row(fit.gpu, "yes" if fit.fits else "no",
                      f"{100 * fit.headroom_bytes / fit.usable_bytes:+.0f}%",
                      f"{1000 * perf.step_time_s:,.0f} ms" if perf else "-",
                      f"{perf.tokens_per_s:,.0f}" if perf else "-",
                      duration(perf.training_time_s) if perf else "-",
                      _cost_cell(perf))
    console.print(table)


def _cost_cell(perf: Performance | None) -> str:
    """The training's cost; without an amount (--tokens ...), the cost of a million tokens
    (the column says so), which is what --sort cost then sorts on."""
    if perf is None:
        return "-"
    if perf.cost_usd is not None:
        return money(perf.cost_usd)
    if perf.cost_per_million_tokens_usd is None:
        return "-"
    return per_million(perf.cost_per_million_tokens_usd)
