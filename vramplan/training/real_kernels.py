"""The real low-bit libraries' layers and optimizers (training/kernels.py decides when).

* QLoRA: each frozen linear becomes a bitsandbytes Linear4bit (NF4, double quantisation
  per the job), one at a time: its 16-bit weight is made on the device, initialised and
  quantised before the next exists, so a 70B base is never whole in 16 bits on the GPU.
* Optimizers: bitsandbytes AdamW8bit / PagedAdamW8bit / PagedAdamW, torchao AdamW4bit /
  AdamWFp8, with the learning rate the stand-ins use.
* fp8: torchao's convert_to_float8_training with the job's recipe (or MXFP8Linear for
  mxfp8) on every linear but the output head.
"""

from __future__ import annotations

import torch
from torch import nn

NF4 = "nf4"
LR = 1e-4  # the stand-ins' learning rate (training/optimizers.py)


def quantize_linears_4bit(model: nn.Module, skip: set[int], double_quant: bool,
                          device: torch.device, compute_dtype: torch.dtype,
                          std: float = 0.02) -> int:
    """Replace every nn.Linear (not in `skip`) by a bitsandbytes Linear4bit on `device`,
    layer by layer. The model may be on the meta device: only shapes are read."""
    import bitsandbytes as bnb

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or id(child) in skip:
                continue
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features,
                                      bias=child.bias is not None, compute_dtype=compute_dtype,
                                      compress_statistics=double_quant, quant_type=NF4,
                                      device="meta")
            weight = torch.empty(child.out_features, child.in_features, dtype=compute_dtype,
                                 device=device).normal_(0.0, std)
            layer.weight = bnb.nn.Params4bit(weight, requires_grad=False,
                                             compress_statistics=double_quant, quant_type=NF4,
                                             module=layer)
            if child.bias is not None:
                layer.bias = nn.Parameter(torch.zeros(child.out_features, dtype=compute_dtype,
                                                      device=device), requires_grad=False)
            # Params4bit quantises when moved to its device; the 16-bit copy goes with `weight`
            layer = layer.to(device)
            if not getattr(layer.weight, "bnb_quantized", False):  # already there: force it
                layer.weight = layer.weight._quantize(device)
            del weight
            layer._is_hf_initialized = True  # transformers' initialize_weights leaves it alone
            setattr(parent, name, layer)
            replaced += 1
    return replaced


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of each 4-bit weight's quantisation state (absmax, code maps): they are
    neither parameters nor buffers, so a sum over those misses them."""
    tensors = []
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            tensors += [t for t in (state.absmax, state.code, getattr(state, "offset", None))
                        if isinstance(t, torch.Tensor)]
            state = state.state2 if getattr(state, "nested", False) else None
    return tensors


def build_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name in ("adamw-8bit", "paged-adamw-8bit", "paged-adamw"):
        import bitsandbytes as bnb

        cls = {"adamw-8bit": bnb.optim.AdamW8bit, "paged-adamw-8bit": bnb.optim.PagedAdamW8bit,
               "paged-adamw": bnb.optim.PagedAdamW}[name]
        return cls(params, lr=LR)
    if name in ("adamw-4bit", "adamw-fp8", "adamw-8bit-torchao"):
        from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

        cls = {"adamw-4bit": AdamW4bit, "adamw-fp8": AdamWFp8, "adamw-8bit-torchao": AdamW8bit}
        return cls[name](params, lr=LR)
    raise ValueError(f"no real-library optimizer for {name!r}")


def convert_to_fp8(model: nn.Module, skip: set[int], recipe: str = "tensorwise",
                   fsdp_float8_all_gather: bool = False) -> int:
    """torchao float8 training with `recipe` (Float8LinearConfig.from_recipe_name), or
    MXFP8Linear for "mxfp8", on every nn.Linear not in `skip`; returns how many were
    converted."""
    if recipe == "mxfp8":
        return _convert_to_mxfp8(model, skip)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather:  # (a frozen dataclass: rebuilt with the option)
        from dataclasses import replace
        config = replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: (
        id(module) not in skip and _fp8_shape_ok(module)))
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def _convert_to_mxfp8(model: nn.Module, skip: set[int]) -> int:
    """torchao's MXFP8Linear (prototype/moe_training/mxfp8_linear.py, torchtitan's dense
    MXFP8 converter): the same parameters, MXFP8Linear's forward and its defaults."""
    try:
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    except ImportError as error:
        from vramplan.errors import EngineError
        raise EngineError(f"fp8 recipe mxfp8 needs torchao's MXFP8Linear "
                          f"(torchao.prototype.moe_training.mxfp8_linear): {error}; upgrade "
                          "torchao (--engine trace still works without it)") from None
    _check_mx_capability(model)
    defaults = MXFP8Linear(MX_BLOCK_CHECK, MX_BLOCK_CHECK, bias=False, device="meta")
    converted = 0
    for module in model.modules():
        if type(module) is nn.Linear and id(module) not in skip and _fp8_shape_ok(module):
            module.__class__ = MXFP8Linear
            for name in ("kernel_preference", "scale_calculation_mode", "wgrad_with_hp"):
                setattr(module, name, getattr(defaults, name))
            converted += 1
    return converted


MX_BLOCK_CHECK = 32  # a shape MXFP8Linear accepts, for reading its defaults


def _check_mx_capability(model: nn.Module) -> None:
    """MXFP8's kernels need compute capability 10.0 (engines/runtime.py,
    MXFP8_MIN_CAPABILITY): say so before torchao fails inside a kernel."""
    from vramplan.engines.runtime import MXFP8_MIN_CAPABILITY

    device = next(model.parameters()).device
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MXFP8_MIN_CAPABILITY:
        from vramplan.errors import EngineError
        raise EngineError(f"fp8 recipe mxfp8 needs compute capability 10.0+ (Blackwell); "
                          f"{torch.cuda.get_device_name(device)} is "
                          f"{capability[0]}.{capability[1]}: use fp8 recipe tensorwise or "
                          "rowwise (--engine trace runs the MXFP8 stand-in anywhere)")


def _fp8_shape_ok(module: nn.Module) -> bool:
    # float8 matmuls need both dimensions divisible by 16 (torchao's own filter rule)
    return not isinstance(module, nn.Linear) or (
        module.in_features % 16 == 0 and module.out_features % 16 == 0)


def tensor_leaves(value) -> list[torch.Tensor]:
    """Plain tensors inside an optimizer state value: dicts and lists are walked, tensor
    subclasses (torchao's OptimState4bit/Fp8) give their inner tensors."""
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensor_leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensor_leaves(v)]
    if not isinstance(value, torch.Tensor):
        return []
    if type(value) not in (torch.Tensor, nn.Parameter) and hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        return [t for n in names for t in tensor_leaves(getattr(value, n))]
    return [value]


def is_paged(t: torch.Tensor) -> bool:
    """bitsandbytes marks the buffers it takes from CUDA unified memory."""
    return bool(getattr(t, "is_paged", False))
