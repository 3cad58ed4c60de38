"""The planner: which GPU, how many, which techniques, how long, how much.

It searches GPU type x GPU count (1, 2, 4, 8, then whole nodes) x data-parallel strategy
x tensor / context parallel degree x checkpointing x micro-batch x accumulation, asks the
formula engine whether each fits with the safety margin, and the performance model how
fast it runs. By default it changes only what keeps the maths of training (techniques.py):
the global batch (samples per optimizer step) stays the job's own, batch_size x grad_accum
x data-parallel degree, or the one asked for (global_batch, global_batch_tokens), and each
configuration reaches it with micro-batch x accumulation x data-parallel degree. `allow`
opens LoRA, QLoRA, 8-bit optimizers, fp8, offloading and a free global batch
("global-batch": the largest micro-batch that fits, no accumulation).

Pruning keeps it fast: memory is GPU-independent (one formula call gives the fit on every
GPU), a configuration that does not fit at micro-batch 1 needs no larger one, and for one
GPU type and count only the fastest configuration is kept (it is also the cheapest).

    >>> p = plan(Job(model="llama-3.1-8b", seq_len=2048), tokens=2_000_000_000)
    >>> p.recommended.reason
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from vramplan.engines.registry import get_engine
from vramplan.errors import JobError
from vramplan.fit import fits_within
from vramplan.hardware import get_gpu, list_gpus
from vramplan.hardware.gpu import GPU
from vramplan.job import Job, Parallel
from vramplan.models import load_architecture
from vramplan.planning import techniques
from vramplan.planning.amount import TrainingAmount, training_amount
from vramplan.planning.changes import describe_changes
from vramplan.planning.efficiency import Factors
from vramplan.planning.layouts import fused_optimizer, gpu_counts, parallel_layouts
from vramplan.planning.options import PlanOptions, plan_options
from vramplan.planning.performance import (
    interval_bucket_of,
    job_factors,
    performance_for,
    step_terms,
    step_time,
)
from vramplan.planning.rentable import hardware, owned_note
from vramplan.planning.results import Bound
from vramplan.planning.techniques import ALLOW_NAMES, PLANNER_ALLOW

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)  # tried when the global batch is free
SMALL_GLOBAL_BATCH = 8                 # samples: below this the job's own batch is noted
GiB = 2**30


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Candidate(_Frozen):
    """One configuration that fits its GPU with the margin."""

    gpu: str
    num_gpus: int
    job: Job
    changes: list[str] = Field(description="what differs from the job asked for")
    flags: str = Field(description="CLI flags that give this configuration")
    step_time_s: float
    step_time_range_s: tuple[float, float] | None = Field(
        None, description="80% interval of the step time (Performance.step_time_range_s); "
        "candidates are ranked by the central estimate")
    tokens_per_s: float
    mfu: float
    bound: Bound = Field("compute", description="what bounds the largest part of its step: "
                         "compute, memory, communication or host")
    hardware: Literal["rented", "owned"] = Field("rented", description="owned: no "
                                                 "on-demand instance has this shape "
                                                 "(planning/rentable.py)")
    training_time_s: float | None = None
    training_time_range_s: tuple[float, float] | None = None
    gpu_hours: float | None = None
    cost_usd: float | None = None
    cost_range_usd: tuple[float, float] | None = None
    cost_per_million_tokens: float | None = None
    device_total_bytes: int
    usable_bytes: int

    @property
    def headroom_fraction(self) -> float:
        return 1 - self.device_total_bytes / self.usable_bytes


class Choice(_Frozen):
    label: Literal["cheapest", "fastest", "recommended"]
    candidate: Candidate
    reason: str


class RuledOut(_Frozen):
    gpu: str
    reason: str


class Plan(_Frozen):
    """The planner's answer: candidates, the cost/time Pareto front, three picks with the
    reason each wins, and what was ruled out. status says whether anything fits."""

    model: str
    status: Literal["ok", "nothing-fits", "constraints-unmet"]
    amount: TrainingAmount
    candidates: list[Candidate] = Field(default_factory=list)  # best per GPU type and count
    front: list[Candidate] = Field(default_factory=list)       # Pareto front, by cost
    cheapest: Choice | None = None
    fastest: Choice | None = None
    recommended: Choice | None = None
    ruled_out: list[RuledOut] = Field(default_factory=list)
    global_batch: int | None = Field(None, description="samples per optimizer step every "
                                     "candidate keeps (None: free, --allow global-batch)")
    closest_miss: str | None = None
    to_fit: list[str] = Field(default_factory=list)  # what would make it fit
    configurations: int = 0  # memory checks made
    notes: list[str] = Field(default_factory=list)


def plan(job: Job, options: PlanOptions | None = None, **given) -> Plan:
    """Search GPUs and techniques for `job`; see the module docstring. `options` (or the
    same fields as keywords: tokens=, gpus=, allow= ...) are planning/options.py's."""
    if options is None:
        options = plan_options(**given)
    elif given:
        raise JobError("give plan options as a PlanOptions or as keywords, not both")
    o = options
    amount = training_amount(tokens=o.tokens, samples=o.samples, epochs=o.epochs,
                             dataset_samples=o.dataset_samples, price_per_hour=o.price_per_hour)
    catalog = [get_gpu(name) for name in o.gpus] if o.gpus else list_gpus()
    arch = load_architecture(job.model)
    if arch.kind == "cnn":
        raise JobError(f"{arch.name}: the planner needs step times, which are not modelled "
                       "for CNNs yet; use `vramplan estimate` for its memory")
    target, notes = target_global_batch(job, arch, o.global_batch, o.global_batch_tokens,
                                        o.allow)
    search = _Search(job, catalog, amount, o.margin, o.allow, target, o.max_gpus)
    search.run()
    answer = search.answer(o.max_cost, o.deadline_s, o.top)
    return answer.model_copy(update={"global_batch": target,
                                     "notes": notes + answer.notes})


def tokens_per_sample(job: Job, arch) -> int:
    """Tokens one sample puts through the model (the performance model's count)."""
    from vramplan.planning.flops import step_flops

    one = step_flops(job.with_changes(batch_size=1, gpu=None), arch)
    return max(1, one.tokens // max(1, one.samples))


def target_global_batch(job: Job, arch, global_batch: int | None,
                        global_batch_tokens: int | None, allow) -> tuple[int | None, list[str]]:
    """The global batch (samples per optimizer step) every candidate keeps, None when the
    user let the planner choose it, and notes saying where it comes from."""
    if global_batch is not None:
        return global_batch, []
    if global_batch_tokens is not None:
        per_sample = tokens_per_sample(job, arch)
        exact = global_batch_tokens / per_sample
        if exact == int(exact):
            return int(exact), []
        samples = _round_samples(exact)
        change = samples * per_sample / global_batch_tokens - 1
        return samples, [f"a global batch of {global_batch_tokens:,} tokens is {exact:,.1f} "
                         f"samples of {per_sample:,} tokens; rounded to {samples:,} samples "
                         f"({samples * per_sample:,} tokens, {100 * change:+.1f}%), a count "
                         "that many data-parallel degrees divide"]
    if PLANNER_ALLOW in allow:
        return None, [f"--allow {PLANNER_ALLOW}: each configuration takes the largest "
                      f"micro-batch that fits (up to {MICRO_BATCHES[-1]}) without "
                      "accumulation, so the global batch (and the maths of training) "
                      "differs between rows"]
    own = job.effective_batch
    notes = []
    if own < SMALL_GLOBAL_BATCH:
        per_sample = tokens_per_sample(job, arch)
        notes.append(
            f"the job's own global batch is {own} sample{'s' if own > 1 else ''} "
            f"({own * per_sample:,} tokens: batch_size x grad_accum x data-parallel), so "
            f"at most {own} data-parallel rank{'s' if own > 1 else ''} can share it; give "
            "--global-batch N or --global-batch-tokens N (e.g. 1M) to plan for the batch "
            f"you will train with, or --allow {PLANNER_ALLOW} to let the planner choose")
    return own, notes


def _round_samples(exact: float, tolerance: float = 0.05) -> int:
    """The multiple of the largest power of two within `tolerance` of `exact` samples, so
    that power-of-two GPU counts can split it (4M tokens of 2048: 1953.1 -> 2048)."""
    k = max(0, int(exact).bit_length() - 1)
    while k > 0:
        step = 2**k
        rounded = round(exact / step) * step
        if rounded and abs(rounded - exact) <= tolerance * exact:
            return rounded
        k -= 1
    return max(1, round(exact))


# --- the search ---------------------------------------------------------------------------


class _Search:
    def __init__(self, job: Job, catalog: list[GPU], amount: TrainingAmount, margin: float,
                 allow, global_batch: int | None, max_gpus: int):
        self.job, self.catalog, self.amount, self.margin = job, catalog, amount, margin
        self.allow, self.global_batch, self.max_gpus = tuple(allow), global_batch, max_gpus
        self.arch = load_architecture(job.model)
        self.best: dict[tuple[str, int], tuple[float, Job, int]] = {}  # (gpu, n) -> fastest
        self.closest: dict[str, tuple[float, Job]] = {}  # gpu -> smallest required/usable
        self.cannot_run: dict[str, str] = {}  # gpu -> why it cannot run the job (precision)
        self.checks = 0
        self.owned: dict[str, set[int]] = {}  # GPU -> counts no on-demand instance has
        self.gpus = {g.name: g for g in catalog}
        # (GPU, interval bucket) -> the factors a candidate of that kind runs at
        self.factors: dict[tuple[str, str], Factors] = {}
        self.formula = get_engine("formula")

    def memory(self, job: Job, gpus: tuple[GPU, ...]):
        """The formula's report: GPU-independent figures and the fit on each of `gpus`."""
        return self.formula.run(job, gpus=list(gpus))

    def counts(self) -> list[int]:
        node = max((g.gpus_per_node for g in self.catalog), default=8)
        return gpu_counts(node, self.max_gpus)

    def variants(self) -> list[dict]:
        """Job changes the user allowed (each a dict for Job.with_changes): the fused
        optimizer step (same maths, faster, no step temporaries), then each allowed
        technique of the table applied to every variant so far."""
        jobs = [self.job.with_changes(**fused_optimizer(self.job))]
        for technique in techniques.for_planner(self.allow):
            for variant in list(jobs):
                changed = technique.applied(variant)
                if changed is not None and changed not in jobs:
                    jobs.append(changed)
        return [{name: getattr(j, name) for name in Job.model_fields
                 if getattr(j, name) != getattr(self.job, name)} for j in jobs]

    def parallel_layouts(self, n: int) -> list[Parallel]:
        return parallel_layouts(self.job, self.arch, n)

    def micro_batches(self, dp: int) -> list[tuple[int, int]]:
        """(micro-batch, accumulation) pairs to try, smallest micro-batch first."""
        if self.global_batch is None:
            return [(b, 1) for b in MICRO_BATCHES]
        if self.global_batch % dp:
            return []  # this data-parallel degree cannot split the global batch
        per_rank = self.global_batch // dp
        return [(b, per_rank // b) for b in range(1, per_rank + 1)
                if per_rank % b == 0 and (b & (b - 1) == 0 or b == per_rank)][:8]

    def layouts_for_batch(self, n: int) -> list[Parallel]:
        """The layouts of n GPUs whose data-parallel degree splits the global batch."""
        layouts = self.parallel_layouts(n)
        if self.global_batch is None:
            return layouts
        return [p for p in layouts if self.global_batch % p.data_parallel == 0]

    def run(self) -> None:
        self.unusable = [n for n in self.counts() if not self.layouts_for_batch(n)]
        for variant in self.variants():
            for n in self.counts():
                for layout in self.layouts_for_batch(n):
                    for ckpt in ("full", "selective", "none"):
                        if not self.configuration(variant, layout, ckpt):
                            break  # less checkpointing needs more memory: stop here

    def configuration(self, variant: dict, layout: Parallel, ckpt: str) -> bool:
        """Try growing micro-batches; remember the largest that fits each GPU. False when
        nothing fits even at the smallest micro-batch."""
        in_play = tuple(self.catalog)
        fitted: dict[str, Job] = {}
        for b, accum in self.micro_batches(layout.data_parallel):
            try:
                job = self.job.with_changes(**variant, batch_size=b, grad_accum=accum,
                                            checkpointing=ckpt, parallel=layout, gpu=None)
                report = self.memory(job, in_play)
            except (JobError, ValueError):
                return False
            self.checks += 1
            still = []
            for fit in report.fits:
                gpu = self.gpus[fit.gpu]
                need = fit.required_bytes / fit.usable_bytes
                if b == 1 and need < self.closest.get(fit.gpu, (float("inf"),))[0]:
                    self.closest[fit.gpu] = (need, job)
                if not fit.supported:
                    self.cannot_run[fit.gpu] = fit.problem
                if fit.supported and fits_within(fit.required_bytes, fit.usable_bytes,
                                                 self.margin):
                    fitted[fit.gpu] = job
                    still.append(gpu)
            if not still:
                break
            in_play = tuple(still)
        for name, job in fitted.items():
            self.consider(self.gpus[name], job)
        return bool(fitted)

    def consider(self, gpu: GPU, job: Job) -> None:
        terms = step_terms(job, gpu, self.arch)
        key = (gpu.name, interval_bucket_of(job, self.arch))
        if key not in self.factors:  # the shares follow the job's kind (job_factors)
            self.factors[key] = job_factors(job, gpu, self.arch)
        factors = self.factors[key]
        seconds_per_token = step_time(terms, factors) / terms.tokens_per_step
        key = (gpu.name, job.parallel.num_gpus)
        if key not in self.best or seconds_per_token < self.best[key][0]:
            self.best[key] = (seconds_per_token, job, 0)

    # --- the answer -----------------------------------------------------------------------

    def candidate(self, gpu: GPU, job: Job) -> Candidate:
        perf = performance_for(job, gpu, tokens=self.amount.tokens, samples=self.amount.samples,
                               epochs=self.amount.epochs,
                               dataset_samples=self.amount.dataset_samples,
                               price_per_hour=self.amount.price_per_hour)
        report = self.memory(job, (gpu,))
        fit = report.fits[0]
        changes, flags = describe_changes(self.job, job)
        owned = hardware(gpu, job.parallel.num_gpus)
        if owned == "owned":
            self.owned.setdefault(gpu.name, set()).add(job.parallel.num_gpus)
        return Candidate(hardware=owned, gpu=gpu.name, num_gpus=job.parallel.num_gpus, job=job,
                         changes=changes, flags=flags, step_time_s=perf.step_time_s,
                         step_time_range_s=perf.step_time_range_s,
                         tokens_per_s=perf.tokens_per_s, mfu=perf.mfu, bound=perf.bound,
                         training_time_s=perf.training_time_s,
                         training_time_range_s=perf.training_time_range_s,
                         gpu_hours=perf.gpu_hours, cost_usd=perf.cost_usd,
                         cost_range_usd=perf.cost_range_usd,
                         cost_per_million_tokens=perf.cost_per_million_tokens_usd,
                         device_total_bytes=fit.required_bytes, usable_bytes=fit.usable_bytes)

    def answer(self, max_cost: float | None, deadline_s: float | None, top: int) -> Plan:
        everything = [self.candidate(self.gpus[g], job)
                      for (g, _), (_, job, _) in self.best.items()]
        base = dict(model=self.arch.name, amount=self.amount, configurations=self.checks)
        if not everything:
            miss, to_fit = self.closest_miss()
            return Plan(status="nothing-fits", ruled_out=self.ruled_out([]), closest_miss=miss,
                        to_fit=to_fit, notes=self.batch_notes(), **base)
        kept = [c for c in everything
                if (max_cost is None or (c.cost_usd is not None and c.cost_usd <= max_cost))
                and (deadline_s is None or (c.training_time_s is not None
                                            and c.training_time_s <= deadline_s))]
        notes = self.batch_notes()
        if (max_cost or deadline_s) and not self.amount.given:
            notes.append("max_cost and deadline need an amount of training (tokens, samples "
                         "or epochs): no candidate can be checked against them")
        if not kept:
            quickest = min(everything, key=_time_key)
            cheapest = min(everything, key=_cost_key)
            return Plan(status="constraints-unmet", ruled_out=self.ruled_out(everything, kept),
                        closest_miss=(f"fastest: {_summary(quickest)}; cheapest: "
                                      f"{_summary(cheapest)}"), notes=notes, **base)
        front = pareto_front(kept)
        ranked = sorted(kept, key=_time_key)
        picks = _picks(kept, front)
        shown, seen = [], set()
        for c in [*front, *ranked]:  # the front first, then the fastest others
            if (c.gpu, c.num_gpus) not in seen and len(shown) < max(top, len(front)):
                seen.add((c.gpu, c.num_gpus))
                shown.append(c)
        return Plan(status="ok", candidates=sorted(shown, key=_time_key), front=front,
                    ruled_out=self.ruled_out(everything, kept), notes=notes, **picks, **base)

    def batch_notes(self) -> list[str]:
        notes = [owned_note(self.gpus[g], list(n)) for g, n in self.owned.items()]
        if not self.unusable:
            return notes
        counts = ", ".join(map(str, self.unusable))
        return notes + [
            f"{counts} GPUs not used: no layout of them has a data-parallel degree that "
            f"divides the global batch of {self.global_batch} sample(s) (tensor, context "
            "and pipeline parallelism cannot absorb the rest)"]

    def ruled_out(self, fitting: list[Candidate], kept: list[Candidate] | None = None):
        out = []
        kept_gpus = {c.gpu for c in (kept if kept is not None else fitting)}
        fitting_gpus = {c.gpu for c in fitting}
        for gpu in self.catalog:
            if gpu.name in kept_gpus:
                continue
            if gpu.name in fitting_gpus:
                out.append(RuledOut(gpu=gpu.name, reason="fits, but no configuration meets "
                                    "the cost or deadline asked for"))
                continue
            need, job = self.closest.get(gpu.name, (None, None))
            if job is None:
                out.append(RuledOut(gpu=gpu.name, reason="no layout was possible"))
                continue
            miss = (f"best {_layout(job)} needs {need * gpu.usable_bytes / GiB:.1f} GiB of its "
                    f"{gpu.usable_bytes / GiB:.1f} GiB ({100 * (need - 1):+.0f}%)")
            problem = self.cannot_run.get(gpu.name)
            if problem:  # the precision rules it out; memory may not
                fits = fits_within(need * gpu.usable_bytes, gpu.usable_bytes, self.margin)
                reason = problem if fits else f"{problem}; nor does it fit: {miss}"
            else:
                reason = f"does not fit even at micro-batch 1: {miss}"
            out.append(RuledOut(gpu=gpu.name, reason=reason))
        return out

    def closest_miss(self) -> tuple[str | None, list[str]]:
        if not self.closest:
            return None, []
        name = min(self.closest, key=lambda g: self.closest[g][0])
        need, job = self.closest[name]
        gpu = self.gpus[name]
        miss = (f"{name}: {_layout(job)} needs {need * gpu.usable_bytes / GiB:.1f} GiB of "
                f"{gpu.usable_bytes / GiB:.1f} GiB per GPU")
        return miss, self.what_would_fit(job, gpu)

    def what_would_fit(self, job: Job, gpu: GPU) -> list[str]:
        """Techniques outside `allow` that make the closest miss fit, with their numbers."""
        from vramplan.planning.make_fit import make_it_fit
        return [f"{describe_changes(self.job, fix.job)[1]}: {fix.summary}"
                for fix in make_it_fit(job, gpu, margin=self.margin, allow=ALLOW_NAMES,
                                       limit=3)]


def _layout(job: Job) -> str:
    p = job.parallel
    parts = [f"{p.num_gpus} GPU" + ("s" if p.num_gpus > 1 else "")]
    if p.strategy != "none":
        parts.append(p.strategy + ("" if p.reshard_after_forward else " kept gathered"))
    if p.tensor_parallel > 1:
        parts.append(f"tp {p.tensor_parallel}")
    if p.context_parallel > 1:
        parts.append(f"cp {p.context_parallel}")
    if p.pipeline_parallel > 1:
        parts.append(f"pp {p.pipeline_parallel} ({p.pipeline_schedule})")
    parts.append(f"{job.checkpointing} checkpointing")
    if job.peft:
        parts.append(job.peft.method)
    return ", ".join(parts)


def pareto_front(candidates: list[Candidate]) -> list[Candidate]:
    """Candidates no other beats on both cost and time (unpriced ones: on time only when
    nothing is priced), cheapest first."""
    priced = [c for c in candidates if _cost_key(c) != float("inf")]
    pool = priced or candidates
    front = [c for c in pool if not any(
        _cost_key(o) <= _cost_key(c) and _time_key(o) <= _time_key(c)
        and (_cost_key(o) < _cost_key(c) or _time_key(o) < _time_key(c)) for o in pool)]
    return sorted(front, key=lambda c: (_cost_key(c), _time_key(c)))


def _time_key(c: Candidate) -> float:
    return c.training_time_s if c.training_time_s is not None else 1 / c.tokens_per_s


def _cost_key(c: Candidate) -> float:
    value = c.cost_usd if c.training_time_s is not None else c.cost_per_million_tokens
    return value if value is not None else float("inf")


def _summary(c: Candidate) -> str:
    t = c.training_time_s
    time = (f"{c.tokens_per_s:,.0f} tokens/s" if t is None else f"{t / 3600:.1f} h"
            if t >= 3600 else f"{t / 60:.1f} min" if t >= 60 else f"{t:.0f} s")
    cost = (f"${c.cost_usd:,.0f}" if c.cost_usd is not None else
            f"${c.cost_per_million_tokens:.3f}/M tokens" if c.cost_per_million_tokens
            else "no price")
    return f"{c.num_gpus} x {c.gpu}, {time}, {cost}"


def _picks(kept: list[Candidate], front: list[Candidate]) -> dict:
    fastest = min(kept, key=_time_key)
    cheapest = min(kept, key=lambda c: (_cost_key(c), _time_key(c)))
    # recommended: the knee of the front, the point whose cost and time ratios to the two
    # minima have the smallest product (log-distance from the ideal corner)
    best_cost, best_time = _cost_key(cheapest), _time_key(fastest)

    def balance(c: Candidate) -> float:
        cost = _cost_key(c) / best_cost if best_cost not in (0, float("inf")) else 1
        return cost * _time_key(c) / best_time

    recommended = min(front, key=balance)
    return dict(
        fastest=Choice(label="fastest", candidate=fastest, reason=(
            f"fastest of all that fit: {_summary(fastest)}")),
        cheapest=Choice(label="cheapest", candidate=cheapest, reason=(
            f"lowest cost of all that fit: {_summary(cheapest)}"
            if _cost_key(cheapest) != float("inf") else
            "no GPU that fits has a price: pass price_per_hour")),
        recommended=Choice(label="recommended", candidate=recommended,
                           reason=_recommended_reason(recommended, best_cost, best_time)))


def _recommended_reason(c: Candidate, best_cost: float, best_time: float) -> str:
    if best_cost in (0, float("inf")):
        return f"the fastest (no prices to balance): {_summary(c)}"
    cost, time = _cost_key(c) / best_cost, _time_key(c) / best_time
    if cost < 1.005 and time < 1.005:
        return f"the cheapest and the fastest at once: {_summary(c)}"
    return (f"best balance of cost and time on the front: {_summary(c)} ({cost:.2f}x the "
            f"lowest cost, {time:.2f}x the shortest time)")
