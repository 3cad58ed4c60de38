"""Memory a CUDA process holds besides the model's tensors, and the fit of a report on GPUs.

Both depend on the GPU: the cuBLAS workspace is 32 MiB per handle on sm90+ and 8.125 MiB
before (aten/src/ATen/cuda/CublasHandlePool.cpp), and it comes from the caching allocator,
so it is counted in `temporary`; the CUDA context is outside the allocator.
"""

from __future__ import annotations

from collections.abc import Iterable

from vramplan.engines.report import GpuFit, MemoryReport
from vramplan.hardware.gpu import GPU
from vramplan.job import Runtime
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


def fit_table(report: MemoryReport, runtime: Runtime, gpus: Iterable[GPU],
              runtime_gpu: GPU | None) -> list[GpuFit]:
    """Fit of the report on each GPU, moving the cuBLAS workspaces to that GPU's size."""
    fits = []
    for gpu in gpus:
        delta = workspaces_bytes(runtime, gpu) - workspaces_bytes(runtime, runtime_gpu)
        required = report.device_total + delta
        headroom = gpu.usable_bytes - required
        fits.append(GpuFit(gpu=gpu.name, usable_bytes=gpu.usable_bytes, required_bytes=required,
                           headroom_bytes=headroom, fits=headroom >= 0))
    return fits
