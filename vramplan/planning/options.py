"""What the planner takes besides the Job, validated once: the CLI's `plan` flags,
`vramplan.plan(...)` keywords and the web's PlanRequest are this one model.

    >>> PlanOptions(tokens=2_000_000_000, gpus=("H100-SXM",), allow=("lora",))
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from vramplan.errors import JobError
from vramplan.fit import SAFETY_MARGIN, check_margin
from vramplan.planning.techniques import ALLOW_NAMES, PLANNER_ALLOW

DEFAULT_MAX_GPUS = 512
MAX_GPUS = 65536  # the largest count the planner may try (the counts double up to it)
ALLOW = (*ALLOW_NAMES, PLANNER_ALLOW)


def _known(name: str) -> str:
    if name not in ALLOW:
        raise ValueError(f"--allow {name}: unknown; allowed: {', '.join(ALLOW)}")
    return name


# one --allow name: the techniques table's, or global-batch (an enum in the JSON schema)
AllowName = Annotated[str, AfterValidator(_known), WithJsonSchema(
    {"type": "string", "enum": list(ALLOW)})]


class PlanOptions(BaseModel):
    """An amount of training (for time and cost), the GPUs to consider, limits, and the
    changes to the maths of training the user accepts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: int | None = Field(None, description="tokens to train on")
    samples: int | None = Field(None, description="samples to train on")
    epochs: float | None = Field(None, description="passes over the dataset")
    dataset_samples: int | None = Field(None, description="samples per epoch")
    price_per_hour: float | None = Field(None, description="USD per GPU-hour (default: the "
                                         "catalog's)")
    gpus: tuple[str, ...] = Field((), max_length=64, description="GPU types to consider "
                                  "(default: the whole catalog)")
    max_gpus: int = Field(DEFAULT_MAX_GPUS, le=MAX_GPUS, description="most GPUs in one job")
    max_cost: float | None = Field(None, description="most USD to spend")
    deadline_s: float | None = Field(None, description="longest training time, seconds")
    allow: tuple[AllowName, ...] = Field((), description="changes to the maths of training you "
                                   f"accept: {', '.join(ALLOW)}")
    global_batch: int | None = Field(None, description="samples per optimizer step every "
                                     "configuration keeps (default: the job's own)")
    global_batch_tokens: int | None = Field(None, description="the global batch in tokens "
                                            "(rounded to whole samples)")
    top: int = Field(10, description="candidates to return")
    margin: float = Field(SAFETY_MARGIN, description="memory to keep free, a fraction of "
                          "the usable memory (0 to 0.5)")

    @field_validator("max_gpus", "max_cost", "deadline_s", "global_batch",
                     "global_batch_tokens", "tokens", "samples", "epochs", "dataset_samples",
                     "price_per_hour")
    @classmethod
    def _positive(cls, value, info):
        if value is None:
            return value
        name = "deadline" if info.field_name == "deadline_s" else info.field_name
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be more than 0 (got {value})")
        if value > 10**15:
            raise ValueError(f"{name} is at most 1e15 (got {value})")
        return value

    @field_validator("top")
    @classmethod
    def _top(cls, top: int) -> int:
        if top < 1:
            raise ValueError(f"top must be at least 1 (got {top})")
        return top

    @field_validator("margin")
    @classmethod
    def _margin(cls, margin: float) -> float:
        try:
            return check_margin(margin)
        except JobError as error:
            raise ValueError(str(error)) from None

    @model_validator(mode="after")
    def _one_global_batch(self) -> PlanOptions:
        if self.global_batch is not None and self.global_batch_tokens is not None:
            raise ValueError("give global_batch (samples) or global_batch_tokens, not both")
        return self


def plan_options(**given: Any) -> PlanOptions:
    """PlanOptions from keywords (None: the default), or one JobError naming every problem."""
    given = {k: (tuple(v) if isinstance(v, list) else v) for k, v in given.items()
             if v is not None}
    try:
        return PlanOptions(**given)
    except ValidationError as error:
        raise JobError("; ".join(
            (f"{e['loc'][0]}: " if e["loc"] and e["type"] != "value_error" else "")
            + e["msg"].replace("Value error, ", "") for e in error.errors())) from None
