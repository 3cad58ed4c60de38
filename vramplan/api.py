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


def run_engine(job: Job, engine: str = "formula", **options) -> MemoryReport:
    """Run `job` through the named engine (formula, trace or measure); options go to that
    engine (trace: time_limit_s; measure: steps, warmup, device, budget_bytes, ...)."""
    engines = {"formula": estimate, "trace": trace, "measure": measure}
    if engine not in engines:
        raise UnknownNameError("engine", engine, ENGINES)
    return engines[engine](job, **options)
