"""Stand-ins for low-bit kernels that need CUDA libraries (bitsandbytes, float8 matmuls).

They hold and allocate the same tensors as the real kernels, so the trace engine counts the
right bytes on a CPU-only machine; their arithmetic is simple but sane, not bit-exact.

* Packed4bitLinear: a frozen QLoRA base layer (bitsandbytes Linear4bit, NF4). Storage per
  weight: uint8 of numel/2 (two 4-bit codes per byte) + one absmax per 64-element block:
  fp32, or with double quantisation uint8 + one fp32 per 256 absmax values
  (bitsandbytes/functional.py quantize_4bit). Forward and backward dequantise the whole
  weight to the compute dtype as a temporary, as MatMul4Bit does; nothing else is saved.
* Fp8Linear: float8 training as torchao's Float8Linear does it: the high-precision input and
  weight are saved; each matmul casts its operands to float8 (with the recipe's scales) as
  temporaries. MxFp8Linear: the same for torchao's MXFP8Linear (e8m0 scale per 32 values).
* AdamW8bit: bitsandbytes' blockwise 8-bit AdamW layout (optim/optimizer.py,
  Optimizer2State.init_state): uint8 exp_avg and exp_avg_sq, one fp32 absmax per 256
  elements for each; tensors under 4096 elements keep fp32 states.
* AdamW32bit: bitsandbytes' 32-bit AdamW (PagedAdamW): two fp32 states whatever the
  parameter's dtype, updated in place by one fused kernel.
Paged variants (PagedAdamW8bit, PagedAdamW) take the state buffers of parameters with at
least 1e5 elements from CUDA unified memory (optim/optimizer.py get_state_buffer; the
absmax vectors stay torch tensors): created under training/placement.py's UNIFIED marker,
so the trace reports them apart from the allocator's memory.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vramplan.engines.optimizer_states import BNB_PAGED_MIN_SIZE
from vramplan.engines.precision import BNB_BLOCK as ADAM8_BLOCK
from vramplan.engines.precision import BNB_MIN_8BIT_SIZE as ADAM8_MIN_SIZE
from vramplan.engines.precision import NF4_BLOCK, NF4_DOUBLE_QUANT_BLOCK
from vramplan.training.emulate.float8_gather import float8_data
from vramplan.training.placement import UNIFIED, placed
from vramplan.training.private_api import is_fake

# --- QLoRA: the 4-bit base --------------------------------------------------------------------

class _Dequant4bitMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return nn.functional.linear(x, layer.dequantize(x.dtype), layer.bias)

    @staticmethod
    def backward(ctx, grad_out):
        # the weight is frozen: only the input gradient, with a fresh dequantised copy
        return grad_out @ ctx.layer.dequantize(grad_out.dtype), None


class Packed4bitLinear(nn.Module):
    """Frozen linear layer stored as NF4 codes + absmax, bitsandbytes-sized."""

    def __init__(self, linear: nn.Module, double_quant: bool):
        super().__init__()
        if isinstance(linear, nn.Linear):
            self.in_features, self.out_features = linear.in_features, linear.out_features
        else:  # transformers' Conv1D (GPT-2): the weight is [in, out]
            self.in_features, self.out_features = linear.weight.shape
        numel = self.in_features * self.out_features
        blocks = math.ceil(numel / NF4_BLOCK)
        device = linear.weight.device
        frozen = dict(requires_grad=False)
        self.packed = nn.Parameter(torch.zeros(math.ceil(numel / 2), dtype=torch.uint8,
                                               device=device), **frozen)
        if double_quant:
            self.absmax = nn.Parameter(torch.zeros(blocks, dtype=torch.uint8, device=device),
                                       **frozen)
            self.absmax2 = nn.Parameter(torch.ones(math.ceil(blocks / NF4_DOUBLE_QUANT_BLOCK),
                                                   device=device), **frozen)
        else:
            self.absmax = nn.Parameter(torch.ones(blocks, device=device), **frozen)
            self.absmax2 = None
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.dtype = linear.weight.dtype if linear.weight.element_size() == 2 else torch.bfloat16

    @property
    def weight(self) -> torch.Tensor:
        """A freshly dequantised 16-bit copy, as peft's dequantize_module_weight gets from
        bitsandbytes' dequantize_4bit (DoRA reads it in every forward)."""
        return self.dequantize(self.dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        shape = (self.out_features, self.in_features)
        if is_fake(self.packed) or self.packed.device.type == "meta":
            return torch.empty(shape, dtype=dtype, device=self.packed.device)  # kernel output only
        codes = torch.stack([self.packed >> 4, self.packed & 15], dim=-1).flatten()
        weight = (codes[: shape[0] * shape[1]].to(dtype) - 7.5) / 7.5
        scale = self.absmax.to(dtype).repeat_interleave(NF4_BLOCK)[: weight.numel()]
        return (weight * scale * 0.02).view(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Dequant4bitMatmul.apply(x, self)


def pack_frozen_linears(model: nn.Module, skip: set[int], double_quant: bool) -> int:
    """Replace every frozen nn.Linear or GPT-2 Conv1D (except modules in `skip`) by a
    Packed4bitLinear: transformers' replace_with_bnb_linear converts both to Linear4bit
    (integrations/bitsandbytes.py, `isinstance(module, Conv1D) or type(module) is
    nn.Linear`)."""
    from transformers.pytorch_utils import Conv1D

    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if ((type(child) is nn.Linear or isinstance(child, Conv1D)) and id(child) not in skip
                    and not child.weight.requires_grad):
                setattr(parent, name, Packed4bitLinear(child, double_quant))
                replaced += 1
    return replaced


# --- fp8 ----------------------------------------------------------------------------------------
# torchao's recipes (float8/config.py, Float8LinearConfig.from_recipe_name, torchao 0.19):
# tensorwise: one fp32 scale per tensor, e4m3 input and weight, e5m2 grad_output;
# rowwise: e4m3 everywhere, one fp32 scale per row of each cast (axiswise);
# rowwise_with_gw_hp: as rowwise, but the weight cast for grad_input is tensorwise and
# grad_weight = input_hp.t() @ grad_output_hp is not cast at all.
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MX_BLOCK = 32  # MXFP8: 32 float8 values share one e8m0 (1-byte) scale


def _cast(t: torch.Tensor, dtype: torch.dtype, how: str, out: torch.dtype) -> torch.Tensor:
    """A float8 copy of a 2-d `t` with its scales ("tensor": one fp32, "row": fp32 per row,
    "col": fp32 per column, "mx": a uint8 e8m0 per 32 values along a row), returned
    dequantised to `out`, which the emulated matmul reads (a scaled matmul would read the
    float8 data and scales directly)."""
    rows, cols = t.shape
    shape = {"tensor": (1,), "row": (rows, 1), "col": (1, cols),
             "mx": (rows, -(-cols // MX_BLOCK))}[how]
    scale = torch.ones(shape, dtype=torch.uint8 if how == "mx" else torch.float32,  # noqa: F841
                       device=t.device)  # (alive beside the float8 data, as in the kernel)
    data = t.to(dtype)
    return data.to(out)


class _Fp8Matmul(torch.autograd.Function):
    """torchao's matmul_with_hp_or_float8_args (float8/float8_linear.py, torchao 0.19):
    the high-precision input and weight are saved for backward, and each matmul casts its
    operands to float8 as temporaries (forward, and again in backward), per the recipe."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        # a weight FSDP2 gathered in float8 is saved as that float8 data (no cast needed)
        gathered = float8_data(weight)
        ctx.save_for_backward(x, weight if gathered is None else gathered)
        ctx.recipe, ctx.weight_dtype = recipe, weight.dtype
        how = "tensor" if recipe == "tensorwise" else "row"
        flat = x.reshape(-1, x.shape[-1])
        x8 = _cast(flat, E4M3, how, x.dtype)
        w8 = _cast(weight, E4M3, how, x.dtype) if gathered is None else gathered.to(x.dtype)
        out = x8 @ w8.t()
        out = out.reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias.to(out.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        recipe, c = ctx.recipe, grad_out.dtype
        flat_g = grad_out.reshape(-1, grad_out.shape[-1])
        flat_x = x.reshape(-1, x.shape[-1])
        if weight.dtype == E4M3:  # gathered in float8 (tensorwise only)
            g_in, w_in = _cast(flat_g, E5M2, "tensor", c), weight.to(c)
        elif recipe == "tensorwise":
            g_in, w_in = _cast(flat_g, E5M2, "tensor", c), _cast(weight, E4M3, "tensor", c)
        else:
            w_how = "tensor" if recipe == "rowwise_with_gw_hp" else "col"
            g_in, w_in = _cast(flat_g, E4M3, "row", c), _cast(weight, E4M3, w_how, c)
        grad_x = (g_in @ w_in).to(x.dtype).reshape(x.shape)
        del g_in, w_in
        if recipe == "rowwise_with_gw_hp":
            grad_w = flat_g.t() @ flat_x.to(c)  # high precision, no casts
        else:
            g_dtype, how = (E5M2, "tensor") if recipe == "tensorwise" else (E4M3, "col")
            grad_w = _cast(flat_g, g_dtype, how, c).t() @ _cast(flat_x, E4M3, how, c)
        grad_b = flat_g.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w.to(ctx.weight_dtype), grad_b, None


class Fp8Linear(nn.Linear):
    """nn.Linear as torchao's Float8Linear runs it: under autocast the input is cast to
    the autocast dtype first (float8_linear.py), then the float8 matmul above."""

    recipe = "tensorwise"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        with torch.autocast(kind, enabled=False):
            return _Fp8Matmul.apply(x, self.weight, self.bias, self.recipe)


class _MxFp8Matmul(torch.autograd.Function):
    """torchao's mx_mm (prototype/moe_training/mxfp8_linear.py, torchao 0.19): the input and
    weight are saved as they arrive; forward casts both to float8 e4m3 with an e8m0 scale
    per 32 values (dim 0); backward casts grad_output along both dims, the weight along dim
    1 and the input along dim 1 (wgrad_with_hp=False, MXFP8Linear's default)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        flat = x.reshape(-1, x.shape[-1])
        out = _cast(flat, E4M3, "mx", x.dtype) @ _cast(weight, E4M3, "mx", x.dtype).t()
        out = out.reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias.to(out.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        flat_g = grad_out.contiguous().reshape(-1, grad_out.shape[-1])
        flat_x = x.reshape(-1, x.shape[-1])
        c = flat_g.dtype
        w_t = _cast(weight.t().contiguous(), E4M3, "mx", c)    # the weight along dim 1
        grad_x = (_cast(flat_g, E4M3, "mx", c) @ w_t.t()).to(x.dtype).reshape(x.shape)
        del w_t
        g_t = _cast(flat_g.t().contiguous(), E4M3, "mx", c)    # grad_output along dim 1
        x_t = _cast(flat_x.t().contiguous(), E4M3, "mx", c)    # the input along dim 1
        grad_w = g_t @ x_t.t()
        grad_b = flat_g.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w.to(weight.dtype), grad_b


class MxFp8Linear(nn.Linear):
    """nn.Linear as torchao's MXFP8Linear runs it: no cast of the input to autocast's
    dtype (unlike Float8Linear), the output in the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return _MxFp8Matmul.apply(x, self.weight, self.bias)


def convert_to_fp8(model: nn.Module, skip: set[int], recipe: str = "tensorwise") -> int:
    """Give every nn.Linear not in `skip` the float8 forward of `recipe` (the same
    parameters); returns how many were converted."""
    converted = 0
    for module in model.modules():
        if type(module) is nn.Linear and id(module) not in skip:
            if recipe == "mxfp8":
                module.__class__ = MxFp8Linear
            else:
                module.__class__ = Fp8Linear
                module.recipe = recipe
            converted += 1
    return converted


# --- 8-bit AdamW --------------------------------------------------------------------------------

class AdamW8bit(torch.optim.Optimizer):
    """AdamW with blockwise-quantised uint8 states (bitsandbytes AdamW8bit memory layout).

    Quantisation is linear per block (bitsandbytes uses a dynamic map); the update is AdamW.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 paged: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.paged = paged

    def _init_state(self, p: torch.Tensor) -> dict:
        if p.numel() < ADAM8_MIN_SIZE:  # under 1e5 elements: never paged
            zeros = dict(dtype=torch.float32, device=p.device)
            return {"step": 0, "exp_avg": torch.zeros(p.shape, **zeros),
                    "exp_avg_sq": torch.zeros(p.shape, **zeros)}
        blocks = math.ceil(p.numel() / ADAM8_BLOCK)
        with placed(_state_place(p, self.paged)):
            codes = {"state1": torch.zeros(p.shape, dtype=torch.uint8, device=p.device),
                     "state2": torch.zeros(p.shape, dtype=torch.uint8, device=p.device)}
        return {"step": 0, **codes,
                "absmax1": torch.zeros(blocks, dtype=torch.float32, device=p.device),
                "absmax2": torch.zeros(blocks, dtype=torch.float32, device=p.device)}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p))
                state["step"] += 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                if "exp_avg" in state:
                    m, v = state["exp_avg"], state["exp_avg_sq"]
                    m.lerp_(p.grad.float(), 1 - beta1)
                    v.mul_(beta2).addcmul_(p.grad.float(), p.grad.float(), value=1 - beta2)
                    step = state["step"]
                    denom = (v / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
                    p.add_((m / denom).to(p.dtype), alpha=-group["lr"] / (1 - beta1 ** step))
                elif not is_fake(p):  # the fused kernel allocates nothing: nothing to trace
                    self._blockwise_update(p, state, group, beta1, beta2)

    @staticmethod
    def _blockwise_update(p, state, group, beta1, beta2):
        # Chunks of whole blocks keep the fp32 temporaries small, as the CUDA kernel keeps
        # them in registers. Quantisation here is linear per block (bitsandbytes: dynamic map).
        # On the CPU, small chunks for small tensors keep checks against the trace within ~1%;
        # on a GPU each chunk costs ~25 kernel launches, so chunks are 1 Mi elements (~24 MiB
        # of temporaries): 512-element chunks made a LoRA step take 14 s on an H200.
        if p.is_cuda:
            chunk = 4096 * ADAM8_BLOCK
        else:
            chunk = (2 if p.numel() <= 2**20 else 256) * ADAM8_BLOCK
        flat_p, grad = p.view(-1), p.grad.view(-1)
        s1, s2 = state["state1"].view(-1), state["state2"].view(-1)
        step = state["step"]
        alpha, v_correction = -group["lr"] / (1 - beta1 ** step), 1 - beta2 ** step
        for start in range(0, p.numel(), chunk):
            end = min(start + chunk, p.numel())
            pad = (-(end - start)) % ADAM8_BLOCK
            blocks = slice(start // ADAM8_BLOCK, math.ceil(end / ADAM8_BLOCK))
            a1, a2 = state["absmax1"][blocks], state["absmax2"][blocks]

            def grid(t, pad=pad):  # [n] -> [blocks, 256]
                return nn.functional.pad(t, (0, pad)).view(-1, ADAM8_BLOCK)

            m = (grid(s1[start:end].float()) - 127.5) / 127.5 * a1[:, None]
            v = (grid(s2[start:end].float()) / 255.0 * a2[:, None]).square_()  # sqrt(v) is stored
            g = grid(grad[start:end].float())
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            # clamped: a coarse linear code can round sqrt(v) to 0 where m is not
            update = (m / ((v / v_correction).sqrt() + group["eps"])).clamp_(-1, 1)
            update = update.flatten()[: end - start]
            flat_p[start:end].add_(update.to(p.dtype), alpha=alpha)
            a1.copy_(m.abs().amax(1).clamp_min(1e-12))
            v.sqrt_()
            a2.copy_(v.amax(1).clamp_min(1e-12))
            s1[start:end] = (m / a1[:, None] * 127.5 + 127.5).round().flatten()[: end - start]
            s2[start:end] = (v / a2[:, None] * 255.0).round().flatten()[: end - start]


def _state_place(p: torch.Tensor, paged: bool) -> str | None:
    """bitsandbytes get_state_buffer: paged only from 1e5 elements (`A.numel() < 1e5`)."""
    return UNIFIED if paged and p.numel() >= BNB_PAGED_MIN_SIZE else None


class AdamW32bit(torch.optim.Optimizer):
    """bitsandbytes' 32-bit AdamW (Optimizer2State with optim_bits=32; PagedAdamW when
    paged): fp32 exp_avg and exp_avg_sq whatever the parameter's dtype, updated in place by
    one fused kernel (optimizer_update_32bit) that allocates nothing."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 paged: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.paged = paged

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    with placed(_state_place(p, self.paged)):
                        state.update(step=0, state1=torch.zeros(p.shape, dtype=torch.float32,
                                                                device=p.device),
                                     state2=torch.zeros(p.shape, dtype=torch.float32,
                                                        device=p.device))
                state["step"] += 1
                if is_fake(p):  # the fused kernel allocates nothing: nothing to trace
                    continue
                m, v, g = state["state1"], state["state2"], p.grad.float()
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v / (1 - beta2 ** state["step"])).sqrt_().add_(group["eps"])
                p.add_((m / denom).to(p.dtype), alpha=-group["lr"] / (1 - beta1 ** state["step"]))
