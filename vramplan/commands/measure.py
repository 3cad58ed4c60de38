"""`vramplan measure` and `vramplan compare`: thin shells over the measure engine.

    vramplan measure llama-3.2-1b -b 4 -s 1024 --steps 5
    vramplan measure qwen2.5-0.5b -b 2 -s 1024 --emulate-gpu L4  # on a bigger GPU
    vramplan compare llama-3.2-1b -b 4 --engines formula,trace,measure
    torchrun --standalone --nproc-per-node 2 -m vramplan measure MODEL --num-gpus 2 \
        --strategy fsdp                                          # per rank, rank 0 aggregates
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from vramplan.cli import console, job_command, print_json
from vramplan.engines.report import CATEGORIES, MemoryReport
from vramplan.errors import EngineError, JobError, VramplanError
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
    out: Annotated[Optional[Path], typer.Option(help="write the report as JSON")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Run real training steps with synthetic data and report memory, time and loss.

    Example: vramplan measure qwen2.5-0.5b -b 2 -s 1024 --steps 5 --emulate-gpu L4
    """
    from vramplan.engines.measure import measure as run
    from vramplan.search import is_out_of_memory

    try:
        report = run(job, steps=steps, warmup=warmup, emulate_gpu=emulate_gpu,
                     budget_bytes=parse_bytes(budget) if budget else None, device=device)
    except Exception as error:  # noqa: BLE001 - out of memory is an answer, not a crash
        if not is_out_of_memory(error):
            raise
        limit = f" (--emulate-gpu {emulate_gpu} caps this process to its memory)" \
            if emulate_gpu else ""
        console.print(f"[bold red]out of memory[/]: {describe_oom(error)}{limit}\n"
                      "  try: vramplan search batch-size ... to find what fits")
        raise typer.Exit(1) from None
    if os.environ.get("RANK", "0") != "0":
        return  # under torchrun, rank 0 holds every rank's figures and prints them
    if out:
        out.write_text(json.dumps(report.to_json_dict(), indent=2) + "\n")
    if as_json:
        print_json(report.to_json_dict())
        return
    from vramplan.report.terminal import print_report

    print_report(report, console, highlight_gpu=job.gpu)
    print_measured(report)
    if out:
        console.print(f"wrote {out}")


def print_measured(report: MemoryReport) -> None:
    m = report.measured or {}
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
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Predicted (formula, trace) and measured memory side by side, with the error.

    Example: vramplan compare llama-3.2-1b -b 2 -s 512 --device cpu
    """
    names = [e.strip() for e in engines.split(",") if e.strip()]
    if not names:
        raise JobError("--engines needs at least one of formula, trace, measure")
    reports = {name: run_engine_for_compare(job, name, steps, warmup, device) for name in names}
    rows = comparison_rows(reports)
    if as_json:
        print_json({"rows": rows, "reports": {n: r.to_json_dict() if isinstance(
            r, MemoryReport) else {"error": r} for n, r in reports.items()}})
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


def describe_oom(error: BaseException) -> str:
    """torch's first sentence and the request that failed; torch's paragraph about
    allocator settings is left out."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    request = re.search(r"Tried to allocate ([\d.]+ \w+)", text)
    first = text.split(". ")[0].rstrip(".")
    if request is None or request.group(0) in first:
        return first
    return f"{first}: tried to allocate {request.group(1)}"


def run_engine_for_compare(job: Job, engine: str, steps: int, warmup: int,
                           device: str | None) -> MemoryReport | str:
    """The engine's report, or why it has none (an engine that is missing or failed)."""
    from vramplan.api import run_engine

    options = dict(steps=steps, warmup=warmup, device=device)
    try:
        return run_engine(job, engine, **options)
    except ImportError as error:
        return f"not available ({error})"
    except Exception as error:  # noqa: BLE001 - one engine failing keeps the others' answers
        from vramplan.search import is_out_of_memory
        if isinstance(error, VramplanError) and not isinstance(error, EngineError):
            raise  # the job itself is wrong: every engine would say so
        if is_out_of_memory(error):
            return f"out of memory: {describe_oom(error)}"
        return f"failed: {type(error).__name__}: {error}"


def comparison_rows(reports: dict[str, MemoryReport | str]) -> list[dict]:
    """One row per category and total; `<engine>_error` = (engine - reference) / reference,
    the reference being the last engine."""
    names = list(reports)
    ref = names[-1]
    figures = [(c, lambda r, c=c: r.categories[c]) for c in CATEGORIES] + [
        ("peak allocated", lambda r: r.peak_allocated),
        ("peak reserved", lambda r: r.peak_reserved),
        ("device total", lambda r: r.device_total)]
    reference = reports[ref]
    if isinstance(reference, MemoryReport) and (reference.measured or {}).get("device") == "cpu":
        # A CPU run has no cuBLAS workspaces: compare the predictions without them.
        figures.append(("peak allocated w/o cuBLAS workspaces",
                        lambda r: r.peak_allocated - predicted_workspaces(r)))
    rows = []
    for figure, get in figures:
        row = {"figure": figure}
        for name, report in reports.items():
            row[name] = get(report) if isinstance(report, MemoryReport) else None
        for name in names[:-1]:
            a, b = row[name], row[ref]
            row[f"{name}_error"] = (a - b) / b if a is not None and b else None
        rows.append(row)
    return rows


def predicted_workspaces(report: MemoryReport) -> int:
    """cuBLAS workspace bytes a predicted report counts in `temporary` (0 for measure)."""
    if report.engine == "measure":
        return 0
    from vramplan.engines.runtime import workspaces_bytes
    from vramplan.hardware import get_gpu
    from vramplan.job import Runtime

    gpu = get_gpu(report.runtime_gpu) if report.runtime_gpu else None
    return workspaces_bytes(Runtime(**report.job["runtime"]), gpu)


def register(app: typer.Typer) -> None:
    """Add `measure` and `compare` to the vramplan app (once)."""
    names = {c.name for c in app.registered_commands}
    if "measure" not in names:
        app.command("measure")(measure)
    if "compare" not in names:
        app.command("compare")(compare)
