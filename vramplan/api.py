"""The functions behind the public API: one Job in, one MemoryReport out, by engine name."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from vramplan.engines.report import MemoryReport
from vramplan.errors import UnknownNameError
from vramplan.job import Job

ENGINES = ("formula", "trace", "measure")


def default_job_path() -> Path:
    """The built-in default job (a QLoRA fine-tune of Llama-3.1-8B)."""
    return Path(str(resources.files("vramplan") / "jobs" / "default.yaml"))


def estimate(job: Job) -> MemoryReport:
    """Closed-form estimate: instant, any size, no torch."""
    from vramplan.engines.formula import estimate as formula_estimate

    return formula_estimate(job)


def run_engine(job: Job, engine: str = "formula") -> MemoryReport:
    """Run `job` through the named engine (formula, trace or measure)."""
    if engine == "formula":
        return estimate(job)
    if engine == "trace":
        from vramplan.engines.trace import trace

        return trace(job)
    if engine == "measure":
        from vramplan.engines.measure import measure

        return measure(job)
    raise UnknownNameError("engine", engine, ENGINES)
