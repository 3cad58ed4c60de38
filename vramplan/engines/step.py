"""The step description: one training step of a Job on an Architecture, derived once
(describe_step) and read by the memory formula (engines/formula/) and the performance
model (planning/flops.py, traffic.py, comm.py, performance.py) alike.

    >>> step = describe_step(Job(model="llama-3.2-1b", seq_len=1024), load_architecture(...))
    >>> step.task, step.shapes.stack_seq, step.params.trainable, step.attention

It holds the task, the token shapes per stack, the dtypes as stored and as activations see
them, the attention kernel run, the whole model's parameter memory and the pipeline stages
whose memory can be the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vramplan.engines import pipeline
from vramplan.engines.param_memory import ParamMemory, param_memory, stage_params
from vramplan.engines.precision import Dtypes, dtypes_for, sixteen_bit_model
from vramplan.errors import JobError
from vramplan.job import Job
from vramplan.models import Architecture, Linear, Stack
from vramplan.models.families import text_len


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
class Step:
    """One training step of `job` on `arch`, before it is split over GPUs."""

    job: Job
    arch: Architecture
    task: str
    shapes: Shapes
    dtypes: Dtypes        # weights, gradients and compute as stored (precision.dtypes_for)
    activations: Dtypes   # as activations see them (a 16-bit base keeps a 16-bit residual)
    attention: str        # the attention kernel the step runs (the job's, or eager)
    params: ParamMemory   # the whole model's parameter memory
    stages: tuple[pipeline.Stage, ...]  # the first and last stage, or the whole model

    def stage_params(self, stage: pipeline.Stage) -> ParamMemory:
        """The parameter memory `stage` holds (the whole model's without a pipeline)."""
        return stage_params(self.job, self.arch, self.task, self.params, stage)


def describe_step(job: Job, arch: Architecture) -> Step:
    """The step description of `job` on `arch`; refuses a task, an input or a pipeline the
    model does not have, in one line."""
    task = task_of(job, arch)
    shapes = shapes_of(job, arch, task)
    params = param_memory(job, arch, task)
    pipeline.check_pipeline(job, arch)
    check_dora(job, arch)
    return Step(job, arch, task, shapes, dtypes_for(job), activation_dtypes(job),
                attention_impl(job, arch), params, pipeline.stages(job, arch))


def task_of(job: Job, arch: Architecture) -> str:
    task = job.task or arch.default_task
    if task not in arch.head_params:
        raise JobError(f"{arch.name} does not support task {task!r}; it supports: "
                       f"{', '.join(arch.tasks)}")
    return task


def check_inputs(job: Job, arch: Architecture) -> None:
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


def shapes_of(job: Job, arch: Architecture, task: str) -> Shapes:
    check_inputs(job, arch)
    b, notes = job.batch_size, []
    if arch.kind == "cnn" or (arch.stacks and arch.stacks[0].sequence == "patches"):
        size = job.image_size or arch.image_size
        if arch.patch_size and size % arch.patch_size:
            raise JobError(f"image_size {size} is not a multiple of {arch.name}'s patch size "
                           f"{arch.patch_size}")
        seq = (size // arch.patch_size) ** 2 + 1 if arch.patch_size else 0
        pixels = float_bytes(job) * b * arch.num_channels * size * size  # pixel_values
        return Shapes(tuple(seq for _ in arch.stacks), 0, pixels + 8 * b, 1, label_bytes=8 * b)

    seq = text_length(job.seq_len, arch, "seq_len", notes)
    if arch.stacks[0].sequence == "audio":
        frames = arch.max_source_positions  # Whisper pads every clip to 30 s (3000 frames)
        if job.audio_seconds and job.audio_seconds > frames / 100:
            raise JobError(f"{arch.name} accepts at most {frames / 100:g} s of audio "
                           f"(got audio_seconds={job.audio_seconds:g})")
        if job.audio_seconds and job.audio_seconds < frames / 100:
            notes.append(f"{arch.name} pads every clip to {frames / 100:g} s: memory is that "
                         "of a full-length clip")
        target = text_length(job.target_len or job.seq_len, arch, "target_len", notes)
        features = float_bytes(job) * b * arch.num_mel_bins * frames
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


def float_bytes(job: Job) -> int:
    """Pixels and audio features as the data loader hands them over: 16-bit when the whole
    model is (transformers 5.24 Trainer._prepare_input casts a DeepSpeed model's float
    inputs to its dtype), else fp32 (autocast casts them inside the model)."""
    return 2 if sixteen_bit_model(job) else 4


def text_length(requested: int | None, arch: Architecture, field: str, notes: list[str]) -> int:
    return text_len(requested, arch.max_positions, arch.model_type, arch.name, field, notes)


def activation_dtypes(job: Job) -> Dtypes:
    """The dtypes activations see: a 16-bit base (PEFT, FSDP mixed precision) keeps the
    residual stream in 16-bit even under autocast."""
    dt = dtypes_for(job)
    sixteen_bit_base = job.peft is not None or job.parallel.strategy in (
        "zero3", "fsdp", "hybrid-shard")
    if dt.autocast and sixteen_bit_base:
        return replace(dt, residual=2)
    return dt


def lora_linears(job: Job, stack: Stack) -> list[Linear]:
    """The linears of `stack` that carry the job's LoRA adapters (none without PEFT)."""
    if job.peft is None:
        return []
    targets = set(job.peft.target_modules)
    return [ln for ln in stack.linears if "all-linear" in targets or ln.name in targets]


def dora_linears(job: Job, stack: Stack) -> list[Linear]:
    """The linears of `stack` that carry DoRA adapters (none without DoRA): the memory
    (engines/formula/dora.py) and the time (planning/flops.py, traffic.py) both read it."""
    return lora_linears(job, stack) if job.peft is not None and job.peft.dora else []


def check_dora(job: Job, arch: Architecture) -> None:
    """DoRA is modelled on dense linears: one line for the experts' (memory and time both
    describe the step from here)."""
    experts = sorted({ln.name for s in arch.stacks for ln in dora_linears(job, s)
                      if ln.count > 1})
    if experts:
        raise JobError(f"DoRA on the experts' linears ({', '.join(experts)}) is not modelled: "
                       "target the attention projections, or use --engine trace")


def attention_impl(job: Job, arch: Architecture) -> str:
    """What the attention keeps and computes: "eager" (the scores materialised) or "sdpa"
    (a fused kernel: torch's SDPA, flash-attn and cuDNN keep and compute the same; only
    their speed differs, planning/efficiency.py attention_kernel)."""
    if job.attention == "eager":
        return "eager"
    # Gemma-2 soft-caps the scores, which SDPA cannot: transformers runs that attention
    # eagerly (flash-attn takes the cap: softcap of flash_attention_forward)
    return "eager" if job.attention == "sdpa" and arch.traits.eager_attention_only else "sdpa"
