"""The torch dtypes of a job's precision; replacing a module's parameters and buffers in
place (keeping tied ones tied)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vramplan.engines.precision import sixteen_bit_model
from vramplan.job import Job

# the 16-bit dtype of each precision: what autocast computes in, a PEFT base is stored in,
# and (sixteen_bit_model) the whole model is stored in
SIXTEEN_BIT = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16,
               "bf16-pure": torch.bfloat16, "fp8": torch.bfloat16,
               "bf16-master": torch.bfloat16, "fp16-master": torch.float16}


def model_dtype(job: Job) -> torch.dtype:
    """The dtype a fully trained model's weights (and float inputs) are stored in."""
    return SIXTEEN_BIT[job.precision] if sixteen_bit_model(job) else torch.float32


def _materialize(model: nn.Module, device: torch.device) -> None:
    """meta -> uninitialised tensors on `device` (Module.to_empty swaps tensors in place,
    which fails for fake tensors)."""
    replace_tensors(model, lambda t: torch.empty_like(t, device=device)
                     if t.device.type == "meta" else t)


def replace_tensors(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply fn to every parameter and buffer by reassignment, keeping tied ones tied."""
    new: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in new:
                    with torch.no_grad():
                        value = fn(t)
                    new[id(t)] = (nn.Parameter(value, requires_grad=t.requires_grad)
                                  if isinstance(t, nn.Parameter) and value is not t else value)
                table[name] = new[id(t)]
