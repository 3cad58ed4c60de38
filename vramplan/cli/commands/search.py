"""`vramplan search batch-size|seq-len|num-gpus` and `vramplan sweep`: thin shells over
vramplan.search (and the planner's GPU count search).

    vramplan search batch-size llama-3.2-1b -s 2048 --gpu L4
    vramplan search num-gpus llama-3.1-70b -s 2048 --gpu H100-SXM
    vramplan search seq-len llama-3.2-1b -b 4 --budget 40GiB --engine trace
    vramplan sweep llama-3.2-1b --batch-sizes 1,2,4,8 --seq-lens 512,1024 --gpu L4 --plot m.png
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from vramplan import search as _search
from vramplan.cli.options import (
    EXIT_DOES_NOT_FIT,
    EXIT_INTERRUPTED,
    AsJson,
    EngineName,
    HtmlOut,
    MarginOpt,
    Out,
    check_writable,
    console,
    counting,
    job_command,
    json_text,
    print_json,
    progress,
    require_charts,
    write_html,
    write_or_print,
)
from vramplan.errors import JobError
from vramplan.fit import SAFETY_MARGIN, limit_bytes
from vramplan.job import Job
from vramplan.search.oracle import budget_of, explaining_engine, oracle_for
from vramplan.units import GiB, MiB

search_app = typer.Typer(help="Largest batch size or sequence length, or fewest GPUs, that "
                         "fits.",
                         no_args_is_help=True)

Budget = Annotated[Optional[str], typer.Option(
    help="memory to fit in, e.g. 24GiB (default: the usable memory of --gpu)")]
Margin = MarginOpt
Device = Annotated[Optional[str], typer.Option(help="measure only: cuda or cpu (default: "
                                               "cuda when available)")]


# --- views ---------------------------------------------------------------------------------


def _unit(*sizes: int | None) -> tuple[str, int]:
    """GiB, or MiB when everything is under 1 GiB (tiny test models)."""
    return ("GiB", GiB) if max((n or 0 for n in sizes), default=0) >= GiB else ("MiB", MiB)


def _size(n: int | None, unit: tuple[str, int]) -> str:
    return "-" if n is None else f"{n / unit[1]:,.2f}"


def print_search(result: _search.SearchResult, what: str,
                 cap_reason: str = "the maximum asked for; more may fit") -> None:
    name = result.parameter.replace("_", " ")
    unit = _unit(result.budget_bytes)
    table = Table(title=f"{name} search", caption=(
        f"fits iff peak <= {_size(result.limit_bytes, unit)} {unit[0]} = {what} "
        f"{_size(result.budget_bytes, unit)} {unit[0]} x (1 - {result.margin:g} margin)"))
    for col in ("trial", name, f"peak {unit[0]}", "fits"):
        table.add_column(col, justify="right")
    for i, t in enumerate(result.trials, 1):
        verdict = "yes" if t.fits else ("OOM" if t.peak is None else "no")
        table.add_row(str(i), str(t.value), _size(t.peak, unit), verdict)
    console.print(table)
    if result.interrupted:  # the trials so far; no verdict on larger values
        if result.best is not None:
            console.print(f"[bold]largest {name} seen to fit: {result.best}[/] (a lower "
                          "bound: the search was interrupted)")
        return
    if result.best is not None:
        capped = f" ({cap_reason})" if result.capped else ""
        console.print(f"[bold]largest {name} that fits: {result.best}[/]{capped}, "
                      f"found in {len(result.trials)} trials")
        if result.limited_by:
            console.print(f"  larger values are refused: {result.limited_by}")
        return
    smallest = result.trials[0].value
    console.print(f"[bold red]does not fit even at {name} {smallest}[/]"
                  + (f": {result.largest_category.replace('_', ' ')} fill most of the memory"
                     if result.largest_category else ""))
    for s in result.suggestions:
        console.print(f"  try: {s}")


# --- search batch-size / seq-len ----------------------------------------------------------------


@search_app.command("batch-size")
@job_command
def batch_size(
    job: Job, engine: EngineName = "formula", budget: Budget = None, margin: Margin = SAFETY_MARGIN,
    maximum: Annotated[Optional[int], typer.Option(help="largest batch size to try")] = None,
    device: Device = None, as_json: AsJson = False, out: Out = None, html: HtmlOut = None,
) -> None:
    """Largest micro-batch size that fits (exact), by doubling then bisection.

    Example: vramplan search batch-size llama-3.2-1b -s 2048 --gpu L4
    """
    check_writable(out, html)
    require_charts(html)
    limit, what = budget_of(job, budget)
    with progress(f"search batch size ({engine})", quiet=as_json) as update, \
            _keeping_trials() as kept:
        kept.result = _search.max_batch_size(
            job, counting(oracle_for(engine, budget_bytes=limit, device=device), update,
                          "batch_size"), limit, margin=margin, maximum=maximum,
            explain=explaining_engine(engine))
    result = kept.result
    _write_html(html, result, job, "search batch-size", engine)
    _finish(result, what, as_json, out)


@search_app.command("seq-len")
@job_command
def seq_len(
    job: Job, engine: EngineName = "formula", budget: Budget = None, margin: Margin = SAFETY_MARGIN,
    granularity: Annotated[int, typer.Option(help="answer is a multiple of this")] = 64,
    maximum: Annotated[Optional[int], typer.Option(help="longest sequence to try")] = None,
    device: Device = None, as_json: AsJson = False, out: Out = None, html: HtmlOut = None,
) -> None:
    """Longest sequence (a multiple of --granularity) that fits at the job's batch size.

    Example: vramplan search seq-len llama-3.2-1b -b 4 --gpu A100-40GB --engine trace
    """
    check_writable(out, html)
    require_charts(html)
    limit, what = budget_of(job, budget)
    positions = None if maximum else _max_positions(job)
    with progress(f"search sequence length ({engine})", quiet=as_json) as update, \
            _keeping_trials() as kept:
        kept.result = _search.max_seq_len(
            job, counting(oracle_for(engine, budget_bytes=limit, device=device), update,
                          "seq_len"), limit, margin=margin, granularity=granularity,
            maximum=maximum or positions, explain=explaining_engine(engine))
    result = kept.result
    _write_html(html, result, job, "search seq-len", engine)
    _finish(result, what, as_json, out,
            f"the longest the model accepts: {positions} positions" if positions else None)


@search_app.command("num-gpus")
@job_command
def num_gpus(
    job: Job, margin: Margin = SAFETY_MARGIN,
    max_gpus: Annotated[int, typer.Option(help="most GPUs to try")] = 1024,
    as_json: AsJson = False, out: Out = None,
) -> None:
    """Fewest GPUs of the --gpu type that fit the job: the planner's counts (1, 2, 4, 8,
    then whole nodes) and layouts (ZeRO-2 then FSDP, or the job's own --strategy; then
    tensor / pipeline / context parallel), with the job's optimizer implementation and
    the fused one; formula engine. Equals `plan`'s fewest GPUs.

    The micro-batch per GPU stays as given. Exit code 1 when no count up to --max-gpus fits.

    Example: vramplan search num-gpus llama-3.1-70b -s 2048 --gpu H100-SXM
    """
    from vramplan.hardware import get_gpu
    from vramplan.planning.gpu_count import search_gpu_count

    check_writable(out)
    if not job.gpu:
        raise JobError("search num-gpus needs the GPU type to count: --gpu NAME "
                       "(e.g. --gpu H100-SXM)")
    result = search_gpu_count(job, get_gpu(job.gpu), margin=margin, max_gpus=max_gpus)
    data = result.to_dict()
    if as_json:
        print_json(data)
    else:
        _print_gpu_count(result)
    if out:
        write_or_print(out, json_text(data))
    if not result.fits:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def _print_gpu_count(result) -> None:
    unit = _unit(result.usable_bytes)
    table = Table(title=f"GPU count search on {result.gpu}", caption=(
        f"fits iff device total per GPU <= {_size(result.limit_bytes, unit)} {unit[0]} = "
        f"{result.gpu} usable {_size(result.usable_bytes, unit)} {unit[0]} x "
        f"(1 - {result.margin:g} margin)"))
    for col in ("trial", "GPUs", "strategy", "layout", f"per GPU {unit[0]}", "fits"):
        table.add_column(col, justify="left" if col in ("strategy", "layout") else "right")
    for i, t in enumerate(result.trials, 1):
        verdict = "yes" if t.fits else ("refused" if t.device_total_bytes is None else "no")
        table.add_row(str(i), str(t.num_gpus), t.strategy, t.layout,
                      _size(t.device_total_bytes, unit), verdict)
    console.print(table)
    if result.fits:
        console.print(f"[bold]fewest {result.gpu} GPUs that fit: {result.best}[/] "
                      f"({result.strategy}), found in {len(result.trials)} trials")
        if result.flags:
            console.print(f"  flags: {result.flags}", soft_wrap=True)
        return
    console.print(f"[bold red]does not fit on up to {result.max_gpus} {result.gpu} GPUs[/]")
    if result.hint:
        console.print(f"  {result.hint}", soft_wrap=True)
    for t in result.trials:
        if t.problem:
            console.print(f"  {t.num_gpus} GPUs, {t.strategy}: {t.problem}", soft_wrap=True)
            break


class _Kept:
    result: _search.SearchResult | None = None


@contextlib.contextmanager
def _keeping_trials():
    """Ctrl-C during a search keeps the trials done so far (shown, written, exit 130)."""
    kept = _Kept()
    try:
        yield kept
    except _search.SearchInterrupted as stop:
        kept.result = stop.result


def _finish(result: _search.SearchResult, what: str, as_json: bool, out: Path | None,
            cap_reason: str | None = None) -> None:
    """Print (and write) a search result; exit code 1 when even the smallest value fails,
    130 (after the trials so far) when Ctrl-C stopped it."""
    if as_json:
        print_json(result.to_dict())
    else:
        print_search(result, what, *([cap_reason] if cap_reason else []))
    if out:
        write_or_print(out, json_text(result.to_dict()))
    if result.interrupted:
        sys.stderr.write(f"interrupted: {result.interrupted}\n")
        raise SystemExit(EXIT_INTERRUPTED)  # typer.Exit(130) reads as a bare Ctrl-C in main
    if not result.fits:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def _write_html(path: Path | None, result: _search.SearchResult, job: Job, command: str,
                engine: str) -> None:
    if path:
        from vramplan.views.command import cli_command
        from vramplan.views.html import search_html

        extra = () if engine == "formula" else ("--engine", engine)
        write_html(path, search_html(result.to_dict(), job=job,
                                     command=cli_command(job, command, extra)))


def _max_positions(job: Job) -> int | None:
    """The model's length (its learned table or training length), when the catalog knows it."""
    try:
        from vramplan.models import load_architecture
        return load_architecture(job.model).max_positions
    except Exception:  # noqa: BLE001 - a factory model or unknown config: no limit known
        return None


# --- sweep ------------------------------------------------------------------------------------


def _ints(text: str | None, option: str) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:  # an empty value is a mistake, not "use the default"
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise JobError(f"{option} takes comma-separated whole numbers, e.g. 1,2,4,8 "
                       f"(got {shown!r})")
    return values


@job_command
def sweep(
    job: Job,
    batch_sizes: Annotated[Optional[str], typer.Option(help="e.g. 1,2,4,8")] = None,
    seq_lens: Annotated[Optional[str], typer.Option(help="e.g. 512,1024,2048")] = None,
    engine: EngineName = "formula", budget: Budget = None, margin: Margin = SAFETY_MARGIN,
    steps: Annotated[int, typer.Option(help="measure only: timed steps per point")] = 3,
    device: Device = None,
    out: Out = None,
    plot_out: Annotated[Optional[Path], typer.Option("--plot", help="write a plot (.png or "
                                                     ".svg)")] = None,
    html: HtmlOut = None,
    as_json: AsJson = False,
) -> None:
    """Peak memory (and step time, throughput, loss when measuring) over a grid.

    Example: vramplan sweep llama-3.2-1b --batch-sizes 1,2,4,8 --seq-lens 512,1024 --gpu L4
    --plot memory.png
    """
    check_writable(out, plot_out, html)
    require_charts(plot_out, html)
    batches = _ints(batch_sizes, "--batch-sizes") or [job.batch_size]
    seqs = _ints(seq_lens, "--seq-lens") or [job.seq_len]
    limit, what = budget_of(job, budget) if (budget or job.gpu) else (None, "")
    oracle = oracle_for(engine, budget_bytes=limit, device=device, steps=steps, warmup=1)
    total = len(batches) * len(seqs)
    interrupted = ""
    try:
        if as_json or total == 1:
            rows = _search.sweep(job, oracle, batches, seqs, budget_bytes=limit, margin=margin)
        else:
            from rich.progress import Progress
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task(f"{engine}: {total} points", total=total)
                rows = _search.sweep(job, oracle, batches, seqs, budget_bytes=limit,
                                     margin=margin, on_row=lambda row: progress.advance(task))
    except _search.SweepInterrupted as stop:  # Ctrl-C: show and write what was completed
        rows, interrupted = stop.rows, str(stop)
    if out:
        write_or_print(out, _search.rows_csv(rows) if out.suffix == ".csv"
                       else json_text(rows))
    if plot_out:
        _search.plot(rows, plot_out, limit_bytes=limit, limit_label=what or "limit",
                     title=f"{job.model}: peak memory ({engine})")
    if html:
        from vramplan.views.command import cli_command
        from vramplan.views.html import sweep_html

        words = ["--batch-sizes", ",".join(map(str, batches))]
        words += ["--seq-lens", ",".join(map(str, seqs))] if seq_lens else []
        words += ["--engine", engine] if engine != "formula" else []
        words += ["--budget", budget] if budget else []
        limits = {job.gpu or "budget": limit_bytes(limit, margin)} if limit else {}
        write_html(html, sweep_html(rows, job=job, limits=limits, engine=engine,
                                    command=cli_command(job, "sweep", tuple(words))))
    if as_json:
        print_json(rows)
    else:
        _print_rows(rows, limit, what)
        for path in (out, plot_out):
            if path:
                console.print(f"wrote {path}")
    if interrupted:  # typer turns a KeyboardInterrupt into a bare exit 130: say why here
        sys.stderr.write(f"interrupted: {interrupted}; the completed points are above\n")
        raise SystemExit(EXIT_INTERRUPTED)


def _print_rows(rows: list[dict], limit: int | None, what: str) -> None:
    title = "sweep" + (f" (fits: peak <= {what} x (1 - margin))" if limit else "")
    table = Table(title=title)
    measured = any(r["step_time_s"] is not None for r in rows)
    unit = _unit(limit, *(r["device_total"] for r in rows))
    cols = ["batch", "seq len", f"peak alloc {unit[0]}", f"device {unit[0]}", "fits"]
    cols += ["step s", "samples/s", "tokens/s", "final loss"] if measured else []
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        fits = "OOM" if r["error"] else {True: "yes", False: "no", None: "-"}[r["fits"]]
        cells = [str(r["batch_size"]), str(r["seq_len"] or "-"), _size(r["peak_allocated"], unit),
                 _size(r["device_total"], unit), fits]
        if measured:
            cells += [_num(r["step_time_s"], ".3f"), _num(r["samples_per_s"], ",.1f"),
                      _num(r["tokens_per_s"], ",.0f"), _num(r["final_loss"], ".4f")]
        table.add_row(*cells)
    console.print(table)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def register(app: typer.Typer) -> None:
    app.add_typer(search_app, name="search")
    app.command("sweep")(sweep)

