"""Memory a CUDA process holds besides the model's tensors, and the fit of a report on GPUs.

Both depend on the GPU: the cuBLAS workspace is 32 MiB per handle on sm90+ and 8.125 MiB
before (aten/src/ATen/cuda/CublasHandlePool.cpp), and it comes from the caching allocator,
so it is counted in `temporary`; the CUDA context is outside the allocator.

The fit rule and precision support per GPU live in vramplan.fit (re-exported here).
"""

from __future__ import annotations

from collections.abc import Iterable

from vramplan.engines.memory_report import GpuFit, MemoryReport
from vramplan.errors import JobError
from vramplan.fit import (  # noqa: F401
    MXFP8_MIN_CAPABILITY,
    PRECISION_MATMUL_DTYPE,
    SAFETY_MARGIN,
    attention_problem,
    fits_within,
    gpu_problem,
    precision_problem,
)
from vramplan.hardware.gpu import GPU
from vramplan.job import Job, Runtime
from vramplan.units import KiB, MiB

CUBLAS_WORKSPACE_HOPPER = 32 * MiB                # 32 MiB on sm90 and newer
CUBLAS_WORKSPACE_DEFAULT = 8 * MiB + 128 * KiB    # ":4096:2:16:8" = 8.125 MiB


def cublas_workspace_bytes(gpu: GPU | None) -> int:
    """One cuBLAS workspace on this GPU (None: assume Hopper, the common training GPU)."""
    if gpu is None:
        return CUBLAS_WORKSPACE_HOPPER
    major = int(gpu.compute_capability.split(".")[0]) if gpu.compute_capability else 0
    return CUBLAS_WORKSPACE_HOPPER if major >= 9 else CUBLAS_WORKSPACE_DEFAULT


def workspaces_bytes(runtime: Runtime, gpu: GPU | None) -> int:
    return runtime.cublas_workspaces * cublas_workspace_bytes(gpu)


# The runtime context, per GPU. Measured on one GPU so far: an H200 (sm90, driver 580, CUDA
# 13.0, torch 2.11; benchmarks/results/gpu_runtime_probe.json): before CUDA starts NVML
# already counts 644,939,776 bytes (615 MiB) as used, the driver's reservation, out of a
# 150,754,820,096-byte total; a training step's CUDA context and loaded kernels bring it to
# 1390 MiB (Runtime's default), so they are the other 775 MiB. The rule for every other
# GPU, until each is measured: the driver's reservation is the same share of the device's
# memory (it holds per-page bookkeeping), and the context is the same 775 MiB (the same
# torch kernels, loaded lazily). A job's own runtime.cuda_context_bytes (calibrate,
# measure, --cuda-context) replaces the rule on every GPU.
H200_DRIVER_RESERVED = 644_939_776
H200_TOTAL = 150_754_820_096
DEFAULT_RUNTIME_CONTEXT = Runtime.model_fields["cuda_context_bytes"].default
CONTEXT_AND_KERNELS = DEFAULT_RUNTIME_CONTEXT - H200_DRIVER_RESERVED


def runtime_context_bytes(runtime: Runtime, gpu: GPU | None) -> int:
    """CUDA context + kernels + driver reservation on `gpu` (None: the H200's figure)."""
    if gpu is None or runtime.cuda_context_bytes != DEFAULT_RUNTIME_CONTEXT:
        return runtime.cuda_context_bytes
    return int(H200_DRIVER_RESERVED * gpu.usable_bytes / H200_TOTAL) + CONTEXT_AND_KERNELS


def check_gpu_runs_job(job: Job, gpu: GPU) -> None:
    """Refuse a job its GPU cannot run: its precision, or its attention kernel."""
    problem = precision_problem(job.precision, gpu, job.fp8.recipe)
    if problem:
        recipe = f" (fp8 recipe {job.fp8.recipe})" if job.precision == "fp8" else ""
        raise JobError(f"precision {job.precision}{recipe} on {problem}")
    problem = attention_problem(job.attention, gpu)
    if problem:
        raise JobError(problem)


def fit_table(report: MemoryReport, runtime: Runtime, gpus: Iterable[GPU],
              runtime_gpu: GPU | None, *, workspaces_included: bool = True,
              margin: float = SAFETY_MARGIN) -> list[GpuFit]:
    """Fit of the report on each GPU, moving the cuBLAS workspaces and the runtime context
    to that GPU's size; a GPU that cannot run the job (its precision or attention kernel)
    does not fit.
    workspaces_included=False: the report has none (a CPU measurement): add each GPU's.
    A GPU fits when the job needs at most usable x (1 - margin)."""
    fits = []
    precision = report.job.precision
    included = workspaces_bytes(runtime, runtime_gpu) if workspaces_included else 0
    for gpu in gpus:
        delta = (workspaces_bytes(runtime, gpu) - included
                 + runtime_context_bytes(runtime, gpu) - report.categories["runtime_context"])
        required = report.device_total + delta
        headroom = gpu.usable_bytes - required
        problem = gpu_problem(precision, report.job.fp8.recipe, report.job.attention, gpu)
        fits.append(GpuFit(gpu=gpu.name, usable_bytes=gpu.usable_bytes, required_bytes=required,
                           headroom_bytes=headroom, margin=margin,
                           fits=fits_within(required, gpu.usable_bytes, margin) and not problem,
                           supported=not problem, problem=problem))
    return fits


def fits_for_job(report: MemoryReport, job: Job, runtime_gpu: GPU | None, *,
                 workspaces_included: bool = True,
                 margin: float = SAFETY_MARGIN) -> list[GpuFit]:
    """The fit table every engine fills: the job's GPU, else every catalog GPU."""
    from vramplan.hardware import get_gpu, list_gpus

    gpus = [get_gpu(job.gpu)] if job.gpu else list_gpus()
    return fit_table(report, job.runtime, gpus, runtime_gpu,
                     workspaces_included=workspaces_included, margin=margin)


def with_margin(fits: Iterable[GpuFit], margin: float) -> list[GpuFit]:
    """The same fit table judged with another safety margin."""
    return [fit.model_copy(update={
        "margin": margin, "fits": fit.supported and fits_within(fit.required_bytes,
                                                                fit.usable_bytes, margin)})
        for fit in fits]
