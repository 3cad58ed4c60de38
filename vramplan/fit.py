"""The fit policy: when a job fits a GPU. Every verdict (the fit table, search, sweep,
the planner, make-it-fit, headroom, the web app) asks this module.

A job fits a GPU when the GPU runs its precision and the job needs at most
(1 - margin) x the GPU's usable memory (gpus.toml's `usable`, what torch can allocate).

    >>> fits_within(20 * GiB, usable_bytes(get_gpu("L4")))
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field

from vramplan.errors import JobError
from vramplan.hardware.gpu import GPU

# 5%: the floor users of other memory finders asked for.
SAFETY_MARGIN = 0.05
# Margins from 0 up to (not including) 0.5: keeping half a GPU free is not a fit verdict
# any more but a different question (a smaller GPU).
MAX_MARGIN = 0.5

# The margin as a pydantic type, for every schema that takes one (web, plan options)
Margin = Annotated[float, Field(ge=0, lt=MAX_MARGIN, allow_inf_nan=False,
                                description="memory to keep free, a fraction of the usable "
                                "memory: fits when required <= usable x (1 - margin)")]


def check_margin(margin: float) -> float:
    """`margin`, or JobError (one line) when it is outside [0, MAX_MARGIN)."""
    if not (isinstance(margin, (int, float)) and math.isfinite(margin)
            and 0 <= margin < MAX_MARGIN):
        raise JobError(f"margin is a fraction of the GPU's memory, 0 to {MAX_MARGIN:g} "
                       f"(got {margin})")
    return float(margin)


def usable_bytes(gpu: GPU) -> int:
    """What torch can allocate on `gpu` (the catalog's figure)."""
    return gpu.usable_bytes


def limit_bytes(usable: int, margin: float = SAFETY_MARGIN) -> int:
    """The most a job may need on `usable` bytes: usable x (1 - margin), whole bytes."""
    return int(usable * (1 - margin))


def fits_within(required: int, usable: int, margin: float = SAFETY_MARGIN) -> bool:
    """The one fit rule: the job needs at most (1 - margin) of the usable memory."""
    return required <= usable * (1 - margin)


# --- precision support per GPU ---------------------------------------------------------------

# The dtype whose matmuls a precision setting needs; gpus.toml lists a dtype under a GPU's
# tflops only when its tensor (matrix) units run it (no bf16 on T4/V100, fp8 from Ada/Hopper)
PRECISION_MATMUL_DTYPE = {"fp32": "fp32", "bf16-mixed": "bf16", "bf16-pure": "bf16",
                          "bf16-master": "bf16", "fp8": "fp8", "fp16-mixed": "fp16",
                          "fp16-master": "fp16"}

# MXFP8's block-scaled matmuls (32 float8 values share one e8m0 scale) run on Blackwell's
# tensor cores: torchao's mx_formats check is_sm_at_least_100(), torchtitan's converter
# has_cuda_capability(10, 0) (torchtitan b5bcd76c components/quantization/mx.py)
MXFP8_MIN_CAPABILITY = (10, 0)


def precision_problem(precision: str, gpu: GPU, fp8_recipe: str = "tensorwise") -> str:
    """Why `gpu` cannot run `precision` ("" when it can); fp8_recipe: the job's fp8.recipe."""
    if precision == "fp8" and fp8_recipe == "mxfp8":
        return _mxfp8_problem(gpu)
    needed = PRECISION_MATMUL_DTYPE.get(precision)
    if needed is None or needed in gpu.tflops:
        return ""
    capability = f" (compute capability {gpu.compute_capability})" if gpu.compute_capability \
        else ""
    fallback = "bf16-mixed" if needed == "fp8" and "bf16" in gpu.tflops else "fp16-mixed or fp32"
    return f"{gpu.name}{capability} has no {needed} tensor cores: use {fallback}"


# --- attention kernels per GPU ---------------------------------------------------------------

# flash-attn's FlashAttention-2 runs on Ampere and newer (its README: "Ampere, Ada, or Hopper";
# ROCm MI200 / MI300 through its CK backend); its FlashAttention-3 kernels are built for
# compute capability 9.0 only (its hopper/ directory); cuDNN's fused attention (NVIDIA's)
# needs 8.0 too (cudnn-frontend's fused attention support: sm80+)
ATTENTION_MIN_CAPABILITY = {"flash-attn-2": (8, 0), "cudnn": (8, 0)}


def attention_problem(attention: str, gpu: GPU) -> str:
    """Why `gpu` cannot run the job's attention kernel ("" when it can)."""
    capability = gpu.compute_capability
    where = f"{gpu.name} (compute capability {capability})" if capability else gpu.name
    if attention == "flash-attn-3" and capability != "9.0":
        return (f"{where} cannot run attention flash-attn-3, whose kernels are Hopper's "
                "(9.0) only: use flash-attn-2 or sdpa")
    if attention == "cudnn" and gpu.vendor != "nvidia":
        return f"{gpu.name} has no cuDNN (NVIDIA's) for attention cudnn: use sdpa"
    least = ATTENTION_MIN_CAPABILITY.get(attention)
    if least and capability and tuple(int(x) for x in capability.split(".")) < least:
        return (f"{where} cannot run attention {attention}, which needs compute capability "
                f"{'.'.join(map(str, least))} or newer: use sdpa")
    return ""


def gpu_problem(job_precision: str, fp8_recipe: str, attention: str, gpu: GPU) -> str:
    """Why `gpu` cannot run the job whatever its memory ("" when it can): its precision,
    then its attention kernel."""
    problem = precision_problem(job_precision, gpu, fp8_recipe)
    return f"precision {job_precision}: {problem}" if problem else attention_problem(
        attention, gpu)


def _mxfp8_problem(gpu: GPU) -> str:
    capability = gpu.compute_capability
    if capability and tuple(int(x) for x in capability.split(".")) >= MXFP8_MIN_CAPABILITY:
        return ""
    where = f" (compute capability {capability})" if capability else ""
    fallback = "fp8 recipe tensorwise or rowwise" if "fp8" in gpu.tflops else "bf16-mixed"
    return (f"{gpu.name}{where} has no MXFP8 (block-scaled float8) tensor cores, which need "
            f"compute capability {'.'.join(map(str, MXFP8_MIN_CAPABILITY))}+ (Blackwell): use "
            f"{fallback}")
