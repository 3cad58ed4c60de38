"""CPU kernels made to keep the memory CUDA's kernels keep: autocast casts and dropout.

CPU autocast keeps ops such as pow, layer_norm, softmax or sum in bf16, where CUDA autocast
runs them in fp32 (aten/src/ATen/autocast_mode.cpp). That changes activation dtypes and so
the memory of a step: GPT-2's tanh-GELU saves fp32 intermediates on a GPU. While
`cuda_autocast_policy()` is active, Python kernels registered on the AutocastCPU key give
those ops CUDA's casts; outside autocast they are never reached.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from vramplan.training.patches import PATCH_LOCK, patched
from vramplan.training.private_api import (
    AUTOCAST_CPU_KEYS,
    ExcludeDispatchKeyGuard,
    destroy_library,
    is_fake,
)

# aten/src/ATen/autocast_mode.cpp, CUDA: ops run in fp32 under autocast (CPU keeps them in
# the lower precision), and ops given dtype=float32 unless the caller set one.
_CUDA_FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm",
    "frobenius_norm.dim", "cosine_similarity", "dist", "renorm", "logsumexp",
    "binary_cross_entropy_with_logits", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "kl_div", "nll_loss", "nll_loss2d",
)
_CUDA_FP32_DTYPE_OPS = (
    "softmax.int", "log_softmax.int", "cumsum", "cumprod", "prod", "prod.dim_int", "sum",
    "sum.dim_IntList", "linalg_vector_norm",
)


_CUDA_LOW_OPS = ("_grouped_mm",)  # MoE expert matmuls: lower precision on CUDA

# CPU autocast runs these in fp32 as a whole; CUDA autocast has no rule for them, so their
# decomposition runs and each part is cast on its own: cross_entropy on bf16 logits keeps a
# bf16 log_softmax and upcasts only nll_loss's input (seen on an H200:
# benchmarks/results/gpu_runtime_probe.json, BERT's loss).
_CUDA_UNCAST_OPS = ("cross_entropy_loss",)


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """Make CPU autocast cast like CUDA autocast for the ops above, while active."""
    with PATCH_LOCK, warnings.catch_warnings():  # the filters go when the policy does
        warnings.filterwarnings("ignore", message=".*previously registered kernel")
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        lib = torch.library.Library("aten", "IMPL")
        try:
            _register_cuda_lists(lib)
            yield
        finally:
            destroy_library(lib)


def _register_cuda_lists(lib: torch.library.Library) -> None:
    for name in _CUDA_LOW_OPS:
        lib.impl(name, _low_kernel(_overload(name)), "AutocastCPU")
    for name in _CUDA_UNCAST_OPS:
        lib.impl(name, _overload(name).decompose, "AutocastCPU")
    for name in _CUDA_FP32_OPS:
        lib.impl(name, _fp32_kernel(_overload(name), set_dtype=False), "AutocastCPU")
    for name in _CUDA_FP32_DTYPE_OPS:
        lib.impl(name, _fp32_kernel(_overload(name), set_dtype=True), "AutocastCPU")


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


_LOW = (torch.float16, torch.bfloat16)
_AUTOCAST_CPU = AUTOCAST_CPU_KEYS


def _low_kernel(op):
    def kernel(*args, **kwargs):
        low = torch.get_autocast_dtype("cpu")
        with ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            args = [a.to(low) if isinstance(a, torch.Tensor) and a.dtype == torch.float32
                    else a for a in args]
            return op(*args, **kwargs)
    return kernel


def _fp32_kernel(op, set_dtype: bool):
    dtype_pos = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
    dtype_kw_only = dtype_pos is not None and op._schema.arguments[dtype_pos].kwarg_only

    def cast(value):
        if isinstance(value, torch.Tensor) and value.dtype in _LOW:
            return value.float()
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        return value

    def kernel(*args, **kwargs):
        with ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if not set_dtype:
                return op(*cast(args), **{k: cast(v) for k, v in kwargs.items()})
            first = args[0]
            if isinstance(first, torch.Tensor) and first.is_floating_point() \
                    and first.dtype != torch.float64:
                if dtype_kw_only or dtype_pos >= len(args):
                    if kwargs.get("dtype") is None:
                        kwargs["dtype"] = torch.float32
                elif args[dtype_pos] is None:
                    args = (*args[:dtype_pos], torch.float32, *args[dtype_pos + 1:])
            return op(*args, **kwargs)
    return kernel


class _EfficientAttention(torch.autograd.Function):
    """The tensors of CUDA's memory-efficient attention with a bias that needs a gradient
    (T5's trained position bias), for fake tensors only: the CPU has no such kernel and its
    math path would keep the s x s scores. Forward saves q, k, v, the bias, the output (laid
    out [b, s, heads, d] and returned as a transposed view, as CUDA does, so merging heads
    copies nothing) and an fp32 logsumexp per query row (rows padded to 32); backward
    returns a gradient for each input, the bias's at the bias's full shape
    (aten/src/ATen/native/transformers/cuda/attention.cu, _efficient_attention_forward)."""

    @staticmethod
    def forward(ctx, query, key, value, bias):
        batch, heads, rows = query.shape[:-1]
        out = query.new_empty((batch, rows, heads, value.shape[-1])).transpose(1, 2)
        logsumexp = query.new_empty((batch, heads, -(-rows // 32) * 32), dtype=torch.float32)
        ctx.save_for_backward(query, key, value, bias, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, bias, _, _ = ctx.saved_tensors
        return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
                torch.empty_like(bias))


@contextlib.contextmanager
def cuda_dropout_kernels() -> Iterator[None]:
    """Dropout as CUDA runs it, while active.

    CUDA's fused dropout (native_dropout) saves a 1-byte mask, where the CPU's saves a mask
    in the input's dtype; CUDA's flash and memory-efficient attention apply dropout inside
    the kernel, where CPU sdpa with dropout falls back to the math path that stores the
    s x s probabilities. So dropout goes through native_dropout here, and sdpa runs with
    dropout_p=0, which keeps the same tensors as CUDA's kernels (the flash kernel saves only
    its RNG state besides them). On fake tensors, sdpa with a mask that needs a gradient
    (T5's trained bias) keeps the tensors of CUDA's memory-efficient kernel instead of the
    CPU math path's (_EfficientAttention). Values differ from a CPU run's; memory is CUDA's.
    """
    functional = torch.nn.functional
    original_sdpa = functional.scaled_dot_product_attention

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        return torch.native_dropout(input, p, True)[0]

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad and is_fake(query):
            return _EfficientAttention.apply(query, key, value, attn_mask)
        return original_sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    with patched(functional, dropout=dropout, scaled_dot_product_attention=sdpa):
        yield
