"""Make it fit: the smallest changes that make a job fit one GPU type, with numbers.

Changes are the techniques table's (planning/techniques.py): those that keep the maths of
training, and those `allow` adds (LoRA, QLoRA, 8-bit optimizers, bf16 weights, fp8,
offloading). Combinations of up to MAX_COMBINED techniques are tried, fewest first; a
combination that holds one that already fits is not tried. The fixes are ranked by how
much they change: maths kept first, then fewer techniques, then less time cost, then
speed. Each fix says the memory before and after, and the predicted speed.

    >>> fixes = make_it_fit(Job(model="llama-3.1-8b", batch_size=8), get_gpu("L4"))
    >>> fixes[0].flags, fixes[0].summary
"""

from __future__ import annotations

from itertools import combinations

from vramplan.engines.memory_report import MemoryReport
from vramplan.engines.registry import get_engine
from vramplan.errors import JobError
from vramplan.fit import SAFETY_MARGIN, fits_within
from vramplan.hardware.gpu import GPU
from vramplan.job import Job
from vramplan.planning import techniques
from vramplan.planning.changes import describe_changes
from vramplan.planning.performance import performance_for
from vramplan.planning.results import Fix

GiB = 2**30
MAX_COMBINED = 4  # techniques in one fix (bf16 weights + optimizer in backward + ... )

__all__ = ["Fix", "make_it_fit", "with_fixes"]


def _compose(job: Job, chosen: tuple) -> Job | None:
    """The job with each technique applied in turn; None when one no longer applies."""
    for technique in chosen:
        job = technique.applied(job)
        if job is None:
            return None
    return job


def make_it_fit(job: Job, gpu: GPU, *, margin: float = SAFETY_MARGIN, allow=(),
                limit: int = 3) -> list[Fix]:
    """Up to `limit` ways to make `job` fit `gpu` with `margin`, the smallest change first."""
    formula = get_engine("formula")
    base = job
    usable = [t for t in techniques.allowed(tuple(allow)) if t.applied(base) is not None]
    fitting: list[set[str]] = []  # names of the combinations that fit
    found: list[tuple[tuple, Job, int, int]] = []
    for size in range(1, MAX_COMBINED + 1):
        for chosen in combinations(usable, size):
            names = {t.name for t in chosen}
            if any(f <= names for f in fitting):
                continue  # holds a smaller fix: not a smallest change
            final = _compose(base, chosen)
            if final is None:
                continue
            try:
                fit = formula.run(final, gpus=[gpu]).fits[0]
            except (JobError, ValueError):
                continue
            if fit.supported and fits_within(fit.required_bytes, fit.usable_bytes, margin):
                fitting.append(names)
                found.append((chosen, final, fit.required_bytes, fit.usable_bytes))
        keeps_full = job.peft is not None or any(f.peft is None for _, f, _, _ in found)
        if len(found) >= limit and keeps_full:  # a full fine-tune also wants one without
            break                               # adapters, if any combination gives it
    fixes = sorted((_fix(job, base, chosen, final, need, usable_bytes, gpu)
                    for chosen, final, need, usable_bytes in found), key=_rank)
    return _best_few(fixes, limit, full=job.peft is None)


def _best_few(fixes: list[Fix], limit: int, *, full: bool) -> list[Fix]:
    """The first `limit`; for a full fine-tune, the best fix that keeps it (no adapters)
    is among them, since adapters train a different model."""
    shown = fixes[:limit]
    keeps = next((f for f in fixes if f.job.peft is None), None) if full else None
    if keeps is not None and keeps not in shown and limit > 1:
        shown = shown[:limit - 1] + [keeps]
    return shown


def _fix(job: Job, base: Job, chosen: tuple, final: Job, need: int, usable: int,
         gpu: GPU) -> Fix:
    try:
        perf = performance_for(final, gpu)
    except JobError:
        perf = None
    speed = perf.tokens_per_s if perf else None
    text = (f"{need / GiB:.1f} GiB of {usable / GiB:.1f} GiB"
            + (f", {speed:,.0f} tokens/s" if speed else ""))
    return Fix(job=final,
               changes=[t.name for t in chosen], flags=describe_changes(base, final)[1],
               changes_maths=any(t.changes_maths for t in chosen), device_total_bytes=need,
               usable_bytes=usable, tokens_per_s=speed, summary=text)


def _rank(fix: Fix) -> tuple:
    cost = sum(techniques.technique(name).cost for name in fix.changes)
    return fix.changes_maths, len(fix.changes), cost, -(fix.tokens_per_s or 0)


def with_fixes(report: MemoryReport, job: Job, *, allow=None, margin: float = SAFETY_MARGIN,
               limit: int = 3) -> MemoryReport:
    """`report` with `to_fit` filled when the job names a GPU it does not fit (estimate):
    every technique is offered, those that keep the maths of training first."""
    from vramplan.hardware import get_gpu

    if not job.gpu or not report.fits or any(f.fits for f in report.fits):
        return report
    fixes = make_it_fit(job, get_gpu(job.gpu), margin=margin,
                        allow=techniques.ALLOW_NAMES if allow is None else allow, limit=limit)
    return report.model_copy(update={"to_fit": fixes})
