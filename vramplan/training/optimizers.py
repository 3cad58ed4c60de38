"""Optimizers by the job's name and implementation, with the low-bit stand-ins."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from vramplan.errors import EngineError, ModelConfigError
from vramplan.job import MASTER_PRECISIONS, Job
from vramplan.training.emulate import lowbit
from vramplan.training.kernels import BNB, TORCHAO, Kernels


class _ValueFreeAdafactor(torch.optim.Adafactor):
    """torch's Adafactor, whose step reads its step count and norms with .item() to scale the
    update. Fake tensors have no values, so in the trace those reads give 1.0: the step
    allocates the same tensors, only the scale differs. Real tensors are untouched."""

    def step(self, closure=None):
        from vramplan.training.private_api import TorchDispatchMode, is_fake

        class ItemsOfFakeTensorsAreOne(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default and is_fake(args[0]):
                    return 1.0
                return func(*args, **(kwargs or {}))

        fake = any(is_fake(p) for g in self.param_groups for p in g["params"])
        with ItemsOfFakeTensorsAreOne() if fake else contextlib.nullcontext():
            return super().step(closure)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): one momentum buffer in the parameter's dtype."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:  # (setdefault would build zeros every step)
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(m.lerp(p.grad, 1 - beta1).sign_(), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - beta2)


# torchao's low-bit AdamW by the job's optimizer: the stand-in's state layout
TORCHAO_KINDS = {"adamw-4bit": "4bit", "adamw-fp8": "fp8", "adamw-8bit-torchao": "8bit"}
PAGED_NOTE = ("{name}: the states of tensors with at least 1e5 elements live in CUDA unified "
              "memory (bitsandbytes get_state_buffer), outside the caching allocator: the "
              "trace reports them apart as unified_memory_bytes (a CPU run holds them as "
              "ordinary memory)")


def build_optimizer(job: Job, params: list[nn.Parameter], notes: list[str],
                    kernels: Kernels | None = None):
    """kernels.optimizer names the real library to use (training/kernels.py); else the
    stand-ins of training/emulate. With offload.optimizer the step runs on the host."""
    if job.precision in MASTER_PRECISIONS:
        from vramplan.training.master import MasterWeights

        optimizer = MasterWeights(params, lambda masters: _build(job, masters, notes, kernels))
        notes.append(f"{job.precision}: fp32 master weights in the optimizer (made at the "
                     "first step), 16-bit gradients copied to fp32 and freed at each step"
                     + ("; no loss scaling (a dynamic loss scaler keeps no tensors)"
                        if job.precision == "fp16-master" else ""))
    else:
        optimizer = _build(job, params, notes, kernels)
    if job.offload.optimizer:
        from vramplan.training.offload import HostStepOptimizer

        return HostStepOptimizer(optimizer)
    return optimizer


def _build(job: Job, params: list[nn.Parameter], notes: list[str], kernels: Kernels | None):
    if not params:
        raise ModelConfigError("the model has no trainable parameters")
    if kernels is not None and kernels.optimizer in (BNB, TORCHAO):
        from vramplan.training import real_kernels

        if job.optimizer_impl != "foreach":
            notes.append(f"{job.optimizer}: {kernels.optimizer} has one implementation; "
                         f"optimizer_impl {job.optimizer_impl} does not apply")
        return real_kernels.build_optimizer(job.optimizer, params)
    impl = {"foreach": dict(foreach=True), "fused": dict(fused=True),
            "loop": dict(foreach=False)}[job.optimizer_impl]
    name = job.optimizer
    if name in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if name == "sgd-momentum" else 0,
                               **impl)
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(params, lr=1e-4, **impl)
    if name in ("adamw-8bit", "paged-adamw-8bit"):
        notes.append("8-bit AdamW: bitsandbytes layout (uint8 states + fp32 absmax per 256 "
                     "values; tensors under 4096 values keep fp32 states)")
        if name == "paged-adamw-8bit":
            notes.append(PAGED_NOTE.format(name=name))
        return lowbit.AdamW8bit(params, lr=1e-4, paged=name == "paged-adamw-8bit")
    if name == "paged-adamw":
        notes.append(PAGED_NOTE.format(name=name))
        return lowbit.AdamW32bit(params, lr=1e-4, paged=True)
    if name in TORCHAO_KINDS:
        from vramplan.training.emulate.torchao_optim import LowBitAdamW

        kind = TORCHAO_KINDS[name]
        notes.append(f"{name}: torchao AdamW{kind.capitalize()} state layout (block-wise codes "
                     "+ fp32 scales; tensors under 4096 values or not a multiple of the block "
                     "keep plain states)")
        return LowBitAdamW(params, kind=kind, lr=1e-4)
    if name == "adafactor":
        return _ValueFreeAdafactor(params, lr=1e-2, foreach=job.optimizer_impl == "foreach")
    if name == "lion":
        notes.append("lion: per-parameter loop implementation (torch has none)")
        return Lion(params)
    raise EngineError(f"optimizer {name!r} is not supported by the trace engine")
