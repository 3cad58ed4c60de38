"""Engines side by side on one job: each engine's report (or why it has none) and the
rows of figures with each engine's error against the last one (the reference)."""

from __future__ import annotations

from vramplan.engines.memory_report import CATEGORIES, MemoryReport
from vramplan.engines.registry import run_engine
from vramplan.errors import EngineError, VramplanError
from vramplan.job import Job


def run_for_compare(job: Job, engine: str, **options) -> MemoryReport | str:
    """The engine's report, or why it has none (an engine that is missing or failed)."""
    try:
        return run_engine(job, engine, **options)
    except ImportError as error:
        return f"not available ({error})"
    except Exception as error:  # noqa: BLE001 - one engine failing keeps the others' answers
        from vramplan.engines.oom import describe_oom, is_out_of_memory
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
    if isinstance(reference, MemoryReport) and reference.measured is not None \
            and reference.measured.device == "cpu":
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
    if report.measured is not None:
        return 0
    from vramplan.engines.runtime import workspaces_bytes
    from vramplan.hardware import get_gpu
    gpu = get_gpu(report.runtime_gpu) if report.runtime_gpu else None
    return workspaces_bytes(report.job.runtime, gpu)


