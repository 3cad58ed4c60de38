"""Parameter memory per GPU: tensor-parallel and ZeRO/FSDP sharding, offload, and the
buffers sharding adds (gathered blocks, gradient buckets)."""

from __future__ import annotations

from vramplan.engines.param_memory import ParamMemory
from vramplan.engines.precision import dtypes_for
from vramplan.job import SHARDED_STRATEGIES, Job
from vramplan.units import format_bytes

# DeepSpeed's default reduce/allreduce bucket (reduce_bucket_size = 5e8 elements).
ZERO_BUCKET_ELEMENTS = 500_000_000
# FSDP keeps the current block gathered and prefetches the next (forward and backward).
FSDP_GATHERED_BLOCKS = 2


def per_gpu_params(job: Job, params: ParamMemory):
    """Shard parameter memory over tensor-parallel and ZeRO/FSDP ranks; add their buffers.
    `gathered` is held through forward and backward, `gathered_end` at backward's end."""
    par, notes = job.parallel, []
    tp, shard, strategy = par.tensor_parallel, par.shard_degree, par.strategy
    sharded_params = strategy in SHARDED_STRATEGIES
    w = params.weights / tp / (shard if sharded_params else 1)
    g = params.gradients / tp / (shard if strategy != "zero1" else 1)
    o = params.optimizer / tp / shard
    cast, gathered, root, comm = (params.cast_copies + params.cast_head) / tp, 0.0, 0.0, 0.0
    gathered_end = 0.0
    if sharded_params and shard > 1:
        # gathered blocks in the compute dtype replace autocast's weight copies; the root
        # unit (everything outside the blocks) is gathered through forward and again at the
        # start of backward. FSDP2 gathers in its param_dtype: fp32 weights under autocast
        # at half their size; a PEFT base is stored in 16-bit (or 4-bit) and gathers as
        # stored, so it is not halved again.
        halve = 2 if dtypes_for(job).autocast and job.peft is None else 1
        block = params.fp8_gathered_block or params.largest_block / halve
        gathered = (FSDP_GATHERED_BLOCKS * block + params.outside_blocks / halve) / tp
        root = params.outside_blocks / tp / halve
        gathered_end, cast = gathered, 0.0
        if not par.reshard_after_forward:
            # every unit stays gathered from its forward to its backward: at the forward's
            # end all of them, in their gathered dtype, and the backward gathers nothing new;
            # each unit reshards after its own backward, so as the gradients are made the
            # gathered set shrinks to what resharding leaves at backward's end
            gathered, root = params.weights / halve / tp, 0.0
            notes.append(f"FSDP without resharding after forward: "
                         f"{format_bytes(int(gathered))} of gathered parameters held from "
                         "each unit's forward to its backward")
    elif strategy == "ddp" and par.data_parallel > 1:
        comm = params.gradients / tp  # the Reducer's flat buckets (gradient_as_bucket_view=False)
        notes.append("DDP's gradient buckets double gradient memory; gradient_as_bucket_view="
                     "True removes the copy")
    elif strategy in ("zero1", "zero2") and par.data_parallel > 1:
        grad_bytes = params.gradients / max(params.trainable, 1)
        comm = min(params.gradients / tp, ZERO_BUCKET_ELEMENTS * grad_bytes)
    if job.offload.optimizer:
        notes.append(f"optimizer states offloaded to CPU: {format_bytes(int(o))} of host "
                     "memory per GPU")
        o = 0.0
    if job.offload.params:
        notes.append(f"parameters and gradients offloaded to CPU: {format_bytes(int(w + g))} "
                     "of host memory per GPU")
        w, g = 0.0, 0.0
    if job.optimizer == "paged-adamw-8bit":
        notes.append("paged optimizer states live in unified memory: under memory pressure "
                     "they page to the CPU instead of failing")
    return w, g, o, cast, gathered, root, comm, notes, gathered_end
