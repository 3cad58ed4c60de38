"""The configurations the planner may use, in one place: GPU counts, parallel layouts of a
count, and the optimizer implementation that keeps the maths. `search num-gpus` reads the
same lists, so its fewest GPUs is the planner's.
"""

from __future__ import annotations

from vramplan.job import FSDP_OWN_FIELDS, Job, Parallel
from vramplan.models import Architecture

SMALL_COUNTS = (1, 2, 4, 8)
LONG_SEQUENCE = 16384  # from here context parallelism is tried
# torch's foreach kernels keep parameter-sized temporaries in the step; fused ones do not
# and compute the same update. Adafactor / Lion / 8-bit optimizers have no fused kernel.
NO_FUSED = ("adafactor", "lion", "adamw-8bit", "paged-adamw-8bit")


def gpu_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """1, 2, 4, 8, then whole nodes doubling (2, 4, 8 ... nodes), up to max_gpus."""
    counts = [n for n in SMALL_COUNTS if n <= max_gpus]
    n = 2 * gpus_per_node
    while n <= max_gpus:
        counts.append(n)
        n *= 2
    return counts


def fused_optimizer(job: Job) -> dict:
    """The Job change to the fused optimizer step, {} when there is none or it is set."""
    if job.optimizer in NO_FUSED or job.optimizer_impl == "fused":
        return {}
    return {"optimizer_impl": "fused"}


# what a layout decides; the job's other parallel settings are its own and ride along
LAYOUT_FIELDS = frozenset({"strategy", "num_gpus", "tensor_parallel", "context_parallel",
                           "pipeline_parallel"})


def own_settings(job: Job, strategy: str) -> dict:
    """The parallel settings `job` sets beyond its layout (its node size, overlap_grad_reduce,
    async_tp, ...), for a fresh layout of `strategy` to keep; FSDP's own settings only under
    the strategies that have them. What the job leaves unset stays unset: its framework's
    profile decides it."""
    own = job.parallel
    keep = own.model_fields_set - LAYOUT_FIELDS - {
        name for name, strategies in FSDP_OWN_FIELDS.items() if strategy not in strategies}
    return {name: getattr(own, name) for name in keep}


def parallel_layouts(job: Job, arch: Architecture, n: int) -> list[Parallel]:
    """Every layout of n GPUs: tensor parallel degrees the heads divide, pipeline stages
    once tensor parallelism fills what it can, context parallelism for long sequences, and
    the data-parallel strategies of what is left; each keeps the job's own settings."""
    seq = job.seq_len or 0
    heads = [(s.num_heads, s.num_kv_heads) for s in arch.stacks]
    layers = sum(s.num_layers for s in arch.stacks)
    tps = [tp for tp in (1, 2, 4, 8)
           if tp <= n and not any(h % tp or (kv % tp and kv >= tp) for h, kv in heads)]
    fsdp_own = own_settings(job, "fsdp")
    # FSDP kept gathered after forward (SHARD_GRAD_OP) beside FSDP that reshards: one
    # all-gather fewer per micro-batch, every unit's weights held to its backward (a job
    # kept gathered already has it as its fsdp layout)
    kept_gathered = fsdp_own.get("reshard_after_forward", True) and kept_gathered_allowed(job)
    layouts = []
    for tp in tps:
        # pipeline stages only once tensor parallelism fills what it can (a node), as
        # Megatron-LM lays out large jobs: TP inside a node, PP across nodes
        pps = [1] + ([pp for pp in (2, 4, 8, 16) if pp <= layers]
                     if tp == tps[-1] and arch.kind == "decoder" else [])
        for cp in ((1, 2, 4) if seq >= LONG_SEQUENCE and arch.kind == "decoder" else (1,)):
            for pp in pps:
                group = tp * cp * pp
                if group > n or n % group:
                    continue
                dp = n // group
                strategies = ["none"] if dp == 1 else ["ddp", "zero2", "fsdp"] + (
                    ["hybrid-shard"] if dp > 8 else [])
                layouts += [Parallel(strategy=s, num_gpus=n, tensor_parallel=tp,
                                     context_parallel=cp, pipeline_parallel=pp,
                                     **own_settings(job, s))
                            for s in strategies]
                if dp > 1 and kept_gathered:
                    layouts.append(Parallel(strategy="fsdp", num_gpus=n, tensor_parallel=tp,
                                            context_parallel=cp, pipeline_parallel=pp,
                                            **{**fsdp_own, "reshard_after_forward": False}))
    return layouts


def kept_gathered_allowed(job: Job) -> bool:
    """Whether the job's framework can run FSDP without resharding after forward."""
    from vramplan.frameworks import framework_allows

    return framework_allows(job.framework, "parallel.reshard_after_forward", False)
