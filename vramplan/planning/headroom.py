"""Room to grow: how far each knob of a job can go on one GPU type before it stops fitting,
the larger models of its family that still fit, and what-if comparisons (memory, time,
cost before and after any Job change). Memory from the formula engine.

    >>> room = headroom(Job(model="llama-3.2-1b", batch_size=2), get_gpu("L4"))
    >>> [(k.name, k.current, k.largest) for k in room.knobs]
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from vramplan.engines.registry import get_engine
from vramplan.errors import JobError, VramplanError
from vramplan.fit import SAFETY_MARGIN, check_margin, fits_within
from vramplan.hardware.gpu import GPU
from vramplan.job import Job, job_from_dict
from vramplan.models import list_models, load_architecture
from vramplan.planning.amount import TrainingAmount
from vramplan.planning.performance import predict
from vramplan.search.core import max_value

SEARCH_LIMITS = {"batch_size": 4096, "seq_len": 1_048_576, "peft.rank": 4096}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Knob(_Frozen):
    name: str                  # batch_size, seq_len, peft.rank
    current: int
    largest: int | None        # None: even the current value does not fit
    at_search_limit: bool = False  # the search stopped at its limit, not at memory


class ModelFit(_Frozen):
    model: str
    params: int
    fits: bool
    required_bytes: int
    usable_bytes: int


class Headroom(_Frozen):
    gpu: str
    fits: bool
    required_bytes: int
    usable_bytes: int
    knobs: list[Knob]
    larger_models: list[ModelFit]  # the next sizes of the model's family, smallest first


class Side(_Frozen):
    job: Job
    gpu: str = ""
    required_bytes: int | None = None
    usable_bytes: int | None = None
    fits: bool | None = None  # required <= usable x (1 - margin)
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    training_time_s: float | None = None
    cost_usd: float | None = None
    error: str = ""  # why this side could not be estimated


class WhatIf(_Frozen):
    gpu: str
    changes: dict[str, Any]
    before: Side
    after: Side


def _required(job: Job, gpu: GPU) -> tuple[int, int]:
    fit = get_engine("formula").run(job, gpus=[gpu]).fits[0]
    return fit.required_bytes, fit.usable_bytes


def largest(job: Job, knob: str, gpu: GPU, margin: float = SAFETY_MARGIN) -> Knob:
    """The largest value of `knob` that fits, by the search primitive (vramplan.search.core:
    memory grows with each of these knobs), never past what the model allows."""
    current = job.peft.rank if knob == "peft.rank" else getattr(job, knob)
    if knob == "seq_len" and current is None:
        current = load_architecture(job.model).max_positions or 2048
        current = min(current, 2048)
    limit = min(SEARCH_LIMITS[knob], _model_limit(job, knob) or SEARCH_LIMITS[knob])
    try:
        result = max_value(job, knob, lambda j: _required(j, gpu)[0], gpu.usable_bytes,
                           margin=margin, maximum=limit)
    except (JobError, ValueError):
        return Knob(name=knob, current=current, largest=None)
    return Knob(name=knob, current=current, largest=result.best,
                at_search_limit=result.capped)


def _model_limit(job: Job, knob: str) -> int | None:
    """What the model allows: sequences up to its positions, LoRA ranks up to its width
    (a rank above the smaller side of a weight adds parameters, not expressiveness)."""
    arch = load_architecture(job.model)
    if knob == "seq_len":
        return arch.max_positions
    if knob == "peft.rank":
        return min(s.hidden_size for s in arch.stacks)
    return None


def headroom(job: Job, gpu: GPU, margin: float = SAFETY_MARGIN) -> Headroom:
    """How far batch size, sequence length and LoRA rank can grow on `gpu`, and which
    larger models of the same family still fit."""
    check_margin(margin)
    arch = load_architecture(job.model)
    knobs = [largest(job, "batch_size", gpu, margin)]
    if arch.kind not in ("cnn", "vision"):
        knobs.append(largest(job, "seq_len", gpu, margin))
    if job.peft is not None:
        knobs.append(largest(job, "peft.rank", gpu, margin))
    need, usable = _required(job, gpu)
    return Headroom(gpu=gpu.name, fits=fits_within(need, usable, margin), required_bytes=need,
                    usable_bytes=usable, knobs=knobs,
                    larger_models=_larger_models(job, gpu, margin))


def _larger_models(job: Job, gpu: GPU, margin: float) -> list[ModelFit]:
    models = list_models()
    own = next((m for m in models if m.name == job.model), None)
    if own is None:
        return []
    out = []
    for entry in sorted((m for m in models if m.family == own.family and m.params > own.params),
                        key=lambda m: m.params):
        try:
            need, usable = _required(job.with_changes(model=entry.name), gpu)
        except VramplanError:
            continue
        out.append(ModelFit(model=entry.name, params=entry.params,
                            fits=fits_within(need, usable, margin), required_bytes=need,
                            usable_bytes=usable))
    return out


def parse_changes(text: str) -> dict[str, Any]:
    """'seq_len=8192,model=llama-3.1-70b,peft.rank=64' -> nested Job changes. Values are
    YAML scalars or flow lists (peft.target_modules=[q_proj,v_proj]: a comma inside
    brackets does not split). Every problem is one JobError line."""
    changes: dict[str, Any] = {}
    for part in _pairs(text):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise JobError(f"what-if takes KEY=VALUE pairs separated by commas, e.g. "
                           f"seq_len=8192,model=llama-3.1-70b (got {part[:80]!r})")
        target = changes
        *parents, leaf = key.strip().split(".")
        for name in parents:
            target = target.setdefault(name, {})
            if not isinstance(target, dict):
                raise JobError(f"what-if {key.strip()!r}: {name!r} is set twice")
        target[leaf] = _value(key.strip(), value)
    if not changes:
        raise JobError("what-if takes KEY=VALUE pairs, e.g. seq_len=8192 (got nothing)")
    return changes


def _pairs(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(char, 0)
        if char == "," and depth <= 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _value(key: str, text: str) -> Any:
    if not text.strip():
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or "not YAML"
        raise JobError(f"what-if {key}={text.strip()[:40]!r}: {problem} (values are numbers, "
                       "names, true/false, or [a,b] lists)") from None
    if isinstance(value, dict):
        raise JobError(f"what-if {key}: give each setting as its own KEY=VALUE "
                       f"({key}.NAME=VALUE), not a mapping")
    return value


def _merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and key in out and not isinstance(out[key], dict) \
                and out[key] is not None:
            raise JobError(f"what-if {key}.{next(iter(value))}: {key!r} is a value, not a "
                           "section of the job")
        out[key] = (_merge(out[key], value) if isinstance(value, dict)
                    and isinstance(out.get(key), dict) else value)
    return out


class Variant(_Frozen):
    changes: dict[str, Any]
    side: Side


class Comparison(_Frozen):
    """The job and each what-if variant, side by side (memory, fit, time, cost)."""

    gpu: str
    margin: float
    before: Side
    variants: list[Variant]


def changed_job(job: Job, changes: dict[str, Any] | str) -> Job:
    """`job` with what-if `changes` (a dict, or the KEY=VALUE text), validated again."""
    if isinstance(changes, str):
        changes = parse_changes(changes)
    dumped = job.model_dump()
    if changes.get("peft") and dumped.get("peft") is None:
        dumped["peft"] = {}
    return job_from_dict(_merge(dumped, changes), origin="what-if")


def what_if(job: Job, gpu: GPU, changes: dict[str, Any] | str,
            amount: TrainingAmount | None = None, margin: float = SAFETY_MARGIN) -> WhatIf:
    """Memory, time and cost of `job` and of `job` with `changes`, side by side."""
    result = compare(job, gpu, [changes], amount, margin)
    return WhatIf(gpu=result.gpu, changes=result.variants[0].changes, before=result.before,
                  after=result.variants[0].side)


def compare(job: Job, gpu: GPU, changes: list[dict[str, Any] | str],
            amount: TrainingAmount | None = None,
            margin: float = SAFETY_MARGIN) -> Comparison:
    """The job and each of its what-if variants: memory, fit (with `margin`), time and
    cost. A variant that changes the GPU (gpu=H100-SXM) is judged on that GPU."""
    check_margin(margin)
    parsed = [parse_changes(c) if isinstance(c, str) else c for c in changes]
    jobs = [changed_job(job, c) for c in parsed]  # every bad variant refused before any work
    return Comparison(gpu=gpu.name, margin=margin, before=_side(job, gpu, amount, margin),
                      variants=[Variant(changes=c, side=_side(j, _gpu_of(j, gpu), amount,
                                                              margin))
                                for c, j in zip(parsed, jobs)])


def _gpu_of(job: Job, default: GPU) -> GPU:
    from vramplan.hardware import get_gpu
    return get_gpu(job.gpu) if job.gpu and job.gpu != default.name else default


def _side(job: Job, gpu: GPU, amount: TrainingAmount | None,
          margin: float = SAFETY_MARGIN) -> Side:
    try:
        need, usable = _required(job, gpu)
    except VramplanError as error:
        return Side(job=job, gpu=gpu.name, error=str(error))
    side = dict(job=job, gpu=gpu.name, required_bytes=need, usable_bytes=usable,
                fits=fits_within(need, usable, margin))
    try:
        perf = predict(job, gpu, amount)
        side.update(step_time_s=perf.step_time_s, tokens_per_s=perf.tokens_per_s,
                    training_time_s=perf.training_time_s, cost_usd=perf.cost_usd)
    except VramplanError as error:
        side["error"] = str(error)
    return Side(**side)
