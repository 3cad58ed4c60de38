"""What a search fits in (the budget) and who answers "what is this job's peak?" (the
oracle): both resolved from the job and the user's options, for every face (CLI, web)."""

from __future__ import annotations

from collections.abc import Callable

from vramplan.engines.memory_report import MemoryReport
from vramplan.engines.registry import get_engine, run_engine
from vramplan.errors import JobError
from vramplan.job import Job
from vramplan.units import parse_bytes


def budget_of(job: Job, budget: str | int | None) -> tuple[int, str]:
    """Bytes to fit in, and what they are: the budget given, else the usable memory of the
    job's GPU."""
    if budget:
        return parse_bytes(budget), "budget"
    if job.gpu:
        from vramplan.hardware import get_gpu
        gpu = get_gpu(job.gpu)
        return gpu.usable_bytes, f"{gpu.name} usable memory"
    raise JobError("say what to fit in: --gpu NAME (its usable memory) or --budget SIZE "
                   "(e.g. 24GiB)")


def oracle_for(engine: str, *, budget_bytes: int | None = None, device: str | None = None,
               steps: int = 1, warmup: int = 1) -> Callable[[Job], MemoryReport]:
    """Job -> MemoryReport from the named engine. Each engine takes the options it knows:
    measure runs short real steps, and on the CPU the budget makes a step over it raise
    BudgetExceeded (on CUDA it caps the allocator)."""
    get_engine(engine)  # an unknown name fails now, not at the first trial
    options = dict(steps=steps, warmup=warmup, budget_bytes=budget_bytes, device=device)
    return lambda job: run_engine(job, engine, **options)


def explaining_engine(engine: str) -> Callable[[Job], MemoryReport] | None:
    """When nothing fits, an engine that never runs out of memory says what fills it: the
    formula, unless the search already used an engine that needs no device."""
    return None if not get_engine(engine).needs_torch else oracle_for("formula")
