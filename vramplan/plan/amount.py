"""How much training a job is to do: tokens, samples, or epochs of a dataset; and the price.

    >>> TrainingAmount(tokens=2_000_000_000)
    >>> TrainingAmount(epochs=3, dataset_samples=50_000, price_per_hour=2.1)
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainingAmount(BaseModel):
    """One of tokens, samples, or epochs (with the dataset's size); an optional price."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: int | None = Field(None, gt=0)           # tokens to train on, all GPUs
    samples: int | None = Field(None, gt=0)          # samples (sequences, images, clips)
    epochs: float | None = Field(None, gt=0)         # passes over the dataset
    dataset_samples: int | None = Field(None, gt=0)  # samples in one epoch
    dataset_tokens: int | None = Field(None, gt=0)   # or tokens in one epoch
    price_per_hour: float | None = Field(None, gt=0)  # USD per GPU-hour (overrides catalog)

    @model_validator(mode="after")
    def _one_amount(self) -> TrainingAmount:
        given = [k for k in ("tokens", "samples", "epochs") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of tokens, samples or epochs, not {' and '.join(given)}")
        if self.epochs is not None and not (self.dataset_samples or self.dataset_tokens):
            raise ValueError("epochs needs the dataset's size: dataset_samples or dataset_tokens")
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
