"""Stand-ins with torchao's low-bit AdamW state layouts (AdamW4bit, AdamWFp8, AdamW8bit).

Layouts from torchao 0.19.0 (docs/frameworks.md; sizes shared with the formula through
engines/optimizer_states.py): a state is quantised when its parameter has at least 4096
elements and a multiple of the block size, else it is a plain tensor of the parameter's
dtype. 4-bit: uint8 codes holding two values each, an fp32 scale per 128 values and a
16-entry fp32 code map per state. fp8: float8_e4m3fn codes, an fp32 scale per 256 values.
8-bit (torchao 0.18 optim/subclass_8bit.py OptimState8bit): uint8 codes, an fp32 scale per
256 values and a 256-entry fp32 code map per state.

torchao steps each parameter with a compiled kernel that dequantises, updates and
requantises in registers, so on fake tensors the step allocates nothing. On real tensors
this stand-in dequantises one parameter's states to fp32 temporaries (linear codes, not
torchao's maps): the values train, the temporaries are the stand-in's own.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from vramplan.engines.optimizer_states import (
    TORCHAO_4BIT_BLOCK,
    TORCHAO_8BIT_BLOCK,
    TORCHAO_FP8_BLOCK,
    TORCHAO_MIN_QUANT_SIZE,
)

QMAP_ENTRIES = {"4bit": 16, "8bit": 256}  # the code maps' fp32 entries (fp8 has none)
BLOCKS = {"4bit": TORCHAO_4BIT_BLOCK, "fp8": TORCHAO_FP8_BLOCK, "8bit": TORCHAO_8BIT_BLOCK}


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW whose two states have torchao's 4-bit, float8 or 8-bit block layout."""

    def __init__(self, params, kind: str, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2):
        if kind not in BLOCKS:
            raise ValueError("kind must be 4bit (AdamW4bit), fp8 (AdamWFp8) or 8bit "
                             "(AdamW8bit)")
        self.kind = kind
        self.block = BLOCKS[kind]
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _quantised(self, p: torch.Tensor) -> bool:
        return p.numel() >= TORCHAO_MIN_QUANT_SIZE and p.numel() % self.block == 0

    def _new_state(self, p: torch.Tensor) -> dict:
        if not self._quantised(p):
            return {"plain": torch.zeros_like(p)}
        n, device = p.numel(), p.device
        scale = torch.zeros(n // self.block, device=device)
        if self.kind == "fp8":
            return {"codes": torch.zeros(n, dtype=torch.float8_e4m3fn, device=device),
                    "scale": scale}
        codes = torch.zeros(n // 2 if self.kind == "4bit" else n, dtype=torch.uint8,
                            device=device)
        qmap = torch.zeros(QMAP_ENTRIES[self.kind], dtype=torch.float32, device=device)
        return {"codes": codes, "scale": scale, "qmap": qmap}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=self._new_state(p), exp_avg_sq=self._new_state(p))
                state["step"] += 1
                if is_fake(p) and self._quantised(p):
                    continue  # torchao's compiled kernel allocates nothing: nothing to trace
                self._update(p, state, group)

    def _update(self, p, state, group):
        beta1, beta2 = group["betas"]
        m = self._decode(state["exp_avg"], p)
        v = self._decode(state["exp_avg_sq"], p)
        grad = p.grad.float()
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = state["step"]
        denom = (v / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_((m / denom).to(p.dtype), alpha=-group["lr"] / (1 - beta1 ** step))
        self._encode(state["exp_avg"], m)
        self._encode(state["exp_avg_sq"], v)

    def _decode(self, slot: dict, p: torch.Tensor) -> torch.Tensor:
        if "plain" in slot:
            return slot["plain"].float()
        codes = slot["codes"]
        if self.kind == "4bit":  # linear signed codes: 0..15 for -1..1 of the block's absmax
            codes = (torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1).float()
                     - 7.5) / 7.5
        elif self.kind == "8bit":  # linear signed codes: 0..255 for -1..1
            codes = (codes.float() - 127.5) / 127.5
        values = codes.float().view(-1, self.block) * slot["scale"][:, None]
        return values.view(p.shape)

    def _encode(self, slot: dict, values: torch.Tensor) -> None:
        if "plain" in slot:
            slot["plain"].copy_(values)
            return
        blocks = values.view(-1, self.block)
        levels = torch.finfo(torch.float8_e4m3fn).max if self.kind == "fp8" else 1.0
        scale = blocks.abs().amax(1).clamp_min(1e-12) / levels
        slot["scale"].copy_(scale)
        scaled = blocks / scale[:, None]
        if self.kind == "4bit":
            q = (scaled * 7.5 + 7.5).round_().clamp_(0, 15).to(torch.uint8).view(-1, 2)
            slot["codes"].copy_((q[:, 0] << 4) | q[:, 1])
        elif self.kind == "8bit":
            slot["codes"].copy_((scaled.view(-1) * 127.5 + 127.5).round_().clamp_(0, 255)
                                .to(torch.uint8))
        else:
            slot["codes"].copy_(scaled.view(-1).to(torch.float8_e4m3fn))
