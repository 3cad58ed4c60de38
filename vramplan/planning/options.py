"""What the planner takes besides the Job, validated once: the CLI's `plan` flags,
`vramplan.plan(...)` keywords and the web's PlanRequest are this one model.

    >>> PlanOptions(tokens=2_000_000_000, gpus=("H100-SXM",), allow=("lora",))
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from vramplan.fit import MAX_MARGIN, SAFETY_MARGIN
from vramplan.planning.amount import AmountFields, count_type, validated
from vramplan.planning.techniques import ALLOW_NAMES, PLANNER_ALLOW, TECHNIQUES

DEFAULT_MAX_GPUS = 512
MAX_GPUS = 65536  # the largest count the planner may try (the counts double up to it)
ALLOW = (*ALLOW_NAMES, PLANNER_ALLOW)


def allow_choices() -> dict[str, str]:
    """Each --allow name with what it accepts, as the web page's check boxes show them."""
    choices = {name: " / ".join(t.name for t in TECHNIQUES if t.allow == name)
               for name in ALLOW_NAMES}
    return {**choices, PLANNER_ALLOW: "the planner picks the global batch"}


def _known(name: str) -> str:
    if name not in ALLOW:
        raise ValueError(f"unknown; allowed: {', '.join(ALLOW)}")
    return name


# one --allow name: the techniques table's, or global-batch (an enum in the JSON schema)
AllowName = Annotated[str, AfterValidator(_known), WithJsonSchema(
    {"type": "string", "enum": list(ALLOW)})]


def _amount(most: float, what: str):
    return Field(None, gt=0, le=most, allow_inf_nan=False, description=what)


class PlanOptions(AmountFields):
    """An amount of training (for time and cost), the GPUs to consider, limits, and the
    changes to the maths of training the user accepts. Bounds keep every figure finite."""

    gpus: tuple[str, ...] = Field((), max_length=64, description="GPU types to consider "
                                  "(default: the whole catalog)")
    max_gpus: int = Field(DEFAULT_MAX_GPUS, ge=1, le=MAX_GPUS, description="most GPUs in "
                          "one job")
    max_cost: float | None = _amount(1e12, "most USD to spend")
    deadline_s: float | None = _amount(1e10, "longest training time, seconds")
    allow: tuple[AllowName, ...] = Field((), description="changes to the maths of training "
                                         f"you accept: {', '.join(ALLOW)}")
    global_batch: count_type(10**8) | None = Field(None, description="samples per optimizer "
                                                   "step every configuration keeps (default: "
                                                   "the job's own)")
    global_batch_tokens: count_type(10**13) | None = Field(
        None, description="the global batch in tokens (rounded to whole samples)")
    top: int = Field(10, ge=1, le=1000, description="candidates to return")
    margin: float = Field(SAFETY_MARGIN, description="memory to keep free, a fraction of "
                          f"the usable memory (0 to {MAX_MARGIN:g})")

    @field_validator("margin")
    @classmethod
    def _margin(cls, margin: float) -> float:
        if not (math.isfinite(margin) and 0 <= margin < MAX_MARGIN):
            raise ValueError(f"margin is a fraction of the GPU's memory, 0 to {MAX_MARGIN:g}")
        return margin

    @model_validator(mode="after")
    def _one_global_batch(self) -> PlanOptions:
        if self.global_batch is not None and self.global_batch_tokens is not None:
            raise ValueError("give global_batch (samples) or global_batch_tokens, not both")
        return self


def plan_options(**given: Any) -> PlanOptions:
    """PlanOptions from keywords (None: the default), or one JobError naming every problem."""
    given = {k: (tuple(v) if isinstance(v, list) else v) for k, v in given.items()
             if v is not None}
    return validated(PlanOptions, **given)


# PlanOptions field -> the `vramplan plan` option that sets it (the rest: --NAME)
_PLAN_FLAGS = {"deadline_s": "--deadline"}
# counts written as parse_count reads them (1B, 500M, 64k): the command a person would type
_COUNTS = ("tokens", "samples", "dataset_samples", "global_batch_tokens")
_SUFFIXES = (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3))


def _count_text(n: int) -> str:
    return next((f"{n // size}{suffix}" for suffix, size in _SUFFIXES if n % size == 0),
                str(n))


def plan_words(options: PlanOptions) -> tuple[str, ...]:
    """The `vramplan plan` options that give `options` (those that differ from the
    defaults), for the command a plan page or export prints."""
    words: list[str] = []
    for name, field in PlanOptions.model_fields.items():
        value = getattr(options, name)
        if value == field.default:
            continue
        words.append(_PLAN_FLAGS.get(name, "--" + name.replace("_", "-")))
        words.append(",".join(value) if isinstance(value, tuple)
                     else _count_text(value) if name in _COUNTS
                     else f"{value:g}" if isinstance(value, float) else str(value))
    return tuple(words)
