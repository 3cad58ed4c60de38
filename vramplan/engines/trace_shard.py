"""Sharded jobs in the trace engine: one process plays rank 0 of N.

zero2 / zero3 / fsdp / hybrid-shard run FSDP2 (fully_shard) over a fake process group
(torch.testing's FakeStore + the "fake" backend), so collectives allocate their real
buffers and do nothing else. FSDP frees and re-allocates unsharded parameters by resizing
storages in place, which dispatch does not see: alloc_storage / free_storage are wrapped to
report it. DDP's C++ reducer reads tensor data, which fake tensors have none of, so its
gradient buckets are added as DDP allocates them and the step is traced as on one GPU;
zero1 adds torch's ZeroRedundancyOptimizer (rank 0's share of the optimizer state).
"""

from __future__ import annotations

import contextlib
import gc
from collections import defaultdict
from typing import Any, Protocol

import torch

from vramplan.errors import EngineError
from vramplan.job import Job
from vramplan.training.fsdp import fully_shard_setup
from vramplan.training.setup import TrainingSetup


class _Tracker(Protocol):
    """What sharding needs of the trace's tracker (engines/trace.py): a protocol, so this
    module never imports the trace back (no circle, not even for type checking)."""

    live: dict[Any, Any]

    def resized(self, tensor: torch.Tensor, op: str) -> None: ...


@contextlib.contextmanager
def sharding(job: Job, tracker: _Tracker):
    """Yields the function that turns a built setup into rank 0's (a no-op for one GPU):
    zero2 / zero3 / fsdp / hybrid-shard: FSDP2 (fully_shard) on each block and the root over
    a fake process group of the shard degree; ddp: DDP's gradient buckets; zero1: buckets +
    ZeroRedundancyOptimizer over a fake group of the data-parallel degree."""
    degree = job.parallel.shard_degree
    if job.parallel.strategy in ("ddp", "zero1") and job.parallel.data_parallel > 1:
        if job.parallel.strategy == "ddp":
            yield lambda setup: _ddp_buckets(setup, tracker)
            return
        with _fake_process_group(job.parallel.data_parallel):
            yield lambda setup: _zero1(setup, job, tracker)
        return
    if degree <= 1:
        yield lambda setup: None
        return
    from torch.distributed.device_mesh import init_device_mesh
    with _fake_process_group(degree), _storage_resizes_reported(tracker):
        mesh = init_device_mesh("cpu", (degree,))  # outside fake mode

        def shard(setup: TrainingSetup) -> None:
            blocks = fully_shard_setup(setup, job, mesh)
            gc.collect()  # the first optimizer held the unsharded parameters
            setup.notes.append(f"{job.parallel.strategy}: FSDP2 over a fake process group of "
                               f"{degree} ranks, {blocks} blocks + root each a unit; "
                               "per-rank memory of rank 0; NCCL buffers are not counted")
        yield shard


@contextlib.contextmanager
def _fake_process_group(world_size: int):
    import torch.distributed as dist

    from vramplan.training.private_api import fake_store
    if dist.is_initialized():
        raise EngineError("a torch.distributed process group is already initialised in this "
                          "process: the sharded trace needs its own fake one")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=fake_store())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _storage_resizes_reported(tracker: _Tracker):
    from vramplan.training.private_api import fsdp_storage_modules
    _fsdp_param, _fsdp_param_group = fsdp_storage_modules()
    originals = (_fsdp_param.alloc_storage, _fsdp_param.free_storage,
                 _fsdp_param_group.alloc_storage)

    def alloc(tensor):
        originals[0](tensor)
        tracker.resized(tensor, "fsdp_all_gather")

    def free(tensor):
        originals[1](tensor)
        tracker.resized(tensor, "fsdp_reshard")

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc
    _fsdp_param.free_storage = free
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage, \
            _fsdp_param_group.alloc_storage = originals


def _zero1(setup: TrainingSetup, job: Job, tracker: _Tracker) -> None:
    """ZeRO-1: DDP's buckets, and torch's ZeroRedundancyOptimizer holding rank 0's share
    of the optimizer state (it broadcasts updated parameters after each step)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from vramplan.training.optimizers import build_optimizer
    _ddp_buckets(setup, tracker)
    setup.optimizer = ZeroRedundancyOptimizer(
        setup.trainable, optimizer_class=lambda params, **_: build_optimizer(job, params, []))
    gc.collect()
    setup.notes.append(f"zero1: optimizer state partitioned over {job.parallel.data_parallel} "
                       "ranks by ZeroRedundancyOptimizer; rank 0 reported")


DDP_BUCKET_BYTES = 25 * 2**20       # DistributedDataParallel bucket_cap_mb default
DDP_FIRST_BUCKET_BYTES = 1 * 2**20   # dist._DEFAULT_FIRST_BUCKET_BYTES


def _ddp_buckets(setup: TrainingSetup, tracker: _Tracker) -> None:
    """DDP's reducer cannot run on fake tensors (it reads data in C++), so its memory is
    added as what it allocates: flat gradient buckets, one per dtype and 25 MiB (the first
    1 MiB), holding a second copy of every gradient (gradient_as_bucket_view=False)."""
    by_dtype: dict[torch.dtype, int] = defaultdict(int)
    for p in setup.trainable:
        by_dtype[p.dtype] += p.numel() * p.element_size()
    buckets = []
    for dtype, total in by_dtype.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        cap, done = DDP_FIRST_BUCKET_BYTES, 0
        while done < total:
            size = min(cap, total - done)
            buckets.append(torch.empty(size // itemsize, dtype=dtype))
            done, cap = done + size, DDP_BUCKET_BYTES
    for bucket in buckets:
        tracker.live[bucket.untyped_storage()._cdata].op = "ddp_bucket"
    setup.ddp_buckets = buckets  # kept alive with the setup, as the reducer keeps them
    setup.notes.append(f"ddp: {len(buckets)} gradient buckets (25 MiB, first 1 MiB) added as "
                       "DDP allocates them; the step itself is traced as on one GPU; NCCL "
                       "buffers are not counted")


