"""How much training a job is to do: tokens, samples, or epochs of a dataset; and the price.

    >>> TrainingAmount(tokens=2_000_000_000)
    >>> TrainingAmount(epochs=3, dataset_samples=50_000, price_per_hour=2.1)
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

# The most of each amount: far beyond any training run (2026's largest: ~4e13 tokens), and
# they keep every time and cost finite (a price of 1e308 made the cost inf). The API's and
# the planner's bounds are these.
MOST = {"tokens": 10**15, "samples": 10**13, "epochs": 10_000, "dataset_samples": 10**13,
        "dataset_tokens": 10**15, "price_per_hour": 10_000}


def count_type(most: int) -> Any:
    """The type of a count field (tokens, samples, a global batch): a whole number from 1 to
    `most`, or text as the CLI reads it ('2B', '500M', '10k', '1e9': parse_count), so the
    Python API, the web API and the page read a count as the CLI does."""
    return Annotated[int, BeforeValidator(_count_from_text), Field(ge=1, le=most),
                     WithJsonSchema({"anyOf": [
                         {"type": "integer", "minimum": 1, "maximum": most},
                         {"type": "string", "examples": ["2B", "500M", "10k", "1e9"]}]})]


def _count_from_text(value: object) -> object:
    if not isinstance(value, str):
        return value  # the field's own checks judge it
    from vramplan.errors import JobError

    try:
        return parse_count(value, "count")
    except JobError as error:
        raise ValueError(str(error).removeprefix("count: ")) from None


class AmountFields(BaseModel):
    """How much training and at what price: the fields TrainingAmount, the web API's
    estimate and the planner's options share (one place for their bounds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: count_type(MOST["tokens"]) | None = Field(
        None, description="tokens to train on, all GPUs", examples=["2B"])
    samples: count_type(MOST["samples"]) | None = Field(
        None, description="samples (sequences, images, clips) to train on", examples=["100k"])
    epochs: float | None = Field(None, gt=0, le=MOST["epochs"], allow_inf_nan=False,
                                 description="passes over the dataset", examples=[3])
    dataset_samples: count_type(MOST["dataset_samples"]) | None = Field(
        None, description="samples per epoch", examples=["50k"])
    # inf or NaN would make every cost inf or NaN
    price_per_hour: float | None = Field(None, gt=0, le=MOST["price_per_hour"],
                                         allow_inf_nan=False, description="USD per GPU-hour "
                                         "(default: the catalog's)", examples=[2.49])


class TrainingAmount(AmountFields):
    """One of tokens, samples, or epochs (with the dataset's size); an optional price."""

    dataset_tokens: count_type(MOST["dataset_tokens"]) | None = Field(
        None, examples=["1B"])  # or its size in tokens

    @model_validator(mode="after")
    def _one_amount(self) -> TrainingAmount:
        given = [k for k in ("tokens", "samples", "epochs") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of tokens, samples or epochs, not {' and '.join(given)}")
        if self.epochs is not None and not (self.dataset_samples or self.dataset_tokens):
            raise ValueError("epochs needs the dataset's size: dataset_samples "
                             "(--dataset-samples) or dataset_tokens")
        return self

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.tokens, self.samples, self.epochs))

    def steps(self, tokens_per_step: int, samples_per_step: int) -> float | None:
        """Optimizer steps to train this amount, or None when no amount was given."""
        if self.tokens is not None:
            return self.tokens / tokens_per_step
        if self.samples is not None:
            return self.samples / samples_per_step
        if self.epochs is not None:
            if self.dataset_samples:
                return self.epochs * self.dataset_samples / samples_per_step
            return self.epochs * self.dataset_tokens / tokens_per_step
        return None


def validated(model: type[BaseModel], **fields: Any) -> Any:
    """model(**fields), or one JobError naming each bad field, what was given and a good
    value (the field's own Field(examples=...)): how the amount and the plan options read
    what the API, the CLI and the web give them."""
    from pydantic import ValidationError

    from vramplan.errors import JobError, validation_message

    try:
        return model(**fields)
    except ValidationError as error:
        examples = {name: f.examples[0] for name, f in model.model_fields.items()
                    if f.examples}
        raise JobError(validation_message(error.errors(), model, examples)) from None


def training_amount(**fields: Any) -> TrainingAmount:
    """TrainingAmount(**fields), or one JobError (validated): the API's, the CLI's and the
    planner's one way to read an amount."""
    return validated(TrainingAmount, **fields)


_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
MAX_COUNT = 10**18  # far beyond any training run (2026's largest: ~4e13 tokens); 1e400 is inf
_DURATION_SUFFIX = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}


def _split(text: str) -> tuple[float, str]:
    text = text.strip().lower().replace("_", "").replace(",", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz ")
    try:
        return float(number), text[len(number):].strip()
    except ValueError:
        return float("nan"), text


def parse_count(text: str | int, what: str = "tokens") -> int:
    """'2B' -> 2_000_000_000, '500k' -> 500_000, '1.5M' -> 1_500_000 (decimal suffixes)."""
    from vramplan.errors import JobError

    if isinstance(text, int):
        return text
    value, suffix = _split(str(text))
    if suffix not in _COUNT_SUFFIX or value != value or value <= 0:
        raise JobError(f"{what}: {text!r} is not a positive count; write e.g. 2B, 500M, 10k "
                       "or a plain number")
    if value * _COUNT_SUFFIX[suffix] > MAX_COUNT:
        raise JobError(f"{what}: {text!r} is too large (at most 1e18); write e.g. 2B, 500M")
    return int(round(value * _COUNT_SUFFIX[suffix]))


def parse_duration(text: str | float) -> float:
    """'24h' -> 86400.0, '3d', '90m', '45min', '600' (seconds)."""
    from vramplan.errors import JobError

    if isinstance(text, (int, float)):
        return float(text)
    value, suffix = _split(str(text))
    if suffix not in _DURATION_SUFFIX or value != value or value <= 0 \
            or value * _DURATION_SUFFIX[suffix] > 1e12:  # inf, or beyond 30,000 years
        raise JobError(f"deadline: {text!r} is not a positive finite duration; write e.g. 24h, "
                       "3d, 90m or a number of seconds")
    return value * _DURATION_SUFFIX[suffix]
