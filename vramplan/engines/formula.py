"""Formula engine: closed-form memory of a training step, from the architecture alone.

No torch: it answers in well under a millisecond for any model size. Every figure is per
GPU. The step is modelled as three phases and the peak is the largest of them:

  forward   weights + optimizer states + (grads kept across micro-steps) + activations
            + 16-bit weight copies (autocast) + logits and loss buffers
  backward  at its start, the same plus the loss gradient buffers; with checkpointing,
            while one block is recomputed; at its end, all grads
  optimizer weights + states + grads + the step's temporaries
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.engines import activations as act
from vramplan.engines import optimizer_states as opt_states
from vramplan.engines import pipeline
from vramplan.engines.precision import (
    NF4_BYTES_PER_PARAM,
    NF4_DOUBLE_QUANT_BYTES_PER_PARAM,
    STATE_COPIES,
    Dtypes,
    adapter_bytes,
    dtypes_for,
    eight_bit_state_bytes,
    frozen_base_bytes,
    optimizer_step_temp_copies,
)
from vramplan.engines.report import CATEGORIES, MemoryReport
from vramplan.engines.runtime import (
    check_precision_supported,
    fit_table,
    runtime_context_bytes,
    workspaces_bytes,
)
from vramplan.errors import EngineError, JobError
from vramplan.hardware import get_gpu, list_gpus
from vramplan.hardware.gpu import GPU
from vramplan.job import CHUNKED_LOSS_CHUNKS, Job
from vramplan.models import Architecture, Stack, architecture_from_config, load_architecture
from vramplan.models.families import (
    EAGER_IN_TRANSFORMERS,
    EAGER_ONLY,
    PEFT_EXPERT_TARGETS,
    SDPA_QUERY_CONTIGUOUS,
    STACKED_EXPERTS,
    TRAINED_ATTENTION_BIAS,
    prequantized,
    text_len,
    uses_rotary,
)
from vramplan.units import format_bytes

# DeepSpeed's default reduce/allreduce bucket (reduce_bucket_size = 5e8 elements).
ZERO_BUCKET_ELEMENTS = 500_000_000
# FSDP keeps the current block gathered and prefetches the next (forward and backward).
FSDP_GATHERED_BLOCKS = 2
# transformers' config defaults, for configs that leave the activation out
DEFAULT_ACTIVATION = {"gpt2": "gelu_new", "t5": "relu", "gemma2": "gelu_pytorch_tanh",
                      "gemma3_text": "gelu_pytorch_tanh"}
# Families whose eager attention computes the softmax in fp32 (softmax(..., dtype=float32))
UPCAST_SOFTMAX = ("llama", "mistral", "mixtral", "qwen2", "gemma2", "phi3", "qwen3",
                  "qwen3_moe", "olmo2", "gemma3_text")
CLASSIFIER_TASKS = ("seq-classification", "image-classification")
# Param-sized temporaries of a per-parameter optimizer step (loop implementation), seen in
# the trace: torch's _single_tensor_adam makes exp_avg_sq.sqrt() and its division by the
# bias correction (the eps add and addcdiv_ are in place); Lion its update direction;
# Adafactor one update; SGD (with or without momentum) and the 8-bit stand-ins update in
# place (torch's foreach SGD too)
LOOP_STEP_COPIES = {"adam": 2, "adamw": 2, "lion": 1, "adafactor": 1}


@dataclass(frozen=True)
class Shapes:
    """Token counts the job feeds through each stack, and what the loss sees."""

    stack_seq: tuple[int, ...]   # sequence length per stack, in arch.stacks order
    loss_tokens: int             # positions scored against the vocabulary, per micro-batch
    input_bytes: int             # the micro-batch as the data loader hands it over
    tokens_per_sample: int       # for throughput: text tokens (or 1 for images)
    notes: tuple[str, ...] = ()
    # the labels in input_bytes: the loss reads them in forward and the batch is then
    # dropped, so backward holds only the inputs the model saved (ids, pixels, features)
    label_bytes: int = 0


@dataclass(frozen=True)
class ParamMemory:
    """Parameter-derived memory for the whole model, before any sharding."""

    total: int                # parameters of the model with its task head
    trainable: int
    weights: float            # bytes as stored
    gradients: float          # bytes of gradients of trainable params
    optimizer: float          # bytes of optimizer state
    cast_copies: float        # 16-bit (or fp8) copies of block weights autocast keeps fwd -> bwd
    step_temp: float          # temporaries of optimizer.step()
    largest_block: float      # bytes of the largest block's weights as stored
    cast_head: float = 0.0    # the same for weights outside blocks (LM head), or QLoRA's
    #                           one dequantised weight
    # a tied embedding's two gradients (head and lookup) and their sum, before the sum
    # reaches AccumulateGrad, beyond the gradients already counted
    tied_grad_transient: float = 0.0
    outside_blocks: float = 0.0  # bytes as stored of weights outside the blocks (FSDP's root)
    notes: tuple[str, ...] = ()
    # FSDP float8 all-gather: the largest block as FSDP2 gathers it (0: in param dtype)
    fp8_gathered_block: float = 0.0


def estimate(job: Job, *, gpus: list[GPU] | None = None,
             model_config: dict | None = None) -> MemoryReport:
    """Peak memory per GPU of one training step of `job`, by closed-form formulas.

    >>> from vramplan import Job, estimate
    >>> report = estimate(Job(model="llama-3.2-1b", batch_size=2, seq_len=1024))
    >>> report.peak_allocated > 0
    True
    """
    # model_config: a Hugging Face config dict used instead of looking up job.model (an
    # uploaded config.json in the web app; the trace and measure engines take it too)
    arch = (architecture_from_config(model_config, job.model) if model_config is not None
            else load_architecture(job.model))
    _prequantized(job, arch)
    task = _task(job, arch)
    if job.compile:
        _check_compiled(job, arch, task)
    shapes = _shapes(job, arch, task)
    runtime_gpu = get_gpu(job.gpu) if job.gpu else None
    if runtime_gpu:
        check_precision_supported(job, runtime_gpu)
    whole = _param_memory(job, arch, task)
    dt = _activation_dtypes(job)
    _check_mxfp8_inputs(job, dt)
    _check_parallel(job, arch)
    _check_context_parallel_split(job, shapes)
    # with pipeline stages, the first (most activations) or the last (the head) is largest
    reports = [_stage_report(job, arch, task, shapes, runtime_gpu, whole, dt, stage)
               for stage in pipeline.stages(job, arch)]
    report = max(reports, key=lambda r: r.device_total)
    catalog = gpus if gpus is not None else ([runtime_gpu] if runtime_gpu else list_gpus())
    return report.model_copy(update={"fits": fit_table(report, job.runtime, catalog,
                                                       runtime_gpu)})


def _stage_report(job: Job, arch: Architecture, task: str, shapes: Shapes,
                  runtime_gpu: GPU | None, whole: ParamMemory, dt: Dtypes,
                  stage: pipeline.Stage) -> MemoryReport:
    """The report of one pipeline stage (the whole model without a pipeline)."""
    params = _stage_params(job, arch, task, whole, stage)
    tp, cp = job.parallel.tensor_parallel, job.parallel.context_parallel
    layer_acts, block_acts = _stack_activations(job, arch, shapes, dt)
    layer_acts *= stage.layer_share * stage.in_flight
    activations = (layer_acts + _outside_block_activations(job, arch, shapes, dt, task, stage)
                   ) / (tp * cp)
    if job.activation_offload and arch.stacks:  # (a CNN has no blocks to offload)
        activations = _offloaded_activations(job, arch, shapes, dt, task, stage,
                                             layer_acts) / (tp * cp)
    logits_fwd, logits_bwd = (_loss_buffers(job, arch, shapes, dt, task) if stage.head
                              else (0.0, 0.0))

    w, g, o, cast, gathered, root_gathered, comm, notes = _per_gpu_params(job, params)
    if stage is not pipeline.WHOLE:
        # a received activation and the gradient sent back: the stages' p2p buffers
        comm += 2 * job.batch_size * shapes.stack_seq[-1] * _hidden(arch) * dt.compute / (
            tp * cp)
        notes.append(f"pipeline stage {stage.name} of {job.parallel.pipeline_parallel} "
                     f"({job.parallel.pipeline_schedule}): "
                     f"{pipeline.blocks_per_stage(job, arch)} blocks, activations of "
                     f"{stage.in_flight:g} micro-batch{'' if stage.in_flight == 1 else 'es'}"
                     " in flight"
                     + (", the embedding" if stage.embedding else ", the head and the loss"))
    ws = workspaces_bytes(job.runtime, runtime_gpu)
    inputs = shapes.input_bytes / cp
    keeps_grads = job.keep_grads_between_steps and not job.optimizer_in_backward
    g_kept = g if job.grad_accum > 1 or keeps_grads else 0.0
    step_temp = params.step_temp / (tp * job.parallel.shard_degree)
    if job.optimizer_in_backward:
        g = min(g, params.largest_block / (tp * job.parallel.shard_degree))
        # one parameter is stepped at a time: no buffer spans all parameters
        step_temp = min(step_temp, _largest_trainable_bytes(job, arch, task) / tp)
    if job.offload.optimizer:
        step_temp = 0.0  # the step runs on the CPU, next to the offloaded states
    unified = (_unified_state_bytes(job, arch, task) / (tp * job.parallel.shard_degree)
               * params.trainable / max(whole.trainable, 1))  # a pipeline stage's share

    recompute = dict(activations=0.0, cast=0.0)
    layers = sum(st.num_layers for st in arch.stacks) * stage.layer_share  # on this GPU
    cast_fwd = cast  # autocast's cache keeps every copy until the forward ends
    if job.checkpointing != "none" and layers:
        # saved tensors of checkpointed blocks hold no weight copies, so those copies go
        # when the forward ends; during backward one block at a time is recomputed, with
        # its activations and weight copies
        block_cast = max(0.0, cast - params.cast_head / tp)
        cast -= block_cast * _checkpointed_share(job, arch)
        recompute = dict(activations=block_acts / (tp * cp), cast=block_cast / layers)
        if job.compiles_blocks:  # a compiled block casts its weights in its graph: no cache
            cast_fwd = cast

    saved_inputs = (shapes.input_bytes - shapes.label_bytes) / cp  # what backward still holds
    base = dict(weights=w, optimizer_states=o, inputs=saved_inputs)
    phases = {
        "forward": dict(base, inputs=inputs, gradients=g_kept, activations=activations,
                        temporary=cast_fwd + logits_fwd + gathered + comm + ws),
        "backward": dict(base, gradients=g_kept, activations=activations,
                         temporary=cast + logits_bwd + gathered + comm + ws),
        # FSDP2 gathers the root again as backward starts (the blocks are resharded): its
        # all-gather output and the unsharded parameters it is copied into are live together
        "backward_gather": dict(base, gradients=g_kept, activations=activations,
                                temporary=cast + logits_fwd + 2 * root_gathered + comm + ws),
        "backward_recompute": dict(base, gradients=g_kept, activations=activations
                                   + recompute["activations"],
                                   temporary=cast + recompute["cast"] + gathered + comm + ws),
        # the last gradients are made by the first layer's backward, which still holds the
        # batch it saved (a patch conv's pixels, an embedding's ids)
        "backward_end": dict(base, gradients=g, activations=0.0,
                             temporary=gathered + comm + ws + params.tied_grad_transient / tp),
        "optimizer": dict(base, inputs=0.0, gradients=g, activations=0.0,
                          temporary=step_temp + comm + ws),
    }
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_name = max(totals, key=totals.get)
    at_peak = {k: int(round(v)) for k, v in phases[peak_name].items()}
    allocated = sum(at_peak.values())
    # reserved memory is the most the allocator held at any phase, not only at the peak
    reserved = max(totals[name] + _allocator_overhead(job, arch, name, totals[name], parts)
                   for name, parts in phases.items())
    at_peak["allocator_overhead"] = max(0, int(reserved) - allocated)  # whole bytes, down
    at_peak["runtime_context"] = runtime_context_bytes(job.runtime, runtime_gpu)
    phase_peaks = {"forward": totals["forward"],
                   "backward": max(totals["backward"], totals["backward_recompute"],
                                   totals["backward_end"], totals["backward_gather"]),
                   "optimizer": totals["optimizer"]}

    report = MemoryReport(
        engine="formula", job=job, model_name=arch.name,
        params_total=whole.total, params_trainable=whole.trainable,
        per_gpu_of=job.parallel.num_gpus,
        categories={c: at_peak[c] for c in CATEGORIES},
        phase_peaks={k: int(round(v)) for k, v in phase_peaks.items()},
        peak_phase=peak_name.split("_")[0],
        runtime_gpu=runtime_gpu.name if runtime_gpu else None,
        tokens_per_step=shapes.tokens_per_sample * job.effective_batch,
        notes=[*shapes.notes, *params.notes, *notes, *_technique_notes(job, arch),
               *_framework_notes(job, unified)],
        unified_memory_bytes=int(round(unified)),
    )
    return report


def _stage_params(job: Job, arch: Architecture, task: str, whole: ParamMemory,
                  stage: pipeline.Stage) -> ParamMemory:
    """The parameter memory a pipeline stage holds: its share of the blocks and its part
    of what lies outside them (engines/pipeline.py)."""
    if stage is pipeline.WHOLE:
        return whole
    from dataclasses import replace

    in_blocks = sum(s.num_layers * s.params_per_layer for s in arch.stacks)
    outside = whole.total - in_blocks
    here = pipeline.outside_params(arch, task, stage)
    outside_bytes = whole.outside_blocks * here / outside if outside else 0.0
    weights = stage.layer_share * (whole.weights - whole.outside_blocks) + outside_bytes
    if job.peft is None:
        trained = (stage.layer_share * in_blocks + here) / whole.total
    else:  # adapters sit in the blocks; a classifier head trains on the last stage
        head = arch.head_params[task] if task in CLASSIFIER_TASKS else 0
        trained = (stage.layer_share * (whole.trainable - head)
                   + (head if stage.head else 0)) / max(whole.trainable, 1)
    qlora = job.peft is not None and job.peft.method == "qlora"
    return replace(
        whole, total=round(stage.layer_share * in_blocks + here),
        trainable=round(whole.trainable * trained), weights=weights,
        gradients=whole.gradients * trained, optimizer=whole.optimizer * trained,
        step_temp=whole.step_temp * trained,
        cast_copies=whole.cast_copies * stage.layer_share,
        # the head's 16-bit copy lives with the head; QLoRA's is one dequantised weight
        cast_head=whole.cast_head if (stage.head or qlora) else 0.0,
        tied_grad_transient=whole.tied_grad_transient if stage.head else 0.0,
        outside_blocks=outside_bytes)


# --- the job's shape --------------------------------------------------------------------


def _task(job: Job, arch: Architecture) -> str:
    task = job.task or arch.default_task
    if task not in arch.head_params:
        raise JobError(f"{arch.name} does not support task {task!r}; it supports: "
                       f"{', '.join(arch.tasks)}")
    return task


def _check_inputs(job: Job, arch: Architecture) -> None:
    """A flag for another kind of input (--image-size on a text model) would be silently
    ignored: refuse it, naming what the model reads."""
    vision = arch.kind == "cnn" or bool(arch.stacks and arch.stacks[0].sequence == "patches")
    audio = bool(arch.stacks and arch.stacks[0].sequence == "audio")
    reads = "images (image_size)" if vision else "audio (audio_seconds, target_len)" if audio \
        else "text (seq_len, target_len)" if arch.kind == "encoder-decoder" else "text (seq_len)"
    wrong = [name for name, given, applies in (
        ("image_size", job.image_size, vision), ("audio_seconds", job.audio_seconds, audio),
        ("seq_len", job.seq_len, not vision),
        ("target_len", job.target_len, audio or arch.kind == "encoder-decoder"))
        if given is not None and not applies]
    if wrong:
        raise JobError(f"{', '.join(wrong)} does not apply to {arch.name}, which reads "
                       f"{reads}; leave it out")


def _shapes(job: Job, arch: Architecture, task: str) -> Shapes:
    _check_inputs(job, arch)
    b, notes = job.batch_size, []
    if arch.kind == "cnn" or (arch.stacks and arch.stacks[0].sequence == "patches"):
        size = job.image_size or arch.image_size
        if arch.patch_size and size % arch.patch_size:
            raise JobError(f"image_size {size} is not a multiple of {arch.name}'s patch size "
                           f"{arch.patch_size}")
        seq = (size // arch.patch_size) ** 2 + 1 if arch.patch_size else 0
        pixels = _float_bytes(job) * b * arch.num_channels * size * size  # pixel_values
        return Shapes(tuple(seq for _ in arch.stacks), 0, pixels + 8 * b, 1, label_bytes=8 * b)

    seq = _text_len(job.seq_len, arch, "seq_len", notes)
    if arch.stacks[0].sequence == "audio":
        frames = arch.max_source_positions  # Whisper pads every clip to 30 s (3000 frames)
        if job.audio_seconds and job.audio_seconds > frames / 100:
            raise JobError(f"{arch.name} accepts at most {frames / 100:g} s of audio "
                           f"(got audio_seconds={job.audio_seconds:g})")
        if job.audio_seconds and job.audio_seconds < frames / 100:
            notes.append(f"{arch.name} pads every clip to {frames / 100:g} s: memory is that "
                         "of a full-length clip")
        target = _text_len(job.target_len or job.seq_len, arch, "target_len", notes)
        features = _float_bytes(job) * b * arch.num_mel_bins * frames
        # input_features, then labels and decoder_input_ids (int64)
        return Shapes((frames // 2, target), b * target,
                      features + 16 * b * target, target, tuple(notes), label_bytes=8 * b * target)
    if arch.kind == "encoder-decoder":
        target = job.target_len or seq
        # input_ids (encoder), labels + decoder_input_ids (decoder), int64; no attention
        # mask: the synthetic batch has no padding, as a packed data loader's
        return Shapes((seq, target), b * target, 8 * b * seq + 16 * b * target, seq + target,
                      tuple(notes), label_bytes=8 * b * target)
    scored = b * seq if task in ("causal-lm", "masked-lm") else 0
    labels = 8 * b * seq if scored else 8 * b  # a label per token, or one per sample
    # input_ids and labels, int64 (no attention mask, as above)
    return Shapes(tuple(seq for _ in arch.stacks), scored, 8 * b * seq + labels, seq,
                  tuple(notes), label_bytes=labels)


def _float_bytes(job: Job) -> int:
    """Pixels and audio features as the data loader hands them over: bf16 when the whole
    model is, else fp32 (autocast casts them inside the model)."""
    return 2 if job.precision == "bf16-pure" else 4


def _text_len(requested: int | None, arch: Architecture, field: str, notes: list[str]) -> int:
    return text_len(requested, arch.max_positions, arch.model_type, arch.name, field, notes)


# --- parameters, gradients, optimizer state ---------------------------------------------


def _param_memory(job: Job, arch: Architecture, task: str) -> ParamMemory:
    dt = dtypes_for(job)
    total = arch.total_params(task)
    linear_params = sum(s.num_layers * sum(ln.in_features * ln.out_features * ln.count
                                           for ln in s.linears) for s in arch.stacks)
    head = arch.head_params[task]
    matmul_params = linear_params + (head or (arch.vocab_size * _hidden(arch)
                                              if task in ("causal-lm", "masked-lm") else 0))
    notes = []
    if job.peft is None:
        trainable, weights = total, total * dt.weight
        # fp8 (torchao Float8Linear) saves the fp32 weight itself: no copy of block weights
        cast = linear_params * (dt.linear_saved if dt.autocast and job.precision != "fp8" else 0)
        cast_head = (matmul_params - linear_params) * (dt.linear_saved if dt.autocast else 0)
        if dt.autocast:
            notes.append("autocast keeps a 16-bit copy of every matmul weight from forward "
                         "to backward (counted in temporary)")
        block_bytes = max((s.params_per_layer for s in arch.stacks), default=0) * dt.weight
        largest = max(_largest_tensor(arch), 1)
    else:
        adapters = _adapter_params(job, arch)
        # a new classifier head trains beside the adapters (peft's modules_to_save);
        # a language-model head stays frozen
        head = head if task in CLASSIFIER_TASKS else 0
        trainable = adapters + head
        frozen = total - head
        base = frozen_base_bytes(job)
        cast = cast_head = 0.0
        if job.peft.method == "qlora":
            per = (NF4_DOUBLE_QUANT_BYTES_PER_PARAM if job.peft.double_quant
                   else NF4_BYTES_PER_PARAM)
            nf4 = sum(s.num_layers * _nf4_params(arch, s) for s in arch.stacks)
            weights = nf4 * per + (frozen - nf4) * base
            # bitsandbytes dequantises one weight at a time to 16-bit for its matmul
            cast_head = max((ln.in_features * ln.out_features for s in arch.stacks
                        for ln in s.linears), default=0) * 2
            notes.append("QLoRA: block linears in 4-bit NF4, the rest in 16-bit; "
                         "prepare_model_for_kbit_training would upcast the rest to fp32")
            if job.checkpointing == "none" and "checkpointing" not in job.model_fields_set:
                notes.append("QLoRA without checkpointing: peft's prepare_model_for_kbit_"
                             "training (peft 0.21.2, use_gradient_checkpointing=True) turns "
                             "full checkpointing on by default; if you call it, add "
                             "--checkpointing full (--framework hf-trainer does)")
        else:
            weights = frozen * base
        weights += adapters * adapter_bytes(job) + head * dt.weight
        block_bytes = max((_block_base_bytes(job, arch, s, base) for s in arch.stacks), default=0)
        # the largest trained tensor: an adapter matrix (or the classifier head)
        largest = max((n for n, _ in _trainable_tensors(job, arch, task)), default=1)
        dt = Dtypes(adapter_bytes(job), adapter_bytes(job), dt.compute, dt.residual,
                    dt.autocast, dt.linear_saved)
    grads = trainable * dt.grad
    if job.optimizer in opt_states.PER_TENSOR_OPTIMIZERS:
        optimizer, _ = opt_states.split_state_bytes(
            job.optimizer, _trainable_tensors(job, arch, task), dt.weight)
    else:
        optimizer = _optimizer_bytes(job, arch, trainable, dt.weight)
    step_temp = optimizer_step_temp_copies(job) * trainable * dt.weight
    if job.optimizer_impl == "loop" or job.optimizer == "lion":
        # one param's update at a time: its temporaries, in copies of the largest param
        step_temp = max(step_temp, LOOP_STEP_COPIES.get(job.optimizer, 0) * largest * dt.weight)
    # autograd sums the head's and the lookup's gradients out of place (add): both and
    # their sum are live at once, before the sum becomes .grad; when micro-steps
    # accumulate, the .grad (counted in gradients) is already there, so one more
    tied_copies = 3 if job.grad_accum > 1 else 2
    tied = (tied_copies * arch.vocab_size * _hidden(arch) * dt.grad
            if job.peft is None and arch.tied_embeddings else 0.0)
    in_blocks = sum(s.num_layers * s.params_per_layer for s in arch.stacks)
    outside = (total - in_blocks) * (dt.weight if job.peft is None else frozen_base_bytes(job))
    return ParamMemory(total, trainable, weights, grads, optimizer, cast, step_temp,
                       block_bytes, cast_head, tied, outside_blocks=outside, notes=tuple(notes),
                       fp8_gathered_block=_fp8_gathered_block(job, arch))


def _fp8_gathered_block(job: Job, arch: Architecture) -> float:
    """The largest block as FSDP2 gathers it with torchao's float8 all-gather: each
    Float8Linear weight's fsdp_pre_all_gather casts its shard to float8 and the gathered
    float8 data (and one scalar scale) is the unsharded weight, with no 16-bit copy
    (torchao/float8/fsdp_utils.py, WeightWithDynamicFloat8CastTensor); the block's other
    parameters (norms) gather in the 16-bit param dtype. 0 when the option is off."""
    if job.precision != "fp8" or not job.fp8.fsdp_float8_all_gather:
        return 0.0
    return max((2 * s.params_per_layer - sum(ln.in_features * ln.out_features * ln.count
                                             for ln in s.linears) for s in arch.stacks),
               default=0)


def _block_base_bytes(job: Job, arch: Architecture, stack: Stack, base: int) -> float:
    """One block of a PEFT base as stored: QLoRA keeps its linears' weights in NF4."""
    if job.peft is None or job.peft.method != "qlora":
        return stack.params_per_layer * base
    per = NF4_DOUBLE_QUANT_BYTES_PER_PARAM if job.peft.double_quant else NF4_BYTES_PER_PARAM
    weights = _nf4_params(arch, stack)
    return weights * per + (stack.params_per_layer - weights) * base


def _nf4_params(arch: Architecture, stack: Stack) -> int:
    """Weights of one block that QLoRA stores in NF4: its nn.Linear weights (not stacked
    experts, families.STACKED_EXPERTS)."""
    stacked = arch.model_type in STACKED_EXPERTS
    return sum(ln.in_features * ln.out_features * ln.count for ln in stack.linears
               if not (stacked and ln.count > 1))


def _hidden(arch: Architecture) -> int:
    return arch.stacks[-1].hidden_size if arch.stacks else 0


def _largest_tensor(arch: Architecture) -> int:
    embedding = arch.vocab_size * _hidden(arch)
    if arch.patch_size and arch.stacks:  # a ViT's patch convolution, hidden x c x p x p
        embedding = max(embedding, arch.stacks[0].hidden_size * arch.num_channels
                        * arch.patch_size ** 2)
    linear = max((ln.in_features * ln.out_features for s in arch.stacks for ln in s.linears),
                 default=0)
    return max(embedding, linear)


def _adapter_params(job: Job, arch: Architecture) -> int:
    targets = set(job.peft.target_modules)
    on_experts = targets & PEFT_EXPERT_TARGETS.get(arch.model_type, frozenset())
    if on_experts:
        raise JobError(f"LoRA target_modules {sorted(on_experts)}: on {arch.model_type} peft "
                       "puts these adapters on the routed experts' stacked parameters and the "
                       "router, which the formula does not model; target the attention "
                       "projections (q_a_proj, q_b_proj, q_proj, kv_a_proj_with_mqa, kv_b_proj, "
                       "o_proj), or use --engine trace")
    names = {ln.name for s in arch.stacks for ln in s.linears}
    if "all-linear" not in targets and not targets & names:
        raise JobError(f"LoRA target_modules {sorted(targets)} match no linear layer of "
                       f"{arch.name}; its block linears are: {', '.join(sorted(names))} "
                       "(or use all-linear)")
    r = job.peft.rank
    return sum(s.num_layers * ln.count * r * (ln.in_features + ln.out_features)
               for s in arch.stacks for ln in s.linears
               if "all-linear" in targets or ln.name in targets)


def _optimizer_bytes(job: Job, arch: Architecture, trainable: int, state_bytes: int) -> float:
    if job.optimizer in ("adamw-8bit", "paged-adamw-8bit"):
        return eight_bit_state_bytes(trainable)
    if job.optimizer == "adafactor":
        return _adafactor_bytes(job, arch, trainable, state_bytes)
    return STATE_COPIES[job.optimizer] * trainable * state_bytes


def _adafactor_bytes(job: Job, arch: Architecture, trainable: int, state_bytes: int) -> float:
    """Factored second moment: a row and a column vector per matrix (Shazeer & Stern 2018)."""
    if job.peft is not None:
        r = job.peft.rank
        return sum(s.num_layers * ln.count * 2 * (r + ln.in_features + r + ln.out_features)
                   for s in arch.stacks for ln in s.linears) * state_bytes
    shapes = [(ln.in_features, ln.out_features, s.num_layers * ln.count)
              for s in arch.stacks for ln in s.linears]
    if arch.vocab_size:  # the token embedding (and an untied head) are matrices too
        copies = 1 if arch.tied_embeddings else 2
        shapes.append((arch.vocab_size, _hidden(arch), copies))
    matrices = sum(rows * cols * n for rows, cols, n in shapes)
    factored = sum((rows + cols) * n for rows, cols, n in shapes)
    if arch.patch_size and arch.stacks:
        # a ViT's other tensors of 2+ dims: torch's Adafactor keeps a row factor of
        # prod(shape[:-1]) and a column factor of prod(shape[:-2]) * shape[-1]. The patch
        # conv [h, c, p, p], the position embeddings [1, seq, h], the CLS token [1, 1, h]
        # and the classifier [labels, h]
        h, p = arch.stacks[0].hidden_size, arch.patch_size
        seq = ((job.image_size or arch.image_size) // p) ** 2 + 1
        conv = h * arch.num_channels * p
        labels = arch.num_labels if job.task in (None, "image-classification") else 0
        matrices += conv * p + seq * h + h + labels * h
        factored += 2 * conv + (seq + h) + (1 + h) + (labels + h if labels else 0)
    return (factored + (trainable - matrices)) * state_bytes


def _per_gpu_params(job: Job, params: ParamMemory):
    """Shard parameter memory over tensor-parallel and ZeRO/FSDP ranks; add their buffers."""
    par, notes = job.parallel, []
    tp, shard, strategy = par.tensor_parallel, par.shard_degree, par.strategy
    sharded_params = strategy in ("zero3", "fsdp", "hybrid-shard")
    w = params.weights / tp / (shard if sharded_params else 1)
    g = params.gradients / tp / (shard if strategy != "zero1" else 1)
    o = params.optimizer / tp / shard
    cast, gathered, root, comm = (params.cast_copies + params.cast_head) / tp, 0.0, 0.0, 0.0
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
        cast = 0.0
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
    return w, g, o, cast, gathered, root, comm, notes


# --- activations and loss ---------------------------------------------------------------


def _activation_dtypes(job: Job) -> Dtypes:
    """The dtypes activations see: a 16-bit base (PEFT, FSDP mixed precision) keeps the
    residual stream in 16-bit even under autocast."""
    dt = dtypes_for(job)
    sixteen_bit_base = job.peft is not None or job.parallel.strategy in (
        "zero3", "fsdp", "hybrid-shard")
    if dt.autocast and sixteen_bit_base:
        return Dtypes(dt.weight, dt.grad, dt.compute, residual=2, autocast=True,
                      linear_saved=dt.linear_saved)
    return dt


def _adapters(job: Job) -> act.Adapters:
    if job.peft is None:
        return act.Adapters()
    dt = dtypes_for(job)
    upcast = adapter_bytes(job) if not dt.autocast and adapter_bytes(job) > dt.compute else 0
    return act.Adapters(frozenset(job.peft.target_modules), job.peft.rank, job.peft.dropout,
                        base_trainable=False, upcast_bytes=upcast)


def _stack_activations(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes):
    """Saved activations of all blocks (after checkpointing), and of the largest block
    (what checkpointing recomputes at a time: the whole block, or under selective
    checkpointing what it does not keep)."""
    total, largest, recomputed = 0.0, 0.0, 0.0
    adapters = _adapters(job)
    if job.peft and "all-linear" in job.peft.target_modules:
        adapters = act.Adapters(frozenset(ln.name for s in arch.stacks for ln in s.linears),
                                adapters.rank, adapters.dropout, False, adapters.upcast_bytes)
    for stack, seq in zip(arch.stacks, shapes.stack_seq):
        encoder_seq = shapes.stack_seq[0] if stack.cross_attention else 0
        saved = act.compiled_block_saved_tensors(
            stack, act.BlockShape(job.batch_size, seq), dt, adapters,
            fp32_adapters=dt.autocast and adapter_bytes(job) == 4) if job.compiles_blocks else \
            act.block_saved_tensors(
            stack, act.BlockShape(job.batch_size, seq, encoder_seq), dt,
            attention=_attention_impl(job, arch), hidden_dropout=arch.hidden_dropout,
            attention_dropout=arch.attention_dropout, activation=_activation_name(arch),
            adapters=adapters, norms_per_block=_norms_per_block(arch, stack),
            upcast_softmax=arch.model_type in UPCAST_SOFTMAX,
            score_softcap=bool(arch.extra.get("attn_logit_softcapping")),
            norm_scales_input=arch.model_type == "t5",
            trained_bias=arch.model_type in TRAINED_ATTENTION_BIAS,
            rotary=uses_rotary(arch),
            sdpa_query_contiguous=arch.model_type in SDPA_QUERY_CONTIGUOUS)
        block = sum(b for _, b in saved)
        largest = max(largest, block)
        if job.checkpointing == "full":
            # each block keeps only its input; one block is recomputed at a time in backward
            total += stack.num_layers * dt.residual * job.batch_size * seq * stack.hidden_size
        elif job.checkpointing in ("selective", "selective:torchtitan-op"):
            policy = (act.block_matmul_outputs if job.checkpointing == "selective"
                      else act.block_op_sac_outputs)
            kept = policy(stack, act.BlockShape(job.batch_size, seq, encoder_seq), dt,
                          attention=_attention_impl(job, arch), adapters=adapters)
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
    if job.checkpointing in ("selective", "selective:torchtitan-op") \
            and not job.activation_offload:
        return total, recomputed
    return total, largest


def _attention_impl(job: Job, arch: Architecture) -> str:
    # Gemma-2 soft-caps the scores: transformers runs its attention eagerly whatever the
    # job asks.
    return "eager" if arch.model_type in EAGER_ONLY else job.attention


def _activation_name(arch: Architecture) -> str:
    cfg = arch.extra
    name = (cfg.get("hidden_act") or cfg.get("activation_function")
            or cfg.get("hidden_activation") or cfg.get("feed_forward_proj")
            or DEFAULT_ACTIVATION.get(arch.model_type, "gelu"))
    return name.removeprefix("gated-")


def _norms_per_block(arch: Architecture, stack: Stack) -> int:
    base = 3 if stack.cross_attention else 2
    return base + (2 if arch.model_type in ("gemma2", "gemma3_text") else 0)


def _outside_block_activations(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes,
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
            _outside_block_activations(job, arch, shapes, dt, task) - first
            if stage.head else 0.0)
    total = first
    last = arch.stacks[-1]
    n_last = b * shapes.stack_seq[-1] * last.hidden_size
    norm_bytes = (8 if last.norm == "rmsnorm" else 4) if dt.autocast or dt.residual == 4 else 6
    total += norm_bytes * n_last  # final norm
    total += sum(b for _, b in act.encoder_decoder_outside(
        arch.stacks, shapes.stack_seq, b, dt, attention=_attention_impl(job, arch),
        checkpointing=job.checkpointing, adapters=_adapters(job), final_norm_bytes=norm_bytes,
        relative_bias=arch.model_type in TRAINED_ATTENTION_BIAS,
        hidden_dropout=arch.hidden_dropout))
    head_trains = job.peft is None  # a frozen head needs no input saved
    if task in ("causal-lm", "masked-lm", "seq2seq", "speech-seq2seq") and head_trains:
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
# (activations + temporaries), by checkpointing mode: recomputation frees and reallocates
# blocks of many sizes. Medians of 19 H200 runs (benchmarks/results/gpu_validation.json:
# 6.4%, 13%, 33%) and 29 trace replays (formula_vs_trace.json: 5.7%, 10%, 29%).
ALLOCATOR_OVERHEAD = {"none": 0.06, "selective": 0.12, "full": 0.30}


# Phases in which checkpointing recomputes blocks (and so fragments the cache); the others
# see the allocator as without checkpointing.
RECOMPUTE_PHASES = ("backward", "backward_recompute", "backward_gather")


def _allocator_overhead(job: Job, arch: Architecture, phase: str, allocated: float,
                        parts: dict[str, float]) -> float:
    if job.runtime.allocator_overhead is not None:
        return allocated * job.runtime.allocator_overhead
    # checkpointing is ignored on a model without blocks (ResNet), and outside backward
    # nothing is recomputed: the optimizer step's temporaries fragment no more than usual
    recomputes = bool(arch.stacks) and phase in RECOMPUTE_PHASES
    mode = job.checkpointing.split(":")[0] if recomputes else "none"
    return (parts["activations"] + parts["temporary"]) * ALLOCATOR_OVERHEAD[mode]


def _loss_buffers(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes, task: str):
    """(forward, backward-start) bytes of logits and cross-entropy buffers."""
    t = shapes.loss_tokens / job.parallel.context_parallel
    vocab = arch.vocab_size / job.parallel.tensor_parallel
    if not t or not vocab:
        return 0.0, 0.0
    c, h = dt.compute, _hidden(arch)
    if job.loss.startswith("chunked:torchtune"):
        return _torchtune_loss_buffers(job, t, vocab, h, dt)
    if job.loss == "chunked":
        # training.losses.chunked_causal_lm_loss: each sequence chunk checkpointed, so forward keeps
        # no logits; backward recomputes one chunk's bf16 logits, their fp32 copy and
        # log_softmax, then the nll and log_softmax gradients, beside the hidden states' grad
        tc = t / CHUNKED_LOSS_CHUNKS
        return max(c + 4, 8) * tc * vocab, (c + 12) * tc * vocab + c * t * h
    tv = t * vocab
    if job.compiles_loss:
        # the compiled loss (training/compiled.py compile_loss) fuses the upcast, log_softmax
        # and nll into reductions: forward keeps the logits and two fp32 values per token
        # (max, log-sum-exp); its backward writes the logits' gradient in their dtype
        # while the saved logits are still alive
        return c * tv + 8 * t, 2 * c * tv + 8 * t
    if task == "causal-lm" or not dt.autocast:
        # transformers' causal-LM loss upcasts the logits to fp32 first; other heads without
        # autocast stay in the logits' dtype. Forward: logits (kept by the output), the
        # upcast copy, the log_softmax output (saved); backward: that output plus the dense
        # nll and log_softmax gradients. The logits are dropped with the outputs (HF Trainer).
        loss = 4 if task == "causal-lm" else c
        forward = c * tv + loss * tv + (loss * tv if loss != c else 0)
        backward = 3 * loss * tv
    else:
        # cross_entropy on 16-bit logits under CUDA autocast: log_softmax stays 16-bit and
        # only nll_loss's input is upcast, and both are saved; backward adds the fp32 nll
        # gradient (measured on an H200: benchmarks/results/gpu_runtime_probe.json)
        forward = 2 * c * tv + 4 * tv
        backward = (c + 8) * tv
    if arch.extra.get("final_logit_softcapping"):  # Gemma-2 keeps tanh(logits / cap)
        forward, backward = forward + c * tv, backward + c * tv
    return forward, backward


def _check_compiled(job: Job, arch: Architecture, task: str) -> None:
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
                stack, attention=_attention_impl(job, arch), adapters=_adapters(job),
                dropout=max(arch.hidden_dropout, arch.attention_dropout),
                norms_per_block=_norms_per_block(arch, stack),
                rotary=uses_rotary(arch))
            if reason:
                why.append(reason)
    if why:
        raise JobError(f"the formula models torch.compile for Llama-style blocks (RMSNorm, "
                       f"rotary sdpa attention, gated MLP; full fine-tuning or LoRA) and "
                       f"the causal-LM loss; this job has {'; '.join(why)}: use "
                       "--engine trace, which compiles the real model (or "
                       "compile_components=loss to compile the loss only)")


def _check_parallel(job: Job, arch: Architecture) -> None:
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


def _check_context_parallel_split(job: Job, shapes: Shapes) -> None:
    """torch's context parallelism balances causal attention by cutting the sequence into
    2 x cp chunks (head and tail per rank: _context_parallel/_load_balancer.py), and refuses
    a length that does not divide."""
    cp = job.parallel.context_parallel
    if cp > 1 and shapes.stack_seq and shapes.stack_seq[0] % (2 * cp):
        raise JobError(f"context_parallel={cp} splits the sequence into {2 * cp} equal "
                       f"chunks: seq_len {shapes.stack_seq[0]} is not a multiple of {2 * cp}; "
                       f"use a multiple, e.g. {shapes.stack_seq[0] // (2 * cp) * 2 * cp or 2 * cp}")


def _prequantized(job: Job, arch: Architecture) -> str | None:
    return prequantized(arch.extra, arch.name, job.peft.method if job.peft else None,
                        job.peft.double_quant if job.peft else False)


def _technique_notes(job: Job, arch: Architecture) -> list[str]:
    notes = [*arch.notes, *filter(None, [_prequantized(job, arch)])]
    if arch.shapes_from != "config":
        notes.append(f"{arch.model_type}: the formula has no table entry for this family; its "
                     f"shapes were read from the {arch.shapes_from}")
    if job.attention != "eager" and arch.model_type in EAGER_IN_TRANSFORMERS:
        notes.append(f"{arch.model_type}: {job.attention} attention is modelled, as the "
                     "family's own trainer runs it (llm-foundry: FlashAttention); transformers' "
                     "class has eager attention only, which the trace runs (compare with "
                     "--attention eager)")
    if job.attention == "sdpa" and arch.model_type in EAGER_ONLY:
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
        notes.append(_fp8_note(job))
    if job.activation_offload:
        notes.append("activation offloading (torchtune's OffloadActivations): saved tensors "
                     "wait in pinned host memory, the last 5 (the final norm's) stay on the "
                     "GPU; selective checkpointing's kept outputs are not offloaded")
    if job.checkpointing != "none" and not arch.stacks:
        notes.append(f"{arch.name} has no transformer blocks to checkpoint (transformers does "
                     "not support gradient checkpointing for it): estimated without it")
    return notes


def _fp8_note(job: Job) -> str:
    recipe = job.fp8.recipe
    if recipe == "mxfp8":
        note = ("fp8 recipe mxfp8 (torchao MXFP8Linear): block linears save their 16-bit "
                "input and the weight itself, and cast both to float8 with one e8m0 scale "
                "per 32 values in forward and again in backward (temporaries)")
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


def _check_mxfp8_inputs(job: Job, dt: Dtypes) -> None:
    """torchao's MXFP8Linear does not cast its input to autocast's dtype (Float8Linear
    does): with fp32 weights under autocast its norm-fed linears save fp32 inputs and
    return fp32 outputs, which the block model here does not follow."""
    if job.precision == "fp8" and job.fp8.recipe == "mxfp8" and dt.residual == 4:
        raise EngineError("the formula models fp8 recipe mxfp8 where the linears see 16-bit "
                          "inputs: under FSDP (strategy fsdp or hybrid-shard, bf16 params as "
                          "torchtitan runs it) or with LoRA; on fp32 weights under autocast "
                          "torchao's MXFP8Linear keeps fp32 activations: use --engine trace")


# --- framework behaviours (docs/frameworks.md) ------------------------------------------

# torchtune's chunked losses split the scored tokens into 8 (num_output_chunks = 8)
TORCHTUNE_LOSS_CHUNKS = 8
# torchtune's OffloadActivations keeps the last max_fwd_stash_size = 5 offloaded tensors on
# the GPU (training/_activation_offloading.py)
TORCHTUNE_OFFLOAD_STASH = 5


def _torchtune_loss_buffers(job: Job, t: float, vocab: float, h: int, dt: Dtypes):
    """(forward, backward-start) bytes of torchtune's chunked losses, eager (uncompiled).

    Per chunk both run logits.float() and cross_entropy, whose log_softmax saves its fp32
    output: every chunk's stays until backward (4 bytes x tokens x vocab in all), and the
    last chunk's 16-bit logits and fp32 copy are alive beside them. CEWithChunkedOutputLoss
    also holds all 16-bit logit chunks the model returned until the loss ends. Backward
    starts with one chunk's nll and log_softmax fp32 gradients (the 16-bit one comes after
    the nll gradient is freed).
    A trained output head's gradient is summed over the chunks out of place: when the
    second chunk's arrives, the running sum, that gradient and their sum are three
    head-sized buffers, while 6 of the 8 chunks' log_softmax outputs are still saved
    (seen in the trace of Llama-2-7B and Llama-3.2-1B)."""
    c, tc = dt.compute, t / TORCHTUNE_LOSS_CHUNKS
    if job.compiles_loss:
        # each chunk's compiled cross-entropy saves its 16-bit logits (not an fp32
        # log_softmax) and two fp32 values per token; backward starts with one chunk's
        # gradient beside them
        forward, backward = c * t * vocab + 8 * t, c * t * vocab + c * tc * vocab
        if job.peft is None:
            remaining = c * (TORCHTUNE_LOSS_CHUNKS - 2) * tc * vocab
            backward = max(backward, remaining + 3 * vocab * h * dt.grad)
        return forward, backward
    forward = 4 * t * vocab + (c + 4) * tc * vocab
    if job.loss == "chunked:torchtune-output":
        forward = (c + 4) * t * vocab + 4 * tc * vocab
    backward = 4 * t * vocab + 8 * tc * vocab
    if job.peft is None:
        remaining = 4 * (TORCHTUNE_LOSS_CHUNKS - 2) * tc * vocab
        backward = max(backward, remaining + 3 * vocab * h * dt.grad)
    return forward, backward


def _checkpointed_share(job: Job, arch: Architecture) -> float:
    """Share of the blocks whose saved tensors are recomputed (so hold no weight copies)."""
    if job.checkpointing != "selective:every-2nd-layer":
        return 1.0
    layers = sum(st.num_layers for st in arch.stacks)
    return sum(st.num_layers // 2 for st in arch.stacks) / max(layers, 1)


def _offloaded_activations(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes,
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
    block_inputs = [dt.residual * job.batch_size * seq * st.hidden_size
                    for st, seq in zip(arch.stacks, shapes.stack_seq)]
    if job.checkpointing in ("selective", "selective:torchtitan-op"):
        inputs = sum(st.num_layers * b for st, b in zip(arch.stacks, block_inputs))
        on_gpu = max(0.0, layer_acts - inputs * stage.layer_share * stage.in_flight)
    if job.checkpointing != "none" and job.peft is not None:
        on_gpu += block_inputs[0] + block_inputs[-1]
    return on_gpu + _outside_block_activations(job, arch, shapes, dt, task, stage)


def _trainable_tensors(job: Job, arch: Architecture, task: str) -> opt_states.Tensors:
    if job.peft is None:
        return opt_states.full_model_tensors(arch, task)
    head = arch.head_params[task] if task in CLASSIFIER_TASKS else 0
    return opt_states.lora_tensors(arch, set(job.peft.target_modules), job.peft.rank, head)


def _largest_trainable_bytes(job: Job, arch: Architecture, task: str) -> float:
    """One step temporary of the largest trainable parameter (optimizer in backward)."""
    largest = max((n for n, _ in _trainable_tensors(job, arch, task)), default=0)
    per = dtypes_for(job).weight if job.peft is None else adapter_bytes(job)
    return largest * per


def _unified_state_bytes(job: Job, arch: Architecture, task: str) -> float:
    """Paged optimizer states in CUDA unified memory (outside torch's allocator)."""
    if job.optimizer not in ("paged-adamw", "paged-adamw-8bit"):
        return 0.0
    per = dtypes_for(job).weight if job.peft is None else adapter_bytes(job)
    _, unified = opt_states.split_state_bytes(job.optimizer, _trainable_tensors(job, arch, task),
                                              per)
    return unified


def _framework_notes(job: Job, unified: float) -> list[str]:
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
