"""What the HTTP API accepts and returns. Every request holds the same Job as the CLI.

Limits are here, in one place, so the OpenAPI page states them. A model over HTTP is a
catalog name (or the HF id of a catalog model), or a label for an uploaded config.json
that travels in the request as data: no paths, no `module:factory`, no Hub downloads.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vramplan.fit import SAFETY_MARGIN, Margin
from vramplan.job import Job
from vramplan.planning.amount import AmountFields
from vramplan.planning.options import PlanOptions

MAX_REQUEST_BYTES = 2 * 1024**2   # whole request body
MAX_CONFIG_BYTES = 1024**2        # an uploaded config.json, as JSON text
MAX_CONFIG_NUMBER = 2**31         # any number inside an uploaded config
MAX_CONFIG_DEPTH = 8              # nesting of an uploaded config
MAX_TRACE_SECONDS = 300.0         # a trace's time limit, at most
MAX_GRID = 24                     # values per sweep axis
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._ -]{0,63}$")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobRequest(_Request):
    job: Job = Field(description="the training job, as in a job file (see the Job schema)")
    config: dict[str, Any] | None = Field(
        None, description="an uploaded Hugging Face config.json (data, at most 1 MiB); "
        "job.model is then only its label")

    @field_validator("config")
    @classmethod
    def _config_is_plain_data(cls, config: dict[str, Any] | None) -> dict[str, Any] | None:
        if config is None:
            return None
        from vramplan.models import SUPPORTED_MODEL_TYPES

        if len(json.dumps(config)) > MAX_CONFIG_BYTES:
            raise ValueError(f"config.json is larger than {MAX_CONFIG_BYTES / 2**20:g} MiB")
        _check_values(config, 0)
        model_type = config.get("model_type")
        if model_type is None:
            raise ValueError("config.json has no model_type (the key transformers reads to "
                             "choose the architecture)")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type {str(model_type)[:40]!r} is not "
                             f"supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        _check_readable(config)
        return config

    @model_validator(mode="after")
    def _model_is_data_not_a_path(self) -> JobRequest:
        model = self.job.model
        if self.config is not None:
            if not _LABEL.match(model):
                raise ValueError("job.model: with an uploaded config, the model is a label of "
                                 "letters, digits, '.', '_', '-' and spaces (at most 64)")
            return self
        from vramplan.models.catalog import resolve_catalog_name

        if resolve_catalog_name(model) is None:
            raise ValueError(
                f"job.model: {model[:80]!r} is not a catalog model. Over HTTP a model is a "
                "catalog name (see /api/v1/models) or an uploaded config.json; paths, "
                "module:factory references and Hub downloads are refused")
        return self


def _check_readable(config: dict[str, Any]) -> None:
    """The config must describe a model the formula can read (shapes, not code)."""
    from vramplan.errors import ModelConfigError
    from vramplan.models import architecture_from_config

    try:
        architecture_from_config(config, "config.json")
    except ModelConfigError as error:
        raise ValueError(str(error)) from None
    except (ArithmeticError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(f"config.json cannot be read as a {config['model_type']} config "
                         f"({type(error).__name__}: {str(error)[:200]})") from None


def _check_values(value: Any, depth: int) -> None:
    """An uploaded config holds JSON data of bounded depth and bounded numbers."""
    if depth > MAX_CONFIG_DEPTH:
        raise ValueError(f"config.json is nested deeper than {MAX_CONFIG_DEPTH} levels")
    if isinstance(value, dict):
        for item in value.values():
            _check_values(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_values(item, depth + 1)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if not abs(value) <= MAX_CONFIG_NUMBER:  # also refuses NaN
            raise ValueError(f"config.json holds a number out of range ({value!r}); "
                             f"numbers are at most {MAX_CONFIG_NUMBER}")


class EstimateRequest(JobRequest, AmountFields):
    """The estimate: memory, fit; with job.gpu also step time, cost and fixes."""

    model_config = ConfigDict(extra="forbid", frozen=False)
    margin: Margin = SAFETY_MARGIN
    charts: bool = Field(False, description="also return the figures as inline SVG")


class TraceRequest(JobRequest):
    time_limit_s: float = Field(120.0, gt=0, le=MAX_TRACE_SECONDS,
                                description="stop the trace after this many seconds")


class SearchRequest(JobRequest):
    parameter: Literal["batch_size", "seq_len"] = "batch_size"
    budget_bytes: int | None = Field(None, ge=1, le=2**50, description=(
        "memory to fit in; default: the usable memory of job.gpu"))
    margin: Margin = SAFETY_MARGIN
    maximum: int | None = Field(None, ge=1, le=100_000_000, description="largest value tried")
    granularity: int = Field(64, ge=1, le=65536, description="seq_len: answer is a multiple")


class SweepRequest(JobRequest):
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16],
                                   min_length=1, max_length=MAX_GRID)
    seq_lens: list[int] = Field(default_factory=lambda: [512, 1024, 2048],
                                min_length=1, max_length=MAX_GRID)
    gpus: list[str] = Field(default_factory=list, max_length=8,
                            description="GPUs whose fit boundary is drawn")
    margin: Margin = SAFETY_MARGIN
    charts: bool = False

    @field_validator("batch_sizes")
    @classmethod
    def _batches(cls, values: list[int]) -> list[int]:
        return _grid(values, 1_000_000, "batch size")

    @field_validator("seq_lens")
    @classmethod
    def _seqs(cls, values: list[int]) -> list[int]:
        return _grid(values, 100_000_000, "sequence length")


def _grid(values: list[int], largest: int, what: str) -> list[int]:
    bad = [v for v in values if not 1 <= v <= largest]
    if bad:
        raise ValueError(f"each {what} is between 1 and {largest} (got {bad[0]})")
    return sorted(set(values))


class PlanRequest(JobRequest, PlanOptions):
    """What `vramplan plan` takes (vramplan.planning.options.PlanOptions, the same model
    as the CLI's and the API's): an amount of training, GPUs to consider, limits."""

    model_config = ConfigDict(extra="forbid", frozen=False)
    charts: bool = False

    def options(self) -> PlanOptions:
        return PlanOptions(**{name: getattr(self, name) for name in PlanOptions.model_fields})


class ExportRequest(JobRequest):
    command: Literal["estimate", "search batch-size", "search seq-len", "sweep", "plan"] = \
        "estimate"


class ExportResponse(BaseModel):
    command: str = Field(description="the vramplan command line that builds this job")
    yaml: str = Field(description="the job as a YAML job file")
    settings_without_flag: list[str] = Field(description="settings only the YAML can carry")


class ErrorItem(BaseModel):
    field: str = Field(description="where: e.g. job.batch_size ('' for the whole request)")
    message: str


class ErrorResponse(BaseModel):
    error: str
    errors: list[ErrorItem] = Field(default_factory=list)


class TraceStatus(BaseModel):
    id: str
    status: Literal["queued", "running", "done", "error"]
    position: int = Field(0, description="traces ahead of this one (0 when running)")
    elapsed_s: float = 0.0
    time_limit_s: float
    error: str | None = None
    report: dict[str, Any] | None = None
    charts: dict[str, str] | None = None


class FrameworkConfigRequest(_Request):
    """A training framework's own config file, as text (torchtune, torchtitan, HF
    TrainingArguments / TRL / peft, accelerate, DeepSpeed, Axolotl, LLaMA-Factory)."""

    text: str = Field(max_length=MAX_CONFIG_BYTES, description="the file's content")
    name: str = Field("config.yaml", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                      description="its file name (a .toml suffix reads it as TOML)")
    format: str | None = Field(None, max_length=40, description="default: detected")
    model: str | None = Field(None, max_length=200, description="a catalog model, for a "
                              "file that names none (accelerate, DeepSpeed, LoraConfig)")
    overrides: list[str] = Field(default_factory=list, max_length=50,
                                 description="the framework's own command-line overrides")

    @field_validator("overrides")
    @classmethod
    def _short(cls, overrides: list[str]) -> list[str]:
        if any(len(o) > 200 for o in overrides):
            raise ValueError("an override is at most 200 characters")
        return overrides

    @field_validator("model")
    @classmethod
    def _catalog_model(cls, model: str | None) -> str | None:
        from vramplan.models.catalog import resolve_catalog_name

        if model is not None and resolve_catalog_name(model) is None:
            raise ValueError(f"{model[:80]!r} is not a catalog model (see /api/v1/models); "
                             "paths and Hub downloads are refused")
        return model
