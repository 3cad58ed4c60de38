"""Saved activations: what the blocks and the layers around them keep for backward, after
checkpointing and activation offloading."""

from __future__ import annotations

from vramplan.engines import activations as act
from vramplan.engines import pipeline
from vramplan.engines.formula import dora
from vramplan.engines.precision import Dtypes, adapter_bytes, dtypes_for
from vramplan.engines.step import Shapes, attention_impl
from vramplan.job import OP_LEVEL_CHECKPOINTING, Job
from vramplan.models import Architecture


def adapters_of(job: Job) -> act.Adapters:
    if job.peft is None:
        return act.Adapters()
    dt = dtypes_for(job)
    upcast = adapter_bytes(job) if not dt.autocast and adapter_bytes(job) > dt.compute else 0
    return act.Adapters(frozenset(job.peft.target_modules), job.peft.rank, job.peft.dropout,
                        base_trainable=False, upcast_bytes=upcast)


def _adapters(job: Job, arch: Architecture) -> act.Adapters:
    adapters = adapters_of(job)
    if job.peft and "all-linear" in job.peft.target_modules:
        adapters = act.Adapters(frozenset(ln.name for s in arch.stacks for ln in s.linears),
                                adapters.rank, adapters.dropout, False, adapters.upcast_bytes)
    return adapters


def _block_saved(job: Job, arch: Architecture, stack, seq: int, encoder_seq: int, dt: Dtypes,
                 adapters: act.Adapters) -> list[tuple[str, int]]:
    """What one block of `stack` saves for backward, before checkpointing."""
    if job.compiles_blocks:
        return act.compiled_block_saved_tensors(
            stack, act.BlockShape(job.batch_size, seq), dt, adapters,
            fp32_adapters=dt.autocast and adapter_bytes(job) == 4,
            fp8_recipe=job.fp8.recipe if job.precision == "fp8" else None)
    return act.block_saved_tensors(
        stack, act.BlockShape(job.batch_size, seq, encoder_seq), dt,
        attention=attention_impl(job, arch), hidden_dropout=arch.hidden_dropout,
        attention_dropout=arch.attention_dropout, adapters=adapters,
        traits=arch.traits, norms_per_block=arch.norms_per_block(stack)) + dora.saved(
        job, stack, job.batch_size * seq, dt)


def stack_activations(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes):
    """Saved activations of all blocks (after checkpointing), and of the largest block
    (what checkpointing recomputes at a time: the whole block, or under selective
    checkpointing what it does not keep)."""
    total, largest, recomputed = 0.0, 0.0, 0.0
    adapters = _adapters(job, arch)
    for stack, seq in zip(arch.stacks, shapes.stack_seq):
        encoder_seq = shapes.stack_seq[0] if stack.cross_attention else 0
        saved = _block_saved(job, arch, stack, seq, encoder_seq, dt, adapters)
        block = sum(b for _, b in saved)
        largest = max(largest, block)
        if job.checkpointing == "full":
            # each block keeps only its input; one block is recomputed at a time in backward
            total += stack.num_layers * dt.residual * job.batch_size * seq * stack.hidden_size
        elif job.checkpointing in OP_LEVEL_CHECKPOINTING:
            policy = (act.block_matmul_outputs if job.checkpointing == "selective"
                      else act.block_op_sac_outputs)
            kept = policy(stack, act.BlockShape(job.batch_size, seq, encoder_seq), dt,
                          attention=attention_impl(job, arch), adapters=adapters)
            if job.compiles_blocks:  # the partitioner drops what backward never reads: the MLP's
                # output projection only feeds the residual sum
                unread = {f"{name} out" for name in act.linear_names(stack, "mlp_out")}
                kept = [(name, b) for name, b in kept if name not in unread]
            # what selective keeps is a subset of what the block saves, and backward
            # recomputes only the rest of one block
            kept_bytes = min(sum(b for _, b in kept), block)
            total += stack.num_layers * kept_bytes
            recomputed = max(recomputed, block - kept_bytes)
        elif job.checkpointing == "selective:every-2nd-layer":
            # blocks 1, 3, 5, ... (from 0) are fully checkpointed, the others keep everything
            checkpointed = stack.num_layers // 2
            block_input = dt.residual * job.batch_size * seq * stack.hidden_size
            total += checkpointed * block_input + (stack.num_layers - checkpointed) * block
        else:
            total += stack.num_layers * block
    if job.checkpointing in OP_LEVEL_CHECKPOINTING \
            and not job.activation_offload:
        return total, recomputed
    return total, largest


def hidden_wide_activations(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes,
                            task: str, stage: pipeline.Stage = pipeline.WHOLE
                            ) -> tuple[float, float]:
    """The residual-stream-wide part (activations.HIDDEN_WIDE) of what the blocks keep
    (after checkpointing none or full, for the stage's blocks and micro-batches in flight,
    with the embedding's dropout mask, the final norm and the head's input where the stage
    holds them) and of the largest block: what tensor parallelism without sequence
    parallelism keeps whole on every rank."""
    b, c = job.batch_size, dt.compute
    layers, largest, largest_block = 0.0, 0.0, -1.0
    adapters = _adapters(job, arch)
    for stack, seq in zip(arch.stacks, shapes.stack_seq):
        encoder_seq = shapes.stack_seq[0] if stack.cross_attention else 0
        saved = _block_saved(job, arch, stack, seq, encoder_seq, dt, adapters)
        wide, block = act.hidden_wide_bytes(saved), sum(n for _, n in saved)
        if block > largest_block:  # stack_activations' largest block, and its wide part
            largest_block, largest = block, wide
        block_input = dt.residual * b * seq * stack.hidden_size
        layers += stack.num_layers * (block_input if job.checkpointing == "full" else wide)
    layers *= stage.layer_share * stage.in_flight
    embedding = (sum(b * s * st.hidden_size for st, s in zip(arch.stacks, shapes.stack_seq))
                 if arch.hidden_dropout > 0 else 0.0)
    n_last = b * shapes.stack_seq[-1] * arch.stacks[-1].hidden_size
    head = _final_norm_bytes(arch, dt) * n_last + (
        c * n_last if task in HEAD_INPUT_TASKS and job.peft is None else 0.0)
    if stage is pipeline.WHOLE:
        return layers + embedding + head, largest
    return (layers + (embedding * stage.in_flight if stage.embedding else 0.0)
            + (head * stage.head_in_flight if stage.head else 0.0)), largest


# tasks whose head is a trained linear over the last hidden states (its input is saved)
HEAD_INPUT_TASKS = ("causal-lm", "masked-lm", "seq2seq", "speech-seq2seq")


def _final_norm_bytes(arch: Architecture, dt: Dtypes) -> int:
    """Bytes per element the final norm saves."""
    rms = arch.stacks[-1].norm == "rmsnorm"
    return (8 if rms else 4) if dt.autocast or dt.residual == 4 else 6


def outside_block_activations(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes,
                              task: str, stage: pipeline.Stage = pipeline.WHOLE) -> float:
    """Embeddings, final norm, task head input, vision/audio frontends (of a pipeline
    stage: the embedding's on the first, for each micro-batch in flight; the rest on the
    last)."""
    b, c = job.batch_size, dt.compute
    if arch.kind == "cnn":
        size = job.image_size or arch.image_size
        return sum(ch * (size // stride) ** 2 for ch, stride in arch.feature_maps) * b * c
    first = 0.0
    if arch.hidden_dropout > 0:  # the embeddings' dropout mask
        first = sum(b * s * st.hidden_size for st, s in zip(arch.stacks, shapes.stack_seq))
    if stage is not pipeline.WHOLE:
        return (first * stage.in_flight if stage.embedding else 0.0) + (
            (outside_block_activations(job, arch, shapes, dt, task) - first)
            * stage.head_in_flight if stage.head else 0.0)
    total = first
    last = arch.stacks[-1]
    n_last = b * shapes.stack_seq[-1] * last.hidden_size
    norm_bytes = _final_norm_bytes(arch, dt)
    total += norm_bytes * n_last  # final norm
    total += sum(b for _, b in act.encoder_decoder_outside(
        arch.stacks, shapes.stack_seq, b, dt, attention=attention_impl(job, arch),
        checkpointing=job.checkpointing, adapters=adapters_of(job), final_norm_bytes=norm_bytes,
        relative_bias=arch.traits.trained_attention_bias, hidden_dropout=arch.hidden_dropout))
    # a frozen head needs no input saved; Liger's fused loss keeps its gradient instead
    head_trains = job.peft is None and job.loss != "chunked:liger"
    if task in HEAD_INPUT_TASKS and head_trains:
        total += c * n_last  # the LM head's (cast) input
    if task == "masked-lm":
        total += (2 * c + 4) * n_last  # MLM transform: dense, gelu, LayerNorm
    first = arch.stacks[0]
    if first.sequence == "audio":
        frames = arch.max_source_positions
        # conv1 input cast, gelu(conv1) in/out, gelu(conv2) input (Whisper encoder frontend)
        total += c * b * (arch.num_mel_bins * frames + 2.5 * first.hidden_size * frames)
    if first.sequence == "patches":
        total += c * b * shapes.stack_seq[0] * first.hidden_size  # patch embeddings + CLS
    return total


# Reserved but unallocated memory at the peak, as a share of the step's transient memory


# torchtune's OffloadActivations keeps the last max_fwd_stash_size = 5 offloaded tensors on
# the GPU (training/_activation_offloading.py)
TORCHTUNE_OFFLOAD_STASH = 5


def offloaded_activations(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes,
                          task: str, stage: pipeline.Stage, layer_acts: float) -> float:
    """Activations left on the GPU at the end of the forward under torchtune's
    OffloadActivations (rules and source in vramplan/training/offload.py): every tensor
    its hooks see goes to the host, and the forward stash keeps only the last
    TORCHTUNE_OFFLOAD_STASH packed, which are the final norm's (an RMSNorm packs 6, a
    LayerNorm 5), counted with the rest outside the blocks (the head runs under a no-op
    manager). Under checkpointing the hooks see each checkpointed block's input only;
    selective checkpointing keeps the outputs it saves in its own cache, on the GPU.
    With PEFT under checkpointing two block inputs stay (seen in the trace): the embedding
    output, a leaf made to require grad for the checkpointed blocks, which autograd keeps
    alive whatever the hooks do; and the last block's input, as a frozen final norm packs
    no offloaded tensor late enough to push it out of the stash."""
    on_gpu = 0.0
    block_inputs = _block_inputs(job, arch, shapes, dt)
    if job.checkpointing in OP_LEVEL_CHECKPOINTING:
        inputs = sum(st.num_layers * b for st, b in zip(arch.stacks, block_inputs))
        on_gpu = max(0.0, layer_acts - inputs * stage.layer_share * stage.in_flight)
    if job.checkpointing != "none" and job.peft is not None:
        on_gpu += block_inputs[0] + block_inputs[-1]
    return on_gpu + outside_block_activations(job, arch, shapes, dt, task, stage)


def _block_inputs(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes) -> list[float]:
    """Bytes of one block's input (the residual stream), per stack."""
    return [dt.residual * job.batch_size * seq * st.hidden_size
            for st, seq in zip(arch.stacks, shapes.stack_seq)]


def offloaded_bytes(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes) -> float:
    """Bytes OffloadActivations copies to the host in one micro-batch's forward, all blocks,
    and back to the GPU in its backward (rules in vramplan/training/offload.py): under
    checkpointing, what checkpoint saves outside its own hooks, each checkpointed block's
    input (selective checkpointing's cache stays on the GPU); a block that is not
    checkpointed hands over all it saves, and in eager mode each linear's 16-bit weight that
    its matmul keeps for the input's gradient (neither a parameter nor a buffer; a 4-bit
    base's matmul keeps its weight outside saved tensors)."""
    if not arch.stacks:
        return 0.0
    inputs = _block_inputs(job, arch, shapes, dt)
    if job.checkpointing in ("full", *OP_LEVEL_CHECKPOINTING):
        return sum(st.num_layers * b for st, b in zip(arch.stacks, inputs))
    saved, _ = stack_activations(job, arch, shapes, dt)
    if job.compiles_blocks or (job.peft and job.peft.method == "qlora"):
        return saved
    every_2nd = job.checkpointing == "selective:every-2nd-layer"
    weights = sum((st.num_layers - (st.num_layers // 2 if every_2nd else 0))
                  * ln.in_features * ln.out_features * ln.count
                  for st in arch.stacks for ln in st.linears)
    return saved + dt.compute * weights
