"""What a paged optimizer's states cost in time when they do not fit beside the step.

bitsandbytes' paged optimizers (PagedAdamW, PagedAdamW8bit) keep the states of every
parameter of at least 1e5 elements in CUDA unified memory (engines/optimizer_states.py).
Before each parameter's update the optimizer prefetches its states to the GPU, updates
them, and synchronises the device (bitsandbytes 0.50.2 optim/optimizer.py
Optimizer8bit.step: prefetch_state, update_step, sync_gpu after every parameter), so the
kernels wait on every migration and none of it hides.

Where the states fit in the memory the step leaves free (the GPU's usable memory less the
job's device total: torch's caching allocator keeps its peak reserved), they stay on the
GPU after the first step and cost nothing more. Where they do not, NVIDIA's driver makes
room by evicting the least recently allocated 2 MB chunks to the CPU (open-gpu-kernel-modules
kernel-open/nvidia-uvm/uvm_pmm_gpu.c: the root_chunks.va_block_used LRU list, a chunk moved
to its tail when allocated), and the optimizer walks its parameters in the same order every
step: each state has been evicted before its turn comes again. So every step moves all the
paged states in and, updated, out again, over the GPU's link to CPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.engines.registry import run_engine
from vramplan.hardware.gpu import GPU
from vramplan.job import Job

PAGED_OPTIMIZERS = ("paged-adamw-8bit", "paged-adamw")


@dataclass(frozen=True)
class Paging:
    states: float   # bytes of optimizer state in unified memory, per GPU
    free: float     # GPU memory the step leaves free for them (0 when it needs more)
    moved: float    # bytes over the host link per step, in and out (0 when they fit)


def paging(job: Job, gpu: GPU) -> Paging | None:
    """The paged states of `job` on `gpu` and what each step moves; None for an optimizer
    that pages nothing."""
    if job.optimizer not in PAGED_OPTIMIZERS:
        return None
    report = run_engine(job, "formula", gpus=[gpu])
    states = float(report.unified_memory_bytes)
    free = float(max(0, report.fits[0].headroom_bytes))
    return Paging(states, free, 0.0 if states <= free else 2 * states)
