"""MemoryReport: what every engine returns (formula, trace, measure).

All sizes are int bytes, per GPU (per rank for sharded jobs). The JSON form is a stable,
versioned document: `schema_version` changes whenever a field changes meaning or goes away.

    peak_allocated = weights + gradients + optimizer_states + activations + inputs + temporary
    peak_reserved  = peak_allocated + allocator_overhead        (torch max_memory_reserved)
    device_total   = peak_reserved + runtime_context            (what nvidia-smi shows)

unified_memory_bytes is apart from all three: optimizer states a paged optimizer
(bitsandbytes PagedAdamW, PagedAdamW8bit) keeps in CUDA unified memory (cudaMallocManaged),
outside torch's caching allocator. The driver moves their pages to the GPU while the
optimizer step uses them, into memory the step leaves free, and back to the host under
pressure: they never make a step run out of memory, but when device_total +
unified_memory_bytes exceeds the GPU, each step pages them over PCIe (slower, not failed).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from vramplan.job import Job

# planning's result types sit in a leaf (pydantic + Job): a report carries them, no circle
from vramplan.planning.results import Fix, Performance

SCHEMA_VERSION = "2.0"  # 2.0: job is the full Job, measured is typed, peaks are fields

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

    gpu: str = Field(description="catalog name of the GPU")
    usable_bytes: int = Field(description="memory the driver reports as total (the datasheet's "
                              "figure less what the driver keeps)")
    required_bytes: int = Field(description="device_total on this GPU (its cuBLAS workspace "
                                "size may differ from the report's)")
    headroom_bytes: int = Field(description="usable - required")
    margin: float = Field(0.0, description="the safety margin of the verdict: the share of "
                          "usable memory kept free")
    fits: bool = Field(description="required <= usable x (1 - margin), and the GPU runs the "
                       "job's precision")
    supported: bool = Field(True, description="false when the GPU cannot run the job's "
                            "precision (bf16 on T4/V100, fp8 before Ada/Hopper); fits is then "
                            "false whatever the memory")
    problem: str = Field("", description="why the GPU cannot run the job's precision, or ''")

    @property
    def headroom_fraction(self) -> float:
        return self.headroom_bytes / self.usable_bytes


class ModuleUsage(_Frozen):
    """A module or op responsible for memory at the peak (trace and measure engines)."""

    name: str = Field(description="module path or op name")
    bytes: int = Field(description="bytes it holds at the peak")
    category: str = Field(description="the category those bytes are counted in")


class RankFigures(_Frozen):
    """One rank's figures in a multi-process (torchrun) measurement."""

    rank: int
    peak_allocated: int
    peak_reserved: int
    device_total: int
    step_time_median_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None


class Measured(_Frozen):
    """What a real run saw: `measure` puts it in MemoryReport.measured, and `track()` writes
    it on its own (source "track"). Fields a device or run cannot give are null."""

    source: Literal["measure", "track"] = Field(description="who measured")
    device: str = Field(description="the device, e.g. cuda, cpu, or the GPU's name")
    device_name: str | None = Field(None, description="the GPU's name (CUDA)")
    complete: bool = Field(description="every planned step ran")
    stopped: str = Field("", description="why the run ended early (error, Ctrl-C); empty when "
                         "complete")
    steps: int = Field(description="optimizer steps that ran")
    warmup: int = Field(0, description="steps run before timing")
    steps_planned: int | None = Field(None, description="steps asked for (measure)")
    elapsed_s: float | None = Field(None, description="wall time of the run (track)")
    step_time_median_s: float | None = Field(None, description="median step time after warm-up")
    step_time_p90_s: float | None = Field(None, description="90th percentile step time")
    step_times_s: list[float] = Field(default_factory=list, description="every step's time")
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    losses: list[float] = Field(default_factory=list, description="loss of each step")
    non_finite_losses: int = Field(0, description="NaN or Inf losses")
    skipped_steps: int = Field(0, description="fp16 steps the grad scaler skipped")
    peak_allocated: int | None = Field(None, description="torch.cuda.max_memory_allocated(), or "
                                       "the CPU allocator's peak")
    peak_reserved: int | None = Field(None, description="torch.cuda.max_memory_reserved()")
    nvml_used_max: int | None = Field(None, description="largest NVML used memory seen (the "
                                      "whole device's)")
    context_overhead: int | None = Field(None, description="nvml_used_max - peak_reserved: "
                                         "memory outside torch's allocator")
    gpu_util_mean: float | None = Field(None, description="NVML GPU utilization, percent")
    gpu_util_max: float | None = None
    mem_bandwidth_util_mean: float | None = Field(None, description="NVML memory utilization, "
                                                  "percent")
    nvml_samples: int | None = None
    process_peak_rss: int | None = Field(None, description="CPU: the process's peak resident "
                                         "memory (track)")
    process_rss_at_start: int | None = None
    peak_rss_increase: int | None = None
    libraries: dict[str, str] = Field(default_factory=dict, description="versions of the "
                                      "libraries the run used: torch, transformers, peft, and "
                                      "bitsandbytes / torchao when the job needs them")
    kernels: str = Field("", description="whether the low-bit pieces (QLoRA base, 8-bit / 4-bit / "
                         "paged optimizer, fp8) ran the real libraries or vramplan's stand-ins")
    world_size: int | None = Field(None, description="ranks measured (torchrun)")
    worst_rank: int | None = None
    peak_allocated_max: int | None = None
    peak_allocated_min: int | None = None
    ranks: list[RankFigures] = Field(default_factory=list)


class MemoryReport(_Frozen):
    """Per-GPU memory of one training step, by category, from one engine."""

    schema_version: str = Field(SCHEMA_VERSION, description="changes when a field changes "
                                "meaning or goes away")
    engine: str = Field(description="the engine that produced it: formula, trace, measure")
    job: Job = Field(description="the Job that produced it, every field filled in")
    model_name: str = Field(description="catalog name, config path or factory")
    params_total: int = Field(description="parameters of the whole model (not per GPU)")
    params_trainable: int = Field(description="trainable parameters of the whole model")
    per_gpu_of: int = Field(1, description="GPUs the job runs on; every byte figure is per GPU")
    categories: dict[str, int] = Field(description="bytes at the peak per category: "
                                       + ", ".join(CATEGORIES))
    phase_peaks: dict[str, int] = Field(default_factory=dict, description="peak allocated in "
                                        "each phase: forward, backward, optimizer")
    peak_phase: str = Field("", description="the phase where the peak falls")
    runtime_gpu: str | None = Field(None, description="the GPU whose runtime figures the "
                                    "categories assume (null: a Hopper GPU)")
    fits: list[GpuFit] = Field(default_factory=list, description="the fit on each GPU checked")
    top_modules: list[ModuleUsage] = Field(default_factory=list, description="what holds the "
                                           "most memory at the peak (trace, measure)")
    timeline: list[tuple[str, int]] = Field(default_factory=list, description="(event, live "
                                            "bytes) over the step (trace, measure)")
    tokens_per_step: int = Field(0, description="tokens (or samples for vision) per optimizer "
                                 "step over all GPUs")
    notes: list[str] = Field(default_factory=list, description="assumptions and warnings; "
                             "nothing is guessed silently")
    measured: Measured | None = Field(None, description="what a real run saw (measure)")
    unified_memory_bytes: int = Field(0, description="paged optimizer states in CUDA unified "
                                      "memory, per GPU, outside every category and peak: they "
                                      "use GPU memory the step leaves free and page to the "
                                      "host when it is short (never an out-of-memory error)")
    performance: Performance | None = Field(None, description="predicted time and cost on "
                                            "one GPU type (estimate with a GPU)")
    to_fit: list[Fix] = Field(default_factory=list, description="when the job does not fit "
                              "the GPU asked for (estimate --gpu): the smallest changes that "
                              "make it fit (combinations of the techniques table), ranked by "
                              "how much they change: the maths of training kept first, then "
                              "fewer techniques, less time cost, speed; a full fine-tune also "
                              "gets its best fix without adapters; empty when it fits or no "
                              "GPU was named")

    @model_validator(mode="before")
    @classmethod
    def _drop_derived(cls, data: Any) -> Any:
        """A report read back from its own JSON carries the derived peaks: drop them."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in _DERIVED}
        return data

    @computed_field(description="weights + gradients + optimizer_states + activations + "
                    "inputs + temporary: torch.cuda.max_memory_allocated()")
    @property
    def peak_allocated(self) -> int:
        return sum(self.categories[c] for c in TENSOR_CATEGORIES)

    @computed_field(description="peak_allocated + allocator_overhead: "
                    "torch.cuda.max_memory_reserved()")
    @property
    def peak_reserved(self) -> int:
        return self.peak_allocated + self.categories["allocator_overhead"]

    @computed_field(description="peak_reserved + runtime_context: what nvidia-smi shows")
    @property
    def device_total(self) -> int:
        return self.peak_reserved + self.categories["runtime_context"]

    def to_json_dict(self) -> dict:
        """The documented JSON document (docs/report-schema.md), derived peaks included."""
        return self.model_dump(mode="json")


_DERIVED = ("peak_allocated", "peak_reserved", "device_total")
