"""Planning's results: the predicted time and cost of a job on one GPU type (Performance,
PhaseTime) and the changes that make it fit (Fix).

A leaf: pydantic and the Job only, so the MemoryReport that carries them (engines) may
import it without loading the planner, and nothing here can close an import circle.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from vramplan.job import Job


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Bound = Literal["compute", "memory", "communication", "host", "host link"]


class PhaseTime(_Frozen):
    """One phase of a step on one GPU: its time and what bounds it."""

    phase: str = Field(description="forward, backward, recompute, optimizer, communication")
    time_s: float = Field(description="seconds per occurrence (forward, backward, recompute: "
                          "per micro-batch)")
    per_step: int = Field(description="occurrences per optimizer step")
    bound: Bound = Field(description="what bounds it: compute, memory, communication, host "
                       "(the CPU launching kernels), host link (paged optimizer states)")
    flops: float = Field(0.0, description="matmul FLOPs executed on one GPU")
    bytes: float = Field(0.0, description="bytes moved by memory-bound work on one GPU")
    kernels: float = Field(0.0, description="kernel launches (host time)")


class Performance(_Frozen):
    """Predicted speed of the job on one GPU type and, when the amount of training is known,
    its time and cost; null where a figure cannot be computed."""

    gpu: str = Field(description="the GPU type")
    num_gpus: int = Field(description="GPUs the job runs on")
    compute_dtype: str = Field(description="the matmul rate used: bf16, fp16, fp8, tf32 "
                               "(tensor cores) or fp32 (CUDA cores)")
    step_time_s: float = Field(description="one optimizer step: all micro-batches, the "
                               "optimizer and exposed communication")
    tokens_per_step: int = Field(description="tokens (samples for vision) per step, all GPUs")
    samples_per_step: int = Field(description="samples per step, all GPUs")
    tokens_per_s: float = Field(description="tokens per second, all GPUs")
    tokens_per_s_per_gpu: float = Field(description="tokens per second per GPU")
    samples_per_s: float = Field(description="samples per second, all GPUs")
    mfu: float = Field(description="model FLOPs utilisation: forward and backward matmul "
                       "FLOPs (no recomputation) / (step time x dense peak), per GPU")
    flops_per_step: float = Field(description="executed matmul FLOPs per step, all GPUs")
    bound: Bound = Field(description="what bounds the largest part of the step")
    phases: list[PhaseTime] = Field(default_factory=list, description="time per phase")
    communication_s: float = Field(0.0, description="communication per step not hidden "
                                   "behind compute")
    steps: float | None = Field(None, description="optimizer steps to train the given amount")
    training_time_s: float | None = Field(None, description="wall time to train the amount")
    gpu_hours: float | None = Field(None, description="training time x GPUs")
    price_per_hour: float | None = Field(None, description="USD per GPU-hour used for the cost")
    cost_usd: float | None = Field(None, description="gpu_hours x price_per_hour")
    cost_per_million_tokens_usd: float | None = Field(
        None, description="USD for a million tokens (samples for vision) at this speed: "
        "price_per_hour x num_gpus / tokens_per_s, per million; null without a price")
    factors: str = Field("", description="where the efficiency factors come from")
    step_time_range_s: tuple[float, float] | None = Field(
        None, description="80% interval of the step time, from the model's out-of-sample "
        "errors on published training runs (efficiency.toml [interval])")
    training_time_range_s: tuple[float, float] | None = Field(
        None, description="80% interval of the training time (as step_time_range_s)")
    cost_range_usd: tuple[float, float] | None = Field(
        None, description="80% interval of the cost (as step_time_range_s)")
    notes: list[str] = Field(default_factory=list, description="assumptions of the prediction")

    @property
    def cores(self) -> str:
        """Which units run the matmuls: fp32 without TF32 runs on the CUDA cores."""
        return "CUDA cores" if self.compute_dtype == "fp32" else "tensor cores"


class Fix(_Frozen):
    """Changes that make the job fit one GPU type, as a Job and CLI flags, with their
    effect (vramplan/planning/make_fit.py finds them)."""

    job: Job = Field(description="the job with the changes made")
    changes: list[str] = Field(description="the changes, in words")
    flags: str = Field(description="CLI flags that make them")
    changes_maths: bool = Field(description="true when training computes something different "
                                "(LoRA, QLoRA, 8-bit optimizer, bf16 weights, fp8)")
    device_total_bytes: int = Field(description="device_total per GPU after the changes")
    usable_bytes: int = Field(description="the GPU's usable memory")
    tokens_per_s: float | None = Field(description="predicted tokens per second after the "
                                       "changes, all GPUs; null when not modelled")
    summary: str = Field(description="the memory after the changes and the speed, in words")

