"""The optimizer of a 16-bit model with fp32 master weights (precision bf16-master and
fp16-master), as DeepSpeed's ZeRO optimizer steps one (deepspeed/runtime/zero/
stage_1_and_2.py, step(), DeepSpeed 0.19.6): an fp32 copy of every trainable weight it
updates, the 16-bit gradients copied to fp32 all at once and then freed, the inner
optimizer run on the fp32 copies, and the results copied back into the 16-bit weights.
Apex AMP O2 keeps the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class MasterWeights(torch.optim.Optimizer):
    """Steps 16-bit parameters through `make_inner(fp32 copies)`. The copies are made at
    the first step, as optimizer states are, and kept in `state[param]["master"]` (the
    inner optimizer's states of that copy in `state[param]["inner"]`), so whoever sums
    optimizer state sees them."""

    def __init__(self, params, make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        super().__init__(list(params), {})
        self.make_inner = make_inner
        self.inner: torch.optim.Optimizer | None = None

    def _masters(self) -> list[torch.Tensor]:
        params = [p for group in self.param_groups for p in group["params"]]
        if self.inner is None:
            for p in params:
                self.state[p]["master"] = p.detach().float().requires_grad_(True)
            self.inner = self.make_inner([self.state[p]["master"] for p in params])
            for p in params:
                self.state[p]["inner"] = self.inner.state[self.state[p]["master"]]
        return params

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for p in self._masters() if p.grad is not None]
        for p in params:  # every fp32 gradient exists before the 16-bit ones go
            self.state[p]["master"].grad = p.grad.float()
        for p in params:
            p.grad = None
        self.inner.step()
        for p in params:
            master = self.state[p]["master"]
            p.copy_(master)
            master.grad = None
        return None
