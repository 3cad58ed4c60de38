"""What the formula refuses beyond what every engine refuses (engines/checks.py): compiled
blocks it does not model, inputs its block model does not follow."""

from __future__ import annotations

from vramplan.engines import activations as act
from vramplan.engines.formula.saved import adapters_of
from vramplan.engines.precision import Dtypes
from vramplan.engines.step import attention_impl
from vramplan.errors import EngineError, JobError
from vramplan.job import COMPILED_MXFP8_REFUSED, Job
from vramplan.models import Architecture


def check_compiled(job: Job, arch: Architecture, task: str) -> None:
    """The formula models compiled Llama-style decoder blocks and the compiled causal-LM
    loss; anything else is the trace's (which compiles the real model). vramplan's own
    chunked loss is never compiled (each chunk is checkpointed): eager in both engines."""
    why = []
    if job.compiles_loss and task != "causal-lm" and job.loss == "standard":
        why.append(f"a compiled {task} loss")
    if job.compiles_blocks and job.precision == "fp8" and job.fp8.recipe == "mxfp8":
        raise JobError(COMPILED_MXFP8_REFUSED)
    if job.compiles_blocks:
        if job.precision == "fp8" and job.peft:
            why.append("fp8 with adapters")
        if job.peft and job.peft.method != "lora":
            why.append(f"{job.peft.method} (a quantised base)")
        if job.peft and job.peft.dora:
            why.append("DoRA")
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


def check_mxfp8_inputs(job: Job, dt: Dtypes) -> None:
    """torchao's MXFP8Linear does not cast its input to autocast's dtype (Float8Linear
    does): with fp32 weights under autocast its norm-fed linears save fp32 inputs and
    return fp32 outputs, which the block model here does not follow."""
    if job.precision == "fp8" and job.fp8.recipe == "mxfp8" and dt.residual == 4:
        raise EngineError("the formula models fp8 recipe mxfp8 where the linears see 16-bit "
                          "inputs: under FSDP (strategy fsdp or hybrid-shard, bf16 params as "
                          "torchtitan runs it) or with LoRA; on fp32 weights under autocast "
                          "torchao's MXFP8Linear keeps fp32 activations: use --engine trace")
