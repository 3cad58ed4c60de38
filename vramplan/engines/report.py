"""MemoryReport: what every engine returns (formula, trace, measure).

All sizes are int bytes, per GPU (per rank for sharded jobs). The JSON form is a stable,
versioned document: `schema_version` changes whenever a field changes meaning or goes away.

    peak_allocated = weights + gradients + optimizer_states + activations + inputs + temporary
    peak_reserved  = peak_allocated + allocator_overhead        (torch max_memory_reserved)
    device_total   = peak_reserved + runtime_context            (what nvidia-smi shows)
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SCHEMA_VERSION = "1.0"

# Categories in the order they are shown. The first six are tensors the caching allocator
# hands out; the last two are what the process holds on top of them.
TENSOR_CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "inputs",
                     "temporary")
CATEGORIES = TENSOR_CATEGORIES + ("allocator_overhead", "runtime_context")

# sums of the categories that the JSON document repeats (see MemoryReport.to_json_dict)
DERIVED_FIGURES = ("peak_allocated", "peak_reserved", "device_total")

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

    @property
    def peak_allocated(self) -> int:
        return sum(self.categories[c] for c in TENSOR_CATEGORIES)

    @property
    def peak_reserved(self) -> int:
        return self.peak_allocated + self.categories["allocator_overhead"]

    @property
    def device_total(self) -> int:
        return self.peak_reserved + self.categories["runtime_context"]

    @field_validator("job")
    @classmethod
    def _job_as_in_json(cls, job: dict) -> dict:
        """Tuples (LoRA target_modules) as lists, as JSON reads them back."""
        def plain(value):
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return value
        return plain(job)

    @model_validator(mode="before")
    @classmethod
    def _derived_figures(cls, data):
        """The JSON document (to_json_dict) repeats three sums for readers; reading it back
        checks them against the categories and drops them."""
        if not isinstance(data, dict) or not set(data) & set(DERIVED_FIGURES):
            return data
        data = dict(data)
        given = {k: data.pop(k) for k in DERIVED_FIGURES if k in data}
        categories = data.get("categories")
        if isinstance(categories, dict) and all(
                isinstance(categories.get(c), int) for c in CATEGORIES):
            sums = {"peak_allocated": sum(categories[c] for c in TENSOR_CATEGORIES)}
            sums["peak_reserved"] = sums["peak_allocated"] + categories["allocator_overhead"]
            sums["device_total"] = sums["peak_reserved"] + categories["runtime_context"]
            wrong = [k for k, v in given.items() if v != sums[k]]
            if wrong:
                raise ValueError(f"{', '.join(wrong)} disagree with the categories' sums")
        return data

    def to_json_dict(self) -> dict:
        """The documented JSON document (see docs/report-schema.md)."""
        data = self.model_dump(mode="json")
        data["peak_allocated"] = self.peak_allocated
        data["peak_reserved"] = self.peak_reserved
        data["device_total"] = self.device_total
        return data
