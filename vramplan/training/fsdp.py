"""FSDP2 sharding of a training setup, each repeated block its own unit."""

from __future__ import annotations

import torch
from torch import nn

from vramplan.job import Job
from vramplan.training.optimizers import build_optimizer
from vramplan.training.placement import HOST, placed
from vramplan.training.setup import TrainingSetup


def fully_shard_setup(setup: TrainingSetup, job: Job, mesh=None) -> int:
    """Shard the model with FSDP2 as the job's strategy asks, each repeated block its own
    unit, then rebuild the optimizer over the sharded parameters. Returns the block count.

    zero2 keeps parameters gathered after the forward; zero3 / fsdp / hybrid-shard reshard
    them unless parallel.reshard_after_forward is false. Under mixed precision FSDP gathers
    16-bit parameters and reduces gradients in fp32 (as accelerate and torchtitan set FSDP2
    up), so autocast has nothing to cast.

    offload.params: FSDP2's CPUOffloadPolicy (torch/distributed/fsdp/_fully_shard,
    _fsdp_param.py: the padded sharded parameter is moved to the CPU, and copied to the
    device for each all-gather; _fsdp_collectives.py foreach_reduce: each reduce-scattered
    gradient is copied to the CPU and the device buffer dropped). The optimizer then steps
    the CPU parameters (offload.optimizer, which the job must set). In the trace the CPU is
    training/placement.py's HOST."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    reshard = job.parallel.strategy != "zero2" and job.parallel.reshard_after_forward
    policy = MixedPrecisionPolicy(param_dtype=setup.autocast_dtype, reduce_dtype=torch.float32)
    offload = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if job.offload.params \
        else {}
    blocks = repeated_blocks(setup.model)
    if job.precision == "fp8" and job.fp8.fsdp_float8_all_gather:
        _float8_all_gather(setup)
    with placed(HOST if job.offload.params else None):  # the sharded parameters
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                        **offload)
        fully_shard(setup.model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                    **offload)
    if job.offload.params:
        for p in setup.trainable:
            p.register_post_accumulate_grad_hook(_gradient_to_host)
    setup.optimizer = build_optimizer(job, setup.trainable, [])  # over the sharded params
    return len(blocks)


def _gradient_to_host(p: torch.Tensor) -> None:
    """FSDP's copy of a sharded gradient to the CPU. On the trace's one fake device its
    `.to("cpu")` is a no-op that keeps the reduce-scatter buffer: copy it to HOST here, so
    the buffer is dropped as on a GPU."""
    from torch.distributed.tensor import DTensor

    grad = p.grad
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    with placed(HOST):
        host = torch.empty_like(local)
        host.copy_(local)
    p.grad = DTensor.from_local(host, grad.device_mesh, grad.placements, run_check=False,
                                shape=grad.shape, stride=grad.stride()) \
        if isinstance(grad, DTensor) else host


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the classes a Hugging Face model names in
    _no_split_modules, else the children of the largest nn.ModuleList."""
    names = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _float8_all_gather(setup: TrainingSetup) -> None:
    """torchao's enable_fsdp_float8_all_gather on the stand-in Fp8Linear weights (the real
    Float8Linear wraps its weights itself when converted)."""
    from vramplan.training.emulate.float8_gather import wrap_for_float8_all_gather
    from vramplan.training.emulate.lowbit import Fp8Linear

    count = wrap_for_float8_all_gather(setup.model, Fp8Linear)
    if count:
        setup.notes.append(f"fp8: FSDP2 all-gathers {count} linears' weights in float8 "
                           "(torchao enable_fsdp_float8_all_gather, stand-in)")

