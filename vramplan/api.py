"""The functions behind the public API: one Job in, one MemoryReport out, by engine name."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from vramplan.engines.memory_report import MemoryReport
from vramplan.engines.registry import run_engine  # noqa: F401 (re-export)
from vramplan.job import Job


def default_job_path() -> Path:
    """The built-in default job (a QLoRA fine-tune of Llama-3.1-8B)."""
    return Path(str(resources.files("vramplan") / "jobs" / "default.yaml"))


def _job(job: Job, caller: str) -> Job:
    """The job a public function was given, or a clear error (not an AttributeError deep
    in an engine) when it is something else, such as a model name."""
    if isinstance(job, Job):
        return job
    from vramplan.errors import JobError

    example = f"Job(model={job!r})" if isinstance(job, str) else "Job(model=...)"
    raise JobError(f"{caller}() takes a vramplan.Job, got {type(job).__name__} "
                   f"{str(job)[:60]!r}: write {caller}({example})")


def estimate(job: Job, *, gpu: str | None = None, tokens: int | None = None,
             samples: int | None = None, epochs: float | None = None,
             dataset_samples: int | None = None, price_per_hour: float | None = None,
             margin: float | None = None, engine: str = "formula", **options) -> MemoryReport:
    """The estimate every surface gives (vramplan.planning.estimate.compose): closed-form
    by default (instant, any size, no torch).

    With a GPU (`gpu=`, or the job's own `gpu`), the report's `performance` holds the
    predicted step time, throughput and MFU on `job.parallel.num_gpus` of them, with an
    amount of training (tokens, samples, or epochs of dataset_samples) its time and cost,
    and when it does not fit, `to_fit` the smallest changes that make it fit.

    >>> report = estimate(Job(model="llama-3.2-1b"), gpu="H100-SXM", tokens=2_000_000_000)
    >>> report.performance.training_time_s, report.performance.cost_usd
    """
    from vramplan.fit import SAFETY_MARGIN
    from vramplan.planning.estimate import compose

    return compose(_job(job, "estimate"), engine=engine, gpu=gpu, tokens=tokens,
                   samples=samples, epochs=epochs,
                   dataset_samples=dataset_samples, price_per_hour=price_per_hour,
                   margin=SAFETY_MARGIN if margin is None else margin, **options)


def trace(job: Job, **options) -> MemoryReport:
    """The real training step on fake tensors: exact, no GPU, needs torch."""
    from vramplan.engines.trace import trace as trace_engine

    return trace_engine(_job(job, "trace"), **options)


def measure(job: Job, **options) -> MemoryReport:
    """Real training steps on the device (CUDA when present, else CPU), needs torch."""
    from vramplan.engines.measure import measure as measure_engine

    return measure_engine(_job(job, "measure"), **options)




def plan(job: Job, **options):
    """Which GPU, how many, which techniques, how long, how much: a typed Plan.

    Options: tokens / samples / epochs (+ dataset_samples), gpus, max_gpus, max_cost,
    deadline_s, allow (lora, qlora, 8bit, fp8, offload, global-batch), global_batch or
    global_batch_tokens (default: the job's own global batch), top, margin,
    price_per_hour (vramplan.planning.planner.plan).

    >>> p = plan(Job(model="llama-3.1-8b", seq_len=2048), tokens=2_000_000_000)
    >>> p.recommended.reason
    """
    from vramplan.planning.planner import plan as make_plan

    return make_plan(_job(job, "plan"), **options)
