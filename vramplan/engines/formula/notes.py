"""The notes a formula report carries: what it assumed, what a technique does to memory."""

from __future__ import annotations

from vramplan.job import Job
from vramplan.models import Architecture
from vramplan.models.families import prequantized
from vramplan.units import format_bytes


def prequantized_note(job: Job, arch: Architecture) -> str | None:
    return prequantized(arch.extra, arch.name, job.peft.method if job.peft else None,
                        job.peft.double_quant if job.peft else False)


def technique_notes(job: Job, arch: Architecture) -> list[str]:
    notes = [*arch.notes, *filter(None, [prequantized_note(job, arch)])]
    if arch.shapes_from != "config":
        notes.append(f"{arch.model_type}: the formula has no table entry for this family; its "
                     f"shapes were read from the {arch.shapes_from}")
    tp = job.parallel.tensor_parallel
    if tp > 1 and not job.parallel.sequence_parallel:
        notes.append(f"tensor parallelism without sequence parallelism: each of the {tp} ranks "
                     "keeps the norms', residual dropouts' and residual stream's tensors whole "
                     "and does their memory-bound work whole (memory and time)")
    if job.attention != "eager" and arch.traits.eager_in_transformers:
        notes.append(f"{arch.model_type}: {job.attention} attention is modelled, as the "
                     "family's own trainer runs it (llm-foundry: FlashAttention); transformers' "
                     "class has eager attention only, which the trace runs (compare with "
                     "--attention eager)")
    if job.attention == "sdpa" and arch.traits.eager_attention_only:
        notes.append(f"transformers runs {arch.model_type} attention eagerly (it changes the "
                     "scores before the softmax), so memory is that of eager attention")
    if job.checkpointing != "none" and arch.stacks:
        notes.append("checkpointing frees and reallocates blocks of many sizes in backward: "
                     "the caching allocator keeps more reserved (measured on the H200: 30% of "
                     "the step's transient memory with full checkpointing, 12% selective, 6% "
                     "without), so when activations are small beside backward's temporaries "
                     "the device total can exceed the same job without checkpointing; "
                     "allocated memory never does")
    if job.precision == "fp8":
        notes.append(fp8_note(job))
    if job.activation_offload:
        notes.append("activation offloading (torchtune's OffloadActivations): saved tensors "
                     "wait in pinned host memory, the last 5 (the final norm's) stay on the "
                     "GPU; selective checkpointing's kept outputs are not offloaded")
    if job.checkpointing != "none" and not arch.stacks:
        notes.append(f"{arch.name} has no transformer blocks to checkpoint (transformers does "
                     "not support gradient checkpointing for it): estimated without it")
    return notes


def fp8_note(job: Job) -> str:
    recipe = job.fp8.recipe
    if recipe == "mxfp8":
        note = ("fp8 recipe mxfp8 (torchao MXFP8Linear): block linears save their 16-bit "
                "input and the weight itself, and cast both to float8 with one e8m0 scale "
                "per 32 values in forward and again in backward (temporaries)")
    elif job.compiles_blocks:
        # Inductor's partitioner recomputes what a weight gradient reads through a cast
        kept = ("gate * up in 16 bits for the down projection's 16-bit weight gradient"
                if recipe == "rowwise_with_gw_hp" else
                "the out projection's input as its float8 cast; no gate * up")
        note = (f"fp8 recipe {recipe} (torchao Float8Linear), compiled: a block keeps neither "
                f"of its norms' outputs (backward recomputes them and their float8 casts, "
                f"Inductor's partitioner) and keeps {kept}")
    else:
        note = (f"fp8 recipe {recipe} (torchao Float8Linear): block linears save their bf16 "
                "input and the weight itself and cast both to float8 in forward and again "
                "in backward; tensorwise, rowwise and rowwise_with_gw_hp save the same "
                "tensors and differ only in those temporaries (per-row fp32 scales; "
                "rowwise_with_gw_hp runs the weight-gradient matmul in bf16)")
    if job.fp8.fsdp_float8_all_gather:
        note += ("; FSDP2 all-gathers the block linears' weights in float8 (1 byte each, no "
                 "16-bit unsharded copy), in forward and again in backward")
    return note + "; no autocast weight copies for them; the rest as bf16-mixed"


def framework_notes(job: Job, unified: float) -> list[str]:
    notes = []
    if job.framework != "plain":
        notes.append(f"{job.framework} defaults applied where the job sets nothing "
                     "(vramplan/frameworks/profiles.toml)")
    if unified:
        notes.append(f"paged optimizer states: {format_bytes(int(unified))} in CUDA unified "
                     "memory, outside peak_allocated/peak_reserved; they use GPU memory the "
                     "step leaves free and page to the host when it is short")
    if job.keep_grads_between_steps:
        notes.append("gradients stay allocated between steps (zero_grad(set_to_none=False)): "
                     "they are counted in the forward too")
    return notes
