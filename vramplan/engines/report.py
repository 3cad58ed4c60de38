"""MemoryReport: what every engine returns (formula, trace, measure).

All sizes are int bytes, per GPU (per rank for sharded jobs). The JSON form is a stable,
versioned document: `schema_version` changes whenever a field changes meaning or goes away.

    peak_allocated = weights + gradients + optimizer_states + activations + inputs + temporary
    peak_reserved  = peak_allocated + allocator_overhead        (torch max_memory_reserved)
    device_total   = peak_reserved + runtime_context            (what nvidia-smi shows)
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = "1.0"

# Categories in the order they are shown. The first six are tensors the caching allocator
# hands out; the last two are what the process holds on top of them.
TENSOR_CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "inputs",
                     "temporary")
CATEGORIES = TENSOR_CATEGORIES + ("allocator_overhead", "runtime_context")

CATEGORY_HELP = {
    "weights": "model parameters (trainable and frozen), per GPU",
    "gradients": "parameter gradients (persist across accumulation micro-steps)",
    "optimizer_states": "momentum / variance / master copies kept by the optimizer",
    "activations": "tensors saved in the forward pass for the backward pass",
    "inputs": "the micro-batch: token ids, labels, masks, pixels or audio features",
    "temporary": "logits and loss buffers, optimizer-step and comm buffers, workspaces",
    "allocator_overhead": "reserved by the caching allocator but not allocated (fragmentation)",
    "runtime_context": "CUDA context, kernels and library handles (outside the allocator)",
}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GpuFit(_Frozen):
    """Does the job fit on one GPU of the catalog?"""

    gpu: str
    usable_bytes: int     # what the driver reports as total memory
    required_bytes: int   # device_total for this GPU (its runtime context differs by arch)
    headroom_bytes: int   # usable - required; negative when it does not fit
    fits: bool

    @property
    def headroom_fraction(self) -> float:
        return self.headroom_bytes / self.usable_bytes


class ModuleUsage(_Frozen):
    """A module or op responsible for memory at the peak (trace and measure engines)."""

    name: str
    bytes: int
    category: str


class MemoryReport(_Frozen):
    schema_version: str = SCHEMA_VERSION
    engine: Literal["formula", "trace", "measure"]
    job: dict  # the Job that produced it, as Job.model_dump()
    model_name: str
    params_total: int
    params_trainable: int
    per_gpu_of: int = 1  # number of GPUs the job runs on; every byte figure is per GPU
    categories: dict[str, int]  # category -> bytes at the peak, keys = CATEGORIES
    phase_peaks: dict[str, int] = Field(default_factory=dict)  # forward/backward/optimizer
    peak_phase: str = ""
    runtime_gpu: str | None = None  # the GPU whose runtime context `categories` assumes
    fits: list[GpuFit] = Field(default_factory=list)
    top_modules: list[ModuleUsage] = Field(default_factory=list)
    timeline: list[tuple[str, int]] = Field(default_factory=list)  # (event, live bytes)
    tokens_per_step: int = 0  # tokens (or samples for vision) per optimizer step, all GPUs
    notes: list[str] = Field(default_factory=list)
    measured: dict | None = None  # step time, throughput, utilization (measure engine)
    performance: Performance | None = None  # predicted time and cost (estimate with a GPU)

    @property
    def peak_allocated(self) -> int:
        return sum(self.categories[c] for c in TENSOR_CATEGORIES)

    @property
    def peak_reserved(self) -> int:
        return self.peak_allocated + self.categories["allocator_overhead"]

    @property
    def device_total(self) -> int:
        return self.peak_reserved + self.categories["runtime_context"]

    def to_json_dict(self) -> dict:
        """The documented JSON document (see docs/report-schema.md)."""
        data = self.model_dump(mode="json")
        data["peak_allocated"] = self.peak_allocated
        data["peak_reserved"] = self.peak_reserved
        data["device_total"] = self.device_total
        return data


# --- time and cost (vramplan/plan/performance.py fills it) -----------------------------------

Bound = Literal["compute", "memory", "communication", "host"]


class PhaseTime(_Frozen):
    """One phase of a step on one GPU: its time and what bounds it."""

    phase: str              # forward, backward, recompute, optimizer, communication
    time_s: float           # per occurrence (forward/backward/recompute: per micro-batch)
    per_step: int           # occurrences per optimizer step (grad_accum for micro-batch phases)
    bound: Bound
    flops: float = 0.0      # matmul FLOPs executed on this GPU
    bytes: float = 0.0      # bytes moved by memory-bound work on this GPU
    kernels: float = 0.0    # kernel launches (host time)


class Performance(_Frozen):
    """Predicted speed of the job on one GPU type (per GPU figures say so), and when the
    amount of training is known, its time and cost. None where it cannot be computed."""

    gpu: str
    num_gpus: int
    compute_dtype: str            # the tensor-core rate used: bf16, fp16, fp8, fp32
    step_time_s: float            # one optimizer step (all micro-batches, communication)
    tokens_per_step: int          # all GPUs (samples for vision models)
    samples_per_step: int
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    samples_per_s: float
    mfu: float                    # model FLOPs (no recomputation) / (time x peak), per GPU
    flops_per_step: float         # executed FLOPs, all GPUs, recomputation included
    bound: Bound                  # what bounds most of the step
    phases: list[PhaseTime] = Field(default_factory=list)
    communication_s: float = 0.0  # exposed (not overlapped) communication per step
    steps: float | None = None    # optimizer steps to train the given amount
    training_time_s: float | None = None
    gpu_hours: float | None = None
    price_per_hour: float | None = None  # USD per GPU-hour used for cost_usd
    cost_usd: float | None = None
    factors: str = ""             # where the efficiency factors come from
    notes: list[str] = Field(default_factory=list)


MemoryReport.model_rebuild()  # resolves its `performance: Performance | None` field
