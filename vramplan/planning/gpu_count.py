"""`search num-gpus`: the fewest GPUs of one type that fit a job, over the planner's own
counts, layouts and optimizer implementation (planning/layouts.py), so the answer is the
planner's fewest GPUs for the same job.

    >>> found = search_gpu_count(Job(model="llama-3.1-70b", checkpointing="full"),
    ...                          get_gpu("H100-SXM"))
    >>> found.best, found.flags
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from vramplan import fit as policy
from vramplan.engines.registry import get_engine
from vramplan.errors import JobError
from vramplan.hardware.gpu import GPU
from vramplan.job import Job, Parallel
from vramplan.models import load_architecture
from vramplan.planning.changes import describe_changes
from vramplan.planning.layouts import fused_optimizer, gpu_counts, parallel_layouts

GiB = 2**30
# ZeRO-2 first: at a count where both fit it communicates less than FSDP (no per-micro-
# batch all-gathers). DDP and hybrid sharding are not tried: at the same layout each
# holds at least as much per GPU as FSDP, so they never fit on fewer GPUs.
STRATEGIES = ("zero2", "fsdp")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GpuCountTrial(_Frozen):
    """One layout `search num-gpus` tried."""

    num_gpus: int
    strategy: str
    layout: str = Field("", description="tensor / context / pipeline degrees and the "
                        "optimizer implementation, when not the job's own")
    device_total_bytes: int | None = Field(description="per GPU; None when the layout is "
                                           "impossible (see problem)")
    fits: bool
    problem: str = ""


class GpuCountResult(_Frozen):
    """The fewest GPUs of one type that fit the job, and every layout tried on the way."""

    parameter: Literal["num_gpus"] = "num_gpus"
    gpu: str
    usable_bytes: int
    limit_bytes: int = Field(description="usable x (1 - margin): what a layout must fit in")
    margin: float
    max_gpus: int
    best: int | None = Field(description="the smallest GPU count that fits; None: none up to "
                             "max_gpus")
    strategy: str | None = None
    job: Job | None = Field(None, description="the job on that many GPUs")
    flags: str = ""
    trials: list[GpuCountTrial] = Field(default_factory=list)
    hint: str = Field("", description="when nothing fits: what more GPUs cannot shrink")

    @property
    def fits(self) -> bool:
        return self.best is not None

    def to_dict(self) -> dict:
        return self.model_dump(mode="json") | {"fits": self.fits}


def search_gpu_count(job: Job, gpu: GPU, *, margin: float = policy.SAFETY_MARGIN,
                     max_gpus: int = 4096) -> GpuCountResult:
    """The job on the fewest GPUs of type `gpu` that fits with `margin`. Counts are the
    planner's (1, 2, 4, 8, then whole nodes); at each, every layout the planner would try
    (tensor / pipeline / context parallel degrees the model allows, ZeRO-2 then FSDP for
    what is left, or the job's own --strategy), plain before model-parallel, each with the
    job's optimizer implementation and then the fused one the planner uses. The rest of
    the job stays: the micro-batch per GPU, so the global batch grows with data-parallel
    GPUs; a job that sets tensor / context / pipeline degrees keeps them."""
    if max_gpus < 1:
        raise JobError(f"max_gpus must be at least 1 (got {max_gpus})")
    policy.check_margin(margin)
    arch = load_architecture(job.model)
    formula = get_engine("formula")
    limit = policy.limit_bytes(policy.usable_bytes(gpu), margin)
    trials: list[GpuCountTrial] = []
    found: Job | None = None
    last = None  # the last report, for the hint
    impls = [{}] + ([fused_optimizer(job)] if fused_optimizer(job) else [])
    for n in gpu_counts(gpu.gpus_per_node, max_gpus):
        for layout in _layouts(job, arch, n):
            for impl in impls:
                try:
                    # the layout itself: what it leaves unset, the framework decides
                    candidate = job.with_changes(parallel=layout, gpu=None, **impl)
                    last = formula.run(candidate, gpus=[gpu])
                    fit = last.fits[0]
                except (JobError, ValueError) as error:
                    trials.append(GpuCountTrial(num_gpus=n, strategy=layout.strategy,
                                                layout=_words(layout, impl),
                                                device_total_bytes=None, fits=False,
                                                problem=str(error).splitlines()[0]))
                    break  # the layout itself is refused: another implementation won't help
                fits = fit.supported and policy.fits_within(fit.required_bytes, fit.usable_bytes,
                                                            margin)
                trials.append(GpuCountTrial(num_gpus=n, strategy=layout.strategy,
                                            layout=_words(layout, impl),
                                            device_total_bytes=fit.required_bytes, fits=fits,
                                            problem=fit.problem))
                if fits:
                    found = candidate
                    break
            if found:
                break
        if found:
            break
    return GpuCountResult(gpu=gpu.name, usable_bytes=gpu.usable_bytes, limit_bytes=limit,
                          margin=margin, max_gpus=max_gpus,
                          best=found.parallel.num_gpus if found else None,
                          strategy=found.parallel.strategy if found else None,
                          job=found.with_changes(gpu=gpu.name) if found else None,
                          flags=describe_changes(job, found)[1] if found else "",
                          trials=trials, hint=_hint(last) if found is None else "")


def _layouts(job: Job, arch, n: int) -> list[Parallel]:
    """The layouts of n GPUs to try, plain data parallelism first."""
    own = job.parallel
    strategies = (own.strategy,) if own.strategy != "none" else STRATEGIES
    if own.model_parallel > 1:  # the job's own degrees stay
        if n < own.model_parallel or n % own.model_parallel:
            return []
        tried = ["none"] if n == own.model_parallel else strategies
        return [Parallel.model_validate(own.changed(num_gpus=n, strategy=s)) for s in tried]
    keep = ("none", *strategies)
    layouts = [p for p in parallel_layouts(job, arch, n) if p.strategy in keep]
    order = {s: i for i, s in enumerate(keep)}
    return sorted(layouts, key=lambda p: (p.model_parallel, p.tensor_parallel,
                                          order[p.strategy]))


def _words(layout: Parallel, impl: dict) -> str:
    parts = [f"{name} {getattr(layout, attr)}" for name, attr in (
        ("tp", "tensor_parallel"), ("cp", "context_parallel"), ("pp", "pipeline_parallel"))
        if getattr(layout, attr) > 1]
    return ", ".join(parts + [f"{v} optimizer" for v in impl.values()])


def _hint(last) -> str:
    if last is None:
        return ""
    per_gpu = sum(last.categories[c] for c in ("activations", "inputs", "temporary"))
    return (f"at {last.job.parallel.num_gpus} GPUs ({last.job.parallel.strategy}), "
            f"activations, inputs and temporaries alone take {per_gpu / GiB:.1f} GiB per "
            "GPU, which more data-parallel GPUs do not shrink: try --checkpointing full, "
            "a smaller --batch-size, or --tp / --cp")
