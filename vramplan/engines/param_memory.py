"""Parameter memory of the whole model before any sharding: weights as stored, gradients,
optimizer states, autocast's weight copies and the optimizer step's temporaries; and a
pipeline stage's share of them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vramplan.engines import optimizer_states as opt_states
from vramplan.engines import pipeline
from vramplan.engines.precision import (
    NF4_BYTES_PER_PARAM,
    NF4_DOUBLE_QUANT_BYTES_PER_PARAM,
    STATE_COPIES,
    adapter_bytes,
    dtypes_for,
    eager_torchao_nf4,
    eight_bit_state_bytes,
    frozen_base_bytes,
    optimizer_step_temp_copies,
)
from vramplan.errors import JobError
from vramplan.job import Job
from vramplan.models import Architecture, Stack

# tasks whose head is new: it trains (beside LoRA adapters too, as peft's modules_to_save)
CLASSIFIER_TASKS = ("seq-classification", "image-classification")
# Param-sized temporaries of a per-parameter optimizer step (loop implementation), seen in
# the trace: torch's _single_tensor_adam makes exp_avg_sq.sqrt() and its division by the
# bias correction (the eps add and addcdiv_ are in place); Lion its update direction;
# Adafactor one update; SGD (with or without momentum) and the 8-bit stand-ins update in
# place (torch's foreach SGD too)
LOOP_STEP_COPIES = {"adam": 2, "adamw": 2, "lion": 1, "adafactor": 1}


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
    # the fp32 gradients a master-weight step makes (the 16-bit ones are freed after)
    master_grads: float = 0.0
    saved_copy: float = 0.0  # bytes of one modules_to_save copy (and of its gradient)


def param_memory(job: Job, arch: Architecture, task: str) -> ParamMemory:
    dt = dtypes_for(job)
    total = arch.total_params(task)
    linear_params = sum(s.num_layers * sum(ln.in_features * ln.out_features * ln.count
                                           for ln in s.linears) for s in arch.stacks)
    head = arch.head_params[task]
    matmul_params = linear_params + (head or (arch.vocab_size * hidden_size(arch)
                                              if task in ("causal-lm", "masked-lm") else 0))
    notes = []
    saved = 0  # parameters of modules_to_save copies (LoRA only)
    if job.peft is None:
        trainable, weights = total, total * dt.weight
        # fp8 (torchao Float8Linear) saves the fp32 weight itself: no copy of block weights
        cast = linear_params * (dt.linear_saved if dt.autocast and job.precision != "fp8" else 0)
        cast_head = (matmul_params - linear_params) * (dt.linear_saved if dt.autocast else 0)
        if dt.autocast:
            notes.append("autocast keeps a 16-bit copy of every matmul weight from forward "
                         "to backward (counted in temporary)")
        block_bytes = max((s.params_per_layer for s in arch.stacks), default=0) * dt.weight
        largest = max(largest_tensor(arch), 1)
    else:
        adapters = adapter_params(job, arch)
        # a new classifier head trains beside the adapters (peft's modules_to_save);
        # a language-model head stays frozen unless modules_to_save copies it
        head = head if task in CLASSIFIER_TASKS else 0
        saved = saved_params(job, arch, task)
        trainable = adapters + head + saved
        frozen = total - head
        base = frozen_base_bytes(job)
        cast = cast_head = 0.0
        if job.peft.method == "qlora":
            per = (NF4_DOUBLE_QUANT_BYTES_PER_PARAM if job.peft.double_quant
                   else NF4_BYTES_PER_PARAM)
            nf4 = sum(s.num_layers * nf4_params(arch, s) for s in arch.stacks)
            weights = nf4 * per + (frozen - nf4) * base
            # one weight at a time is dequantised to 16-bit for its matmul, the largest at
            # the library's peak (bitsandbytes: the 16-bit weight; torchao: its temporaries)
            cast_head = max((ln.in_features * ln.out_features for s in arch.stacks
                             for ln in s.linears), default=0) * nf4_dequantise_peak(job)
            if job.peft.quant_library == "bitsandbytes":
                notes.append("QLoRA: block linears in 4-bit NF4, the rest in 16-bit; "
                             "prepare_model_for_kbit_training would upcast the rest to fp32")
            else:
                notes.append("QLoRA: block linears in torchao's 4-bit NF4, the rest in "
                             "16-bit; dequantising the largest holds "
                             f"{nf4_dequantise_peak(job):g} bytes a weight at its peak")
            if job.checkpointing == "none" and "checkpointing" not in job.model_fields_set:
                notes.append("QLoRA without checkpointing: peft's prepare_model_for_kbit_"
                             "training (peft 0.21.2, use_gradient_checkpointing=True) turns "
                             "full checkpointing on by default; if you call it, add "
                             "--checkpointing full (--framework hf-trainer does)")
        else:
            weights = frozen * base
        # peft deep-copies each saved module: the copy, its gradient and its states keep
        # the frozen base's dtype (the adapters' may differ)
        weights += adapters * adapter_bytes(job) + head * dt.weight + saved * base
        block_bytes = max((block_base_bytes(job, arch, s, base) for s in arch.stacks), default=0)
        # the largest adapter matrix (or the classifier head); a saved copy is counted apart
        largest = max((n for n, _ in _adapter_tensors(job, arch, task)), default=1)
        dt = replace(dt, weight=adapter_bytes(job), grad=adapter_bytes(job))
    copy = frozen_base_bytes(job) if saved else 0  # a copy's bytes per element
    state = dt.state_bytes
    grads = (trainable - saved) * dt.grad + saved * copy
    if job.optimizer in opt_states.PER_TENSOR_OPTIMIZERS:
        optimizer, _ = opt_states.split_state_bytes(
            job.optimizer, trainable_tensors(job, arch, task), state)
    else:
        optimizer = (optimizer_bytes(job, arch, trainable - saved, state)
                     + saved_state_bytes(job, arch, saved, dt.master or copy))
    # a master-weight optimizer: its fp32 copy of every trainable weight, kept with the
    # states, and the fp32 gradients each step makes from the 16-bit ones
    optimizer += trainable * dt.master
    master_grads = trainable * dt.master
    step_temp = optimizer_step_temp_copies(job) * ((trainable - saved) * state
                                                   + saved * (dt.master or copy))
    if job.optimizer_impl == "loop" or job.optimizer == "lion":
        # one param's update at a time: its temporaries, in copies of the largest param
        one = max(largest * state,
                  arch.vocab_size * hidden_size(arch) * (dt.master or copy) if saved else 0)
        step_temp = max(step_temp, LOOP_STEP_COPIES.get(job.optimizer, 0) * one)
    # autograd sums the head's and the lookup's gradients out of place (add): both and
    # their sum are live at once, before the sum becomes .grad; when micro-steps
    # accumulate, the .grad (counted in gradients) is already there, so one more
    tied_copies = 3 if job.grad_accum > 1 else 2
    tied = (tied_copies * arch.vocab_size * hidden_size(arch) * dt.grad
            if job.peft is None and arch.tied_embeddings else 0.0)
    in_blocks = sum(s.num_layers * s.params_per_layer for s in arch.stacks)
    outside = (total - in_blocks) * (dt.weight if job.peft is None else frozen_base_bytes(job))
    outside += saved * copy  # the copies sit beside their originals, outside the blocks
    if dt.master:
        notes.append(f"{job.precision}: the optimizer keeps an fp32 master copy of every "
                     "trainable weight (counted with its states); each step copies the "
                     "16-bit gradients to fp32 and frees them (counted in temporary)")
    return ParamMemory(total, trainable, weights, grads, optimizer, cast, step_temp,
                       block_bytes, cast_head, tied, outside_blocks=outside, notes=tuple(notes),
                       fp8_gathered_block=fp8_gathered_block(job, arch),
                       master_grads=master_grads,
                       saved_copy=arch.vocab_size * hidden_size(arch) * copy if saved else 0.0)


def stage_params(job: Job, arch: Architecture, task: str, whole: ParamMemory,
                 stage: pipeline.Stage) -> ParamMemory:
    """The parameter memory a pipeline stage holds: its share of the blocks and its part
    of what lies outside them (engines/pipeline.py)."""
    if stage is pipeline.WHOLE:
        return whole
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
        step_temp=whole.step_temp * trained, master_grads=whole.master_grads * trained,
        cast_copies=whole.cast_copies * stage.layer_share,
        # the head's 16-bit copy lives with the head; QLoRA's is one dequantised weight
        cast_head=whole.cast_head if (stage.head or qlora) else 0.0,
        tied_grad_transient=whole.tied_grad_transient if stage.head else 0.0,
        outside_blocks=outside_bytes)


def fp8_gathered_block(job: Job, arch: Architecture) -> float:
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


def block_base_bytes(job: Job, arch: Architecture, stack: Stack, base: int) -> float:
    """One block of a PEFT base as stored: QLoRA keeps its linears' weights in NF4."""
    if job.peft is None or job.peft.method != "qlora":
        return stack.params_per_layer * base
    per = NF4_DOUBLE_QUANT_BYTES_PER_PARAM if job.peft.double_quant else NF4_BYTES_PER_PARAM
    weights = nf4_params(arch, stack)
    return weights * per + (stack.params_per_layer - weights) * base


# torchao's eager NF4Tensor.get_original_weight (torchao 0.18 quantization/quantize_/
# workflows/nf4/nf4_tensor.py) at its torch.stack, per weight element: the two int64 index
# halves (4 + 4 bytes, alive as locals until it returns), the two looked-up halves and the
# two scaled ones (1 + 1 each) and the 16-bit result (2); benchmarks/nf4_dequantise.py
# counts 14.03 on torchao's code (the scalers add the rest)
TORCHAO_NF4_DEQUANTISE_PEAK = 4 + 4 + 2 + 2 + 2


def nf4_dequantise_peak(job: Job) -> float:
    """Bytes per weight element live while one NF4 weight is dequantised: bitsandbytes'
    kernel (or a compiled block) writes the 16-bit weight (2); torchao's eager ops hold
    their temporaries too."""
    return TORCHAO_NF4_DEQUANTISE_PEAK if eager_torchao_nf4(job) else 2


def nf4_params(arch: Architecture, stack: Stack) -> int:
    """Weights of one block that QLoRA stores in NF4: its nn.Linear weights (not stacked
    experts, Traits.stacked_experts)."""
    stacked = arch.traits.stacked_experts
    return sum(ln.in_features * ln.out_features * ln.count for ln in stack.linears
               if not (stacked and ln.count > 1))


def hidden_size(arch: Architecture) -> int:
    return arch.stacks[-1].hidden_size if arch.stacks else 0


def largest_tensor(arch: Architecture) -> int:
    embedding = arch.vocab_size * hidden_size(arch)
    if arch.patch_size and arch.stacks:  # a ViT's patch convolution, hidden x c x p x p
        embedding = max(embedding, arch.stacks[0].hidden_size * arch.num_channels
                        * arch.patch_size ** 2)
    linear = max((ln.in_features * ln.out_features for s in arch.stacks for ln in s.linears),
                 default=0)
    return max(embedding, linear)


def adapter_params(job: Job, arch: Architecture) -> int:
    targets = set(job.peft.target_modules)
    on_experts = targets & arch.traits.peft_expert_targets
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
    magnitude = 1 if job.peft.dora else 0  # DoRA: one trained scale per output feature
    return sum(s.num_layers * ln.count * (r * (ln.in_features + ln.out_features)
                                          + magnitude * ln.out_features)
               for s in arch.stacks for ln in s.linears
               if "all-linear" in targets or ln.name in targets)


# Job.peft.modules_to_save: the tasks whose model has an LM head to copy
LM_HEAD_TASKS = ("causal-lm", "seq2seq")


def saved_params(job: Job, arch: Architecture, task: str) -> int:
    """Parameters of the trainable copies peft's modules_to_save makes: a vocab x hidden
    matrix for the token embedding and for the LM head, tied to it or not (each copy is
    its own tensor; peft 0.21.2 ties them only with ensure_weight_tying)."""
    if job.peft is None or not job.peft.modules_to_save:
        return 0
    wrong = [m for m in job.peft.modules_to_save
             if not arch.vocab_size or (m == "lm_head" and task not in LM_HEAD_TASKS)]
    if wrong:
        what = "LM head" if "lm_head" in wrong else "token embedding"
        raise JobError(f"peft.modules_to_save {', '.join(wrong)}: a {task} model of "
                       f"{arch.name} has no {what} to train; drop it")
    if job.parallel.pipeline_parallel > 1:
        raise JobError("peft.modules_to_save with pipeline parallelism is not modelled (the "
                       "copies live on the first and last stages); use one stage, or drop it")
    return len(job.peft.modules_to_save) * arch.vocab_size * hidden_size(arch)


def saved_state_bytes(job: Job, arch: Architecture, saved: int, copy_bytes: int) -> float:
    """Optimizer states of the modules_to_save copies (vocab x hidden matrices) in their
    dtype (a master-weight step's: fp32); per-tensor optimizers count them in
    trainable_tensors."""
    if not saved:
        return 0.0
    matrices = saved // (arch.vocab_size * hidden_size(arch))
    if job.optimizer == "adamw-8bit":
        return matrices * eight_bit_state_bytes(saved // matrices)
    if job.optimizer == "adafactor":
        return matrices * (arch.vocab_size + hidden_size(arch)) * copy_bytes
    return STATE_COPIES[job.optimizer] * saved * copy_bytes


def optimizer_bytes(job: Job, arch: Architecture, trainable: int, state_bytes: int) -> float:
    if job.optimizer in ("adamw-8bit", "paged-adamw-8bit"):
        return eight_bit_state_bytes(trainable)
    if job.optimizer == "adafactor":
        return adafactor_bytes(job, arch, trainable, state_bytes)
    return STATE_COPIES[job.optimizer] * trainable * state_bytes


def adafactor_bytes(job: Job, arch: Architecture, trainable: int, state_bytes: int) -> float:
    """Factored second moment: a row and a column vector per matrix (Shazeer & Stern 2018)."""
    if job.peft is not None:
        r = job.peft.rank
        return sum(s.num_layers * ln.count * 2 * (r + ln.in_features + r + ln.out_features)
                   for s in arch.stacks for ln in s.linears) * state_bytes
    shapes = [(ln.in_features, ln.out_features, s.num_layers * ln.count)
              for s in arch.stacks for ln in s.linears]
    if arch.vocab_size:  # the token embedding (and an untied head) are matrices too
        copies = 1 if arch.tied_embeddings else 2
        shapes.append((arch.vocab_size, hidden_size(arch), copies))
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


def trainable_tensors(job: Job, arch: Architecture, task: str) -> opt_states.Tensors:
    if job.peft is None:
        return opt_states.full_model_tensors(arch, task)
    tensors = _adapter_tensors(job, arch, task)
    if saved_params(job, arch, task):
        tensors.append((arch.vocab_size * hidden_size(arch), len(job.peft.modules_to_save)))
    return tensors


def _adapter_tensors(job: Job, arch: Architecture, task: str) -> opt_states.Tensors:
    head = arch.head_params[task] if task in CLASSIFIER_TASKS else 0
    return opt_states.lora_tensors(arch, set(job.peft.target_modules), job.peft.rank, head)


def largest_trainable_bytes(job: Job, arch: Architecture, task: str) -> float:
    """One step temporary of the largest trainable parameter (optimizer in backward)."""
    if job.peft is None:
        largest = max((n for n, _ in trainable_tensors(job, arch, task)), default=0)
        return largest * dtypes_for(job).state_bytes
    adapters = max((n for n, _ in _adapter_tensors(job, arch, task)), default=0)
    copy = arch.vocab_size * hidden_size(arch) if saved_params(job, arch, task) else 0
    return max(adapters * adapter_bytes(job), copy * frozen_base_bytes(job))


def unified_state_bytes(job: Job, arch: Architecture, task: str) -> float:
    """Paged optimizer states in CUDA unified memory (outside torch's allocator)."""
    if job.optimizer not in ("paged-adamw", "paged-adamw-8bit"):
        return 0.0
    per = dtypes_for(job).weight if job.peft is None else adapter_bytes(job)
    _, unified = opt_states.split_state_bytes(job.optimizer, trainable_tensors(job, arch, task),
                                              per)
    return unified
