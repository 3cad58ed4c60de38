"""One estimate: memory, the fit table, performance and fixes, composed once. The CLI's
`estimate`, `vramplan.estimate` and `POST /api/v1/estimate` call compose() and only
render what it returns, so the three give the same peak, fit, performance and fixes.

    >>> report = compose(Job(model="llama-3.1-8b"), gpu="L4")
    >>> report.fits[0].fits, report.performance.step_time_s, [f.flags for f in report.to_fit]

Performance is whatever planning/performance.py returns (new fields flow through).
"""

from __future__ import annotations

from typing import Any

from vramplan.engines.memory_report import MemoryReport
from vramplan.engines.registry import run_engine
from vramplan.engines.runtime import with_margin
from vramplan.fit import SAFETY_MARGIN, check_margin
from vramplan.job import Job


def compose(job: Job, *, engine: str = "formula", gpu: str | None = None,
            tokens: int | None = None, samples: int | None = None, epochs: float | None = None,
            dataset_samples: int | None = None, price_per_hour: float | None = None,
            margin: float = SAFETY_MARGIN, fixes: bool = True,
            **engine_options: Any) -> MemoryReport:
    """The engine's report for `job`; with a GPU (`gpu`, else the job's own) also the
    fit on it, the predicted step time and cost, and when it does not fit, the smallest
    changes that make it fit. `engine_options` go to the engine (time_limit_s,
    model_config ...). An uploaded model_config has no catalog entry, so no performance."""
    check_margin(margin)
    name = gpu or job.gpu
    chosen = None
    if name is not None:
        from vramplan.hardware import get_gpu

        chosen = get_gpu(name)
        if gpu is not None and gpu != job.gpu:
            # the report's own total is for the GPU it runs on (its cuBLAS workspace and
            # context): the one asked about, as the fit and the CLI's --gpu have it
            job = job.with_changes(gpu=gpu)
        if engine == "formula":
            engine_options.setdefault("gpus", [chosen])  # the fit on the GPU asked about
    report = run_engine(job, engine, **engine_options)
    if margin != SAFETY_MARGIN:
        report = report.model_copy(update={"fits": with_margin(report.fits, margin)})
    if chosen is None or engine_options.get("model_config") is not None:
        return report
    untimed = why_untimed(job)
    if untimed:  # memory is the answer; time and fixes need the formula's shapes
        return report.model_copy(update={"notes": [*report.notes, untimed]})
    from vramplan.planning.performance import performance_for

    perf = performance_for(job, chosen, tokens=tokens, samples=samples, epochs=epochs,
                           dataset_samples=dataset_samples, price_per_hour=price_per_hour)
    report = report.model_copy(update={"performance": perf})
    on_gpu = [f for f in report.fits if f.gpu == chosen.name]
    if fixes and on_gpu and not any(f.fits for f in on_gpu):
        from vramplan.planning.make_fit import make_it_fit
        from vramplan.planning.techniques import ALLOW_NAMES

        report = report.model_copy(update={"to_fit": make_it_fit(
            job, chosen, margin=margin, allow=ALLOW_NAMES)})
    return report


def why_untimed(job: Job) -> str | None:
    """Why the job gets a memory answer but no step time (None: it gets one)."""
    from vramplan.models import load_architecture
    from vramplan.models.catalog import looks_like_factory

    if looks_like_factory(job.model):
        return ("no time estimate: a factory model has no config the performance model can "
                "count FLOPs from (and no make-it-fit, which needs the formula); memory is the "
                "engine's")
    if load_architecture(job.model).kind == "cnn":
        return "no time estimate: step times of CNNs are not modelled yet (memory only)"
    return None
