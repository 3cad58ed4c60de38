"""What the formula refuses: compiled blocks it does not model, parallel layouts the model
cannot be split into, inputs its block model does not follow."""

from __future__ import annotations

from vramplan.engines import activations as act
from vramplan.engines import pipeline
from vramplan.engines.formula.saved import adapters_of
from vramplan.engines.precision import Dtypes
from vramplan.engines.step import Shapes, attention_impl
from vramplan.errors import EngineError, JobError
from vramplan.job import Job
from vramplan.models import Architecture


def check_compiled(job: Job, arch: Architecture, task: str) -> None:
    """The formula models compiled Llama-style decoder blocks and the compiled causal-LM
    loss; anything else is the trace's (which compiles the real model). vramplan's own
    chunked loss is never compiled (each chunk is checkpointed): eager in both engines."""
    why = []
    if job.compiles_loss and task != "causal-lm" and job.loss == "standard":
        why.append(f"a compiled {task} loss")
    if job.compiles_blocks and job.precision == "fp8":  # the trace refuses it too
        raise JobError("compiled blocks with fp8 are not modelled: set "
                       "compile_components=loss (blocks eager), drop compile, or use "
                       "--engine measure on a GPU with torchao")
    if job.compiles_blocks:
        if job.peft and job.peft.method != "lora":
            why.append(f"{job.peft.method} (a quantised base)")
        for stack in arch.stacks:
            reason = act.compiled_block_unsupported(
                stack, attention=attention_impl(job, arch), adapters=adapters_of(job),
                dropout=max(arch.hidden_dropout, arch.attention_dropout),
                norms_per_block=arch.norms_per_block(stack),
                rotary=arch.traits.rotary)
            if reason:
                why.append(reason)
    if why:
        raise JobError(f"the formula models torch.compile for Llama-style blocks (RMSNorm, "
                       f"rotary sdpa attention, gated MLP; full fine-tuning or LoRA) and "
                       f"the causal-LM loss; this job has {'; '.join(why)}: use "
                       "--engine trace, which compiles the real model (or "
                       "compile_components=loss to compile the loss only)")


def check_parallel(job: Job, arch: Architecture) -> None:
    pipeline.check_pipeline(job, arch)
    tp = job.parallel.tensor_parallel
    for stack in arch.stacks:
        if stack.num_heads % tp or stack.num_kv_heads % tp and stack.num_kv_heads >= tp:
            raise JobError(f"tensor_parallel={tp} must divide {arch.name}'s {stack.num_heads} "
                           f"attention heads ({stack.num_kv_heads} key/value heads)")
    if job.parallel.context_parallel > 1 and arch.kind not in ("decoder",):
        raise JobError("context_parallel is supported for decoder-only language models only")
    if arch.kind == "cnn" and (tp > 1):
        raise JobError("tensor_parallel is not supported for CNNs: use ddp or fsdp")


def check_context_parallel_split(job: Job, shapes: Shapes) -> None:
    """torch's context parallelism balances causal attention by cutting the sequence into
    2 x cp chunks (head and tail per rank: _context_parallel/_load_balancer.py), and refuses
    a length that does not divide."""
    cp = job.parallel.context_parallel
    if cp > 1 and shapes.stack_seq and shapes.stack_seq[0] % (2 * cp):
        raise JobError(f"context_parallel={cp} splits the sequence into {2 * cp} equal "
                       f"chunks: seq_len {shapes.stack_seq[0]} is not a multiple of {2 * cp}; "
                       f"use a multiple, e.g. {shapes.stack_seq[0] // (2 * cp) * 2 * cp or 2 * cp}")




def check_mxfp8_inputs(job: Job, dt: Dtypes) -> None:
    """torchao's MXFP8Linear does not cast its input to autocast's dtype (Float8Linear
    does): with fp32 weights under autocast its norm-fed linears save fp32 inputs and
    return fp32 outputs, which the block model here does not follow."""
    if job.precision == "fp8" and job.fp8.recipe == "mxfp8" and dt.residual == 4:
        raise EngineError("the formula models fp8 recipe mxfp8 where the linears see 16-bit "
                          "inputs: under FSDP (strategy fsdp or hybrid-shard, bf16 params as "
                          "torchtitan runs it) or with LoRA; on fp32 weights under autocast "
                          "torchao's MXFP8Linear keeps fp32 activations: use --engine trace")


