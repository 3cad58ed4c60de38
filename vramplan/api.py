"""The functions behind the public API: one Job in, one MemoryReport out, by engine name."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from vramplan.engines.registry import engine_names, run_engine  # noqa: F401 (re-export)
from vramplan.engines.report import MemoryReport
from vramplan.job import Job

ENGINES = engine_names()


def default_job_path() -> Path:
    """The built-in default job (a QLoRA fine-tune of Llama-3.1-8B)."""
    return Path(str(resources.files("vramplan") / "jobs" / "default.yaml"))


def estimate(job: Job, **options) -> MemoryReport:
    """Closed-form estimate: instant, any size, no torch."""
    from vramplan.engines.formula import estimate as formula_estimate

    return formula_estimate(job, **options)


def trace(job: Job, **options) -> MemoryReport:
    """The real training step on fake tensors: exact, no GPU, needs torch."""
    from vramplan.engines.trace import trace as trace_engine

    return trace_engine(job, **options)


def measure(job: Job, **options) -> MemoryReport:
    """Real training steps on the device (CUDA when present, else CPU), needs torch."""
    from vramplan.engines.measure import measure as measure_engine

    return measure_engine(job, **options)


