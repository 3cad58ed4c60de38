"""`vramplan measure` and `vramplan compare`: thin shells over the measure engine.

    vramplan measure llama-3.2-1b -b 4 -s 1024 --steps 5
    vramplan measure qwen2.5-0.5b -b 2 -s 1024 --emulate-gpu L4  # on a bigger GPU
    vramplan compare llama-3.2-1b -b 4 --engines formula,trace,measure
    torchrun --standalone --nproc-per-node 2 -m vramplan measure MODEL --num-gpus 2 \
        --strategy fsdp                                          # per rank, rank 0 aggregates
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer
from rich.table import Table

from vramplan.cli.options import (
    EXIT_BAD_INPUT,
    EXIT_DOES_NOT_FIT,
    EXIT_INTERRUPTED,
    AsJson,
    HtmlOut,
    Out,
    check_writable,
    console,
    job_command,
    json_text,
    print_json,
    progress,
    require_charts,
    write_html,
    write_or_print,
)
from vramplan.compare import comparison_rows, run_for_compare
from vramplan.engines.memory_report import MemoryReport
from vramplan.engines.oom import describe_oom, is_out_of_memory
from vramplan.errors import EngineError, JobError
from vramplan.job import Job
from vramplan.units import GiB, MiB, parse_bytes

Steps = Annotated[int, typer.Option(help="timed optimizer steps")]
Warmup = Annotated[int, typer.Option(help="steps run before timing (allocations settle)")]
Device = Annotated[Optional[str], typer.Option(help="cuda or cpu (default: cuda when "
                                               "available)")]


@job_command
def measure(
    job: Job, steps: Steps = 5, warmup: Warmup = 2,
    emulate_gpu: Annotated[Optional[str], typer.Option(
        help="cap this process to that GPU's usable memory, e.g. L4 (CUDA)")] = None,
    budget: Annotated[Optional[str], typer.Option(
        help="memory limit, e.g. 4GiB: on the CPU a step over it counts as out of memory")]
    = None,
    device: Device = None,
    out: Out = None,
    html: HtmlOut = None,
    as_json: AsJson = False,
) -> None:
    """Run real training steps with synthetic data and report memory, time and loss.

    Example: vramplan measure qwen2.5-0.5b -b 2 -s 1024 --steps 5 --emulate-gpu L4
    """
    from vramplan.engines.registry import require_torch

    check_writable(out, html)
    if emulate_gpu:  # before torch loads: an unknown name is refused at once
        from vramplan.hardware import get_gpu

        get_gpu(emulate_gpu)
    require_torch("measure")
    from vramplan.engines.measure import measure as run

    require_charts(html)
    try:
        with progress(f"measuring {warmup} + {steps} steps", quiet=as_json):
            report = run(job, steps=steps, warmup=warmup, emulate_gpu=emulate_gpu,
                         budget_bytes=parse_bytes(budget) if budget else None, device=device)
    except Exception as error:  # noqa: BLE001 - out of memory is an answer, not a crash
        if not is_out_of_memory(error):
            raise
        limit = f" (--emulate-gpu {emulate_gpu} caps this process to its memory)" \
            if emulate_gpu else ""
        console.print(f"[bold red]out of memory[/]: {describe_oom(error)}{limit}\n"
                      "  try: vramplan search batch-size ... to find what fits")
        raise typer.Exit(EXIT_DOES_NOT_FIT) from None
    if os.environ.get("RANK", "0") != "0":
        return  # under torchrun, rank 0 holds every rank's figures and prints them
    if out:
        write_or_print(out, json_text(report.to_json_dict()))
    if html:
        from vramplan.views.command import cli_command
        from vramplan.views.html import report_html

        words = ("--steps", str(steps), "--warmup", str(warmup))
        write_html(html, report_html(report, command=cli_command(job, "measure", words)))
    if as_json:
        print_json(report.to_json_dict())
    else:
        from vramplan.views.terminal import print_report

        print_report(report, console, highlight_gpu=job.gpu)
        print_measured(report)
        if out:
            console.print(f"wrote {out}")
    _exit_if_incomplete(report)


def _exit_if_incomplete(report: MemoryReport) -> None:
    """A run that stopped early was shown (and written) above; its exit code says so: 130
    for Ctrl-C, 2 when not one step completed (the peak is not a step's)."""
    m = report.measured
    if m is None or m.complete:
        return
    if m.stopped.startswith("interrupted"):
        sys.stderr.write(f"{m.stopped}; the partial result is above\n")
        raise SystemExit(EXIT_INTERRUPTED)
    if m.steps == 0:
        raise EngineError(f"no training step completed ({m.stopped}); the figures above are "
                          "a partial step's, not a measurement")


def print_measured(report: MemoryReport) -> None:
    m = report.measured.model_dump() if report.measured else {}
    table = Table(title=f"measured on {m.get('device', '?')}: {m.get('steps', 0)} steps "
                        f"({m.get('warmup', 0)} warm-up)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("step time median / p90", _pair(m.get("step_time_median_s"), m.get("step_time_p90_s"),
                                         "{:.3f} s")),
        ("samples/s", _fmt(m.get("samples_per_s"), "{:,.1f}")),
        ("tokens/s", _fmt(m.get("tokens_per_s"), "{:,.0f}")),
        ("loss first -> last", _pair((m.get("losses") or [None])[0],
                                     (m.get("losses") or [None])[-1], "{:.4f}", " -> ")),
        ("NaN/Inf losses", str(m.get("non_finite_losses", 0))),
        ("skipped fp16 steps", str(m.get("skipped_steps", 0))),
        ("peak allocated", _fmt(report.peak_allocated / GiB, "{:.3f} GiB")),
        ("peak reserved", _fmt(m.get("peak_reserved") and m["peak_reserved"] / GiB,
                               "{:.3f} GiB")),
        ("NVML used (max)", _fmt(m.get("nvml_used_max") and m["nvml_used_max"] / GiB,
                                 "{:.3f} GiB")),
        ("context overhead", _fmt(m.get("context_overhead") and m["context_overhead"] / GiB,
                                  "{:.3f} GiB")),
        ("GPU utilization mean", _fmt(m.get("gpu_util_mean"), "{:.0f} %")),
        ("memory bandwidth utilization mean", _fmt(m.get("mem_bandwidth_util_mean"),
                                                   "{:.0f} %")),
    ]
    for name, value in rows:
        if value != "-" or name in ("step time median / p90", "peak allocated"):
            table.add_row(name, value)
    console.print(table)
    if m.get("stopped"):
        console.print(f"[bold yellow]partial run[/]: {m['stopped']}")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _pair(a, b, spec: str, sep: str = " / ") -> str:
    return "-" if a is None else spec.format(a) + sep + _fmt(b, spec)


# --- compare -----------------------------------------------------------------------------------


@job_command
def compare(
    job: Job,
    engines: Annotated[str, typer.Option(help="comma-separated; the last one is the "
                                         "reference the others' error is measured against")]
    = "formula,trace,measure",
    steps: Steps = 3, warmup: Warmup = 1, device: Device = None,
    html: HtmlOut = None,
    as_json: AsJson = False,
) -> None:
    """Predicted (formula, trace) and measured memory side by side, with the error.

    Example: vramplan compare llama-3.2-1b -b 2 -s 512 --device cpu
    """
    check_writable(html)
    require_charts(html)
    names = [e.strip() for e in engines.split(",") if e.strip()]
    if not names:
        raise JobError("--engines needs at least one of formula, trace, measure")
    reports = {name: run_for_compare(job, name, steps=steps, warmup=warmup, device=device)
               for name in names}
    rows = comparison_rows(reports)
    if html:
        from vramplan.views.command import cli_command
        from vramplan.views.html import compare_html

        words = ("--engines", ",".join(names), "--steps", str(steps), "--warmup", str(warmup))
        write_html(html, compare_html(reports, command=cli_command(job, "compare", words)))
    if as_json:
        print_json({"rows": rows, "reports": {n: r.to_json_dict() if isinstance(
            r, MemoryReport) else {"error": r} for n, r in reports.items()}})
        _exit_if_failed(reports)
        return
    ref = names[-1]
    largest = max((max(v for k, v in r.items() if k in names and v) for r in rows
                   if any(r[n] for n in names)), default=0)
    unit, size = ("GiB", GiB) if largest >= GiB else ("MiB", MiB)
    table = Table(title=f"{job.model}: engines compared (error relative to {ref})")
    table.add_column(unit)
    for name in names:
        table.add_column(name, justify="right")
    for name in names[:-1]:
        table.add_column(f"{name} error", justify="right")
    for row in rows:
        cells = [_fmt(row[n] and row[n] / size, "{:,.3f}") for n in names]
        cells += [_fmt(row.get(f"{n}_error"), "{:+.1%}") for n in names[:-1]]
        table.add_row(row["figure"], *cells)
    console.print(table)
    for name, report in reports.items():
        if not isinstance(report, MemoryReport):
            console.print(f"[yellow]{name}[/]: {report}")
    _exit_if_failed(reports)


def _exit_if_failed(reports: dict) -> None:
    """An engine without a report leaves the comparison incomplete: the others' figures
    are shown above, and the exit code (2) and one line on stderr say what is missing."""
    failed = [f"{n} {r}" for n, r in reports.items() if not isinstance(r, MemoryReport)]
    if failed:
        sys.stderr.write(f"error: the comparison is incomplete: {'; '.join(failed)}\n"[:2000])
        raise SystemExit(EXIT_BAD_INPUT)


def register(app: typer.Typer) -> None:
    app.command("measure")(measure)
    app.command("compare")(compare)
