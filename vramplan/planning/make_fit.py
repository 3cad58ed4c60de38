"""Make it fit: the smallest changes that make a job fit one GPU type, with numbers.

Changes come from the techniques table, those that keep the maths of training first;
`allow` adds the others (LoRA, QLoRA, 8-bit optimizers, fp8, offloading). Single changes
are tried first; when none is enough, changes are stacked in order of their time cost
until the job fits. Each fix says the memory before and after, and the predicted speed.

    >>> fixes = make_it_fit(Job(model="llama-3.1-8b", batch_size=8), get_gpu("L4"))
    >>> fixes[0].flags, fixes[0].summary
"""

from __future__ import annotations

from vramplan.engines.registry import get_engine
from vramplan.engines.report import Fix, MemoryReport
from vramplan.errors import JobError
from vramplan.fit import SAFETY_MARGIN, fits_within
from vramplan.hardware.gpu import GPU
from vramplan.job import Job, Offload, Parallel, Peft
from vramplan.planning.performance import performance_for

GiB = 2**30

__all__ = ["Fix", "make_it_fit", "with_fixes"]


def _steps(job: Job, allow) -> list[tuple[str, dict, str, bool]]:
    """(name, Job changes, flags, changes maths), cheapest in time first."""
    steps = []
    b = job.batch_size
    if b > 1:
        half = max(1, b // 2)
        steps.append((f"micro-batch {half} x {job.grad_accum * b // half} accumulation",
                      dict(batch_size=half, grad_accum=job.grad_accum * b // half),
                      f"--batch-size {half} --grad-accum {job.grad_accum * b // half}", False))
    if job.optimizer_impl == "foreach" and job.optimizer in ("adam", "adamw", "sgd",
                                                            "sgd-momentum"):
        steps.append(("fused optimizer", dict(optimizer_impl="fused"),
                      "--optimizer-impl fused", False))
    if job.loss == "standard" and (job.task in (None, "causal-lm")):
        steps.append(("chunked loss", dict(loss="chunked"), "--loss chunked", False))
    if job.checkpointing == "none":
        steps.append(("selective checkpointing", dict(checkpointing="selective"),
                      "--checkpointing selective", False))
    if job.checkpointing != "full":
        steps.append(("full checkpointing", dict(checkpointing="full"),
                      "--checkpointing full", False))
    if b > 1:
        steps.append((f"micro-batch 1 x {job.grad_accum * b} accumulation",
                      dict(batch_size=1, grad_accum=job.grad_accum * b),
                      f"--batch-size 1 --grad-accum {job.grad_accum * b}", False))
    if "8bit" in allow and job.optimizer in ("adam", "adamw"):
        steps.append(("8-bit AdamW", dict(optimizer="adamw-8bit", optimizer_impl="foreach"),
                      "--optimizer adamw-8bit", True))
    if job.peft is None and "lora" in allow:
        steps.append(("LoRA rank 16", dict(peft=Peft(method="lora")),
                      "--peft lora --lora-rank 16", True))
    if (job.peft is None or job.peft.method == "lora") and "qlora" in allow \
            and job.precision != "fp8":
        steps.append(("QLoRA rank 16", dict(peft=Peft(method="qlora")),
                      "--peft qlora --lora-rank 16", True))
    if "offload" in allow and not job.offload.optimizer and job.optimizer != "paged-adamw-8bit":
        steps.append(("optimizer offload", dict(offload=Offload(optimizer=True)),
                      "--offload-optimizer", False))
    if "offload" in allow and not job.activation_offload:
        steps.append(("activation offload", dict(activation_offload=True),
                      "--activation-offload", False))
    n = job.parallel.num_gpus
    for more in (2, 4, 8):
        if job.parallel.strategy in ("none", "ddp") and more > n:
            steps.append((f"FSDP over {more} GPUs",
                          dict(parallel=Parallel(strategy="fsdp", num_gpus=more,
                                                 gpus_per_node=job.parallel.gpus_per_node)),
                          f"--strategy fsdp -n {more}", False))
            break
    return steps


def _apply(job: Job, chosen: list) -> Job:
    for _, change, _, _ in chosen:  # later changes of the same field win
        job = job.with_changes(**change)
    return job


def _fix(check, job: Job, chosen: list) -> Fix | None:
    from vramplan.planning.planner import describe_changes

    final = _apply(job, chosen)
    return check(final, [name for name, *_ in chosen], [describe_changes(job, final)[1]],
                 any(maths for *_, maths in chosen))


def make_it_fit(job: Job, gpu: GPU, *, margin: float = SAFETY_MARGIN, allow=(),
                limit: int = 3) -> list[Fix]:
    """Up to `limit` ways to make `job` fit `gpu` with `margin`, fastest first."""
    formula = get_engine("formula")

    def check(candidate: Job, names: list[str], flags: list[str], maths: bool) -> Fix | None:
        fit = formula.run(candidate, gpus=[gpu]).fits[0]
        if not fit.supported or not fits_within(fit.required_bytes, fit.usable_bytes, margin):
            return None
        try:
            perf = performance_for(candidate, gpu)
        except JobError:
            perf = None
        speed = perf.tokens_per_s if perf else None
        text = (f"{fit.required_bytes / GiB:.1f} GiB of {fit.usable_bytes / GiB:.1f} GiB"
                + (f", {speed:,.0f} tokens/s" if speed else ""))
        return Fix(job=candidate, changes=names, flags=" ".join(flags), changes_maths=maths,
                   device_total_bytes=fit.required_bytes, usable_bytes=fit.usable_bytes,
                   tokens_per_s=speed, summary=text)

    steps = _steps(job.model_copy(update={"gpu": None}), allow)
    fixes: list[Fix] = []
    for name, change, flags, maths in steps:  # one change
        try:
            fix = check(job.with_changes(**change), [name], [flags], maths)
        except (JobError, ValueError):
            continue
        if fix:
            fixes.append(fix)
    if not fixes:  # stack changes, cheapest first, until it fits; then drop the needless
        chosen: list[tuple[str, dict, str, bool]] = []
        for step in steps:
            try:
                _apply(job, chosen + [step])
            except (JobError, ValueError):
                continue
            chosen.append(step)
            if _fix(check, job, chosen):
                for extra in list(chosen[:-1]):
                    fewer = [s for s in chosen if s is not extra]
                    try:
                        if _fix(check, job, fewer):
                            chosen = fewer
                    except (JobError, ValueError):
                        pass
                fixes.append(_fix(check, job, chosen))
                break
    return sorted(fixes, key=lambda f: (f.changes_maths, -(f.tokens_per_s or 0)))[:limit]


def with_fixes(report: MemoryReport, job: Job, *, allow=None, margin: float = SAFETY_MARGIN,
               limit: int = 3) -> MemoryReport:
    """`report` with `to_fit` filled when the job names a GPU it does not fit (estimate):
    every technique is offered, those that keep the maths of training first."""
    from vramplan.hardware import get_gpu
    from vramplan.planning.techniques import ALLOW_NAMES

    if not job.gpu or not report.fits or any(f.fits for f in report.fits):
        return report
    fixes = make_it_fit(job, get_gpu(job.gpu), margin=margin,
                        allow=ALLOW_NAMES if allow is None else allow, limit=limit)
    return report.model_copy(update={"to_fit": fixes})
