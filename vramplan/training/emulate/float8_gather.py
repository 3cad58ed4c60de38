"""FSDP2's float8 all-gather as torchao does it (float8/fsdp_utils.py, torchao 0.19), for the
stand-in Fp8Linear (lowbit.py).

* ShardedFloat8Weight stands for WeightWithDynamicFloat8CastTensor: the fp32 weight (the
  local shard under FSDP2) whose fsdp_pre_all_gather casts the shard to float8 e4m3 and
  all-gathers that, with the scale (one fp32) as metadata.
* GatheredFloat8Weight stands for Float8TrainingTensor: fsdp_post_all_gather wraps the
  gathered float8 data as the unsharded weight (dtype: the param dtype, storage: 1 byte per
  value); no 16-bit copy of the weight exists. Fp8Linear uses its data directly and saves
  it for backward; FSDP2 frees it after forward and gathers it again in backward.

The amax all-reduce torchao runs in fsdp_pre_all_gather (or once per step with
precompute_float8_dynamic_scale_for_fsdp) moves one scalar per weight: it is left out.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten
E4M3 = torch.float8_e4m3fn

# ops whose output stays a ShardedFloat8Weight: those FSDP2 runs to shard and pad the
# weight, and the optimizer's state allocation (torchao's _ops_to_preserve_subclass)
_PRESERVE = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor,
             aten.copy_.default, aten.view.default, aten.as_strided.default,
             aten._to_copy.default, aten.split.Tensor, aten.clone.default}


class ShardedFloat8Weight(torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers in float8."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.detach.default:
            return cls(args[0]._tensor)
        args, kwargs = tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ShardedFloat8Weight(inner["_tensor"])

    def fsdp_pre_all_gather(self, mesh):
        return (self._tensor.to(E4M3),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if out is not None:
            return None  # later steps: FSDP2 re-allocated `data`, which `out` already wraps
        return GatheredFloat8Weight(data, param_dtype), (data,)


class GatheredFloat8Weight(torch.Tensor):
    """The unsharded weight as float8 data; its dtype is the param dtype, as the gradient
    autograd gives it is."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=dtype, device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, dtype: torch.dtype):
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # views (FSDP2's as_strided, nn.Parameter's detach) keep the float8 data
        if func in (aten.detach.default, aten.as_strided.default, aten.view.default,
                    aten.alias.default):
            outer = args[0]
            data = func(outer._data, *args[1:], **(kwargs or {}))
            return cls(data, outer.dtype)
        raise NotImplementedError(f"{func} on a gathered float8 weight: only the stand-in "
                                  "Fp8Linear reads it")

    def __tensor_flatten__(self):
        return ["_data"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return GatheredFloat8Weight(inner["_data"], dtype)


def float8_data(weight: torch.Tensor) -> torch.Tensor | None:
    """The float8 data of a weight FSDP2 gathered in float8 (None for any other weight)."""
    return weight._data if isinstance(weight, GatheredFloat8Weight) else None


def wrap_for_float8_all_gather(model: nn.Module, linear_type: type) -> int:
    """Give every `linear_type` module's weight torchao's float8 all-gather (before
    fully_shard, as torchao's Float8Linear.from_float does); returns how many."""
    wrapped = 0
    for module in model.modules():
        if type(module) is linear_type:
            weight = module.weight
            module.weight = nn.Parameter(ShardedFloat8Weight(weight.data),
                                         requires_grad=weight.requires_grad)
            wrapped += 1
    return wrapped
