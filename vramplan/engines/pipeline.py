"""Pipeline parallelism: what each stage holds, and the schedule's bubble.

The blocks are split into `pipeline_parallel` contiguous stages of ceil(L / p) blocks (the
most any stage holds; Megatron-LM splits evenly), or, where the embedding and the head count
as e and h blocks (parallel.pipeline_embedding_layers / _head_layers; torchtitan's
pipeline_parallel_first/last_stage_less_layers, distributed/pipeline_parallel.py
generate_llm_fqn_per_model_part), as torchtitan splits them: L + e + h over the p v model
chunks, the earlier chunks taking what does not divide, the first e fewer, the last h fewer,
chunk i on rank i mod p. The token embedding is on the first stage, the final norm and the
head on the last (a tied head keeps its own copy of the embedding
there, as Megatron-LM's shared embedding group does). The micro-batches of one step
(grad_accum of them, as pipeline_flushes schedules of
grad_accum / pipeline_flushes) flow through the stages.

Activations in flight (Megatron-LM, schedules.py: forward_backward_pipelining_without_
interleaving / _with_interleaving): a rank r of p runs `warmup` forwards before its first
backward and keeps their activations until their backward runs,

    1f1b          warmup = p - r - 1,                        in flight = min(warmup + 1, m)
    interleaved   warmup = 2 (p - r - 1) + (v - 1) p   model chunks of L / (p v) blocks,
                  in flight = min(warmup + 1, m v) / v   (in units of a stage's L / p blocks)
    gpipe         every forward before the first backward    in flight = m on every rank
                  (torch/distributed/pipelining/schedules.py, ScheduleGPipe)

so stage 0 holds the most: p micro-batches for 1F1B, p (1 + (p - 1) / (p v)) interleaved
(Korthikanti et al. 2022, "Reducing Activation Recomputation", section 4.2.3); the last
stage holds 1 (1F1B). Bubble: (p - 1) / (m + p - 1) of the step for 1F1B and GPipe (the
same fill and drain), divided by v interleaved (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training", 2.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vramplan.errors import JobError
from vramplan.job import CHUNKED_SCHEDULES, Job
from vramplan.models import Architecture


@dataclass(frozen=True)
class Stage:
    """What one pipeline stage holds, as shares of the whole model's figures."""

    name: str               # "first", "last", "rank r" (one between), or "all" (no pipeline)
    layer_share: float      # blocks on the stage / all blocks
    in_flight: float        # micro-batches of the stage's blocks whose activations it keeps
    embedding: bool         # holds the token embedding (and the inputs' activations)
    head: bool              # holds the final norm, the head and the loss
    # micro-batches whose head and loss tensors it keeps at once (head_in_flight)
    head_in_flight: int = 1
    blocks: int = 0         # blocks on the stage, all its model chunks (0: the whole model)


WHOLE = Stage("all", 1.0, 1.0, True, True)


def check_pipeline(job: Job, arch: Architecture) -> None:
    """One line for a pipeline the model cannot be split into."""
    p = job.parallel.pipeline_parallel
    if p == 1:
        return
    layers = sum(s.num_layers for s in arch.stacks)
    if arch.kind != "decoder":
        raise JobError("pipeline_parallel is modelled for decoder-only language models only "
                       f"({arch.name} is {arch.kind or 'not a transformer'}): use "
                       "tensor_parallel or fsdp")
    v = chunks(job)
    if p * v > layers:
        if v == 1:
            raise JobError(f"pipeline_parallel={p} stages but {arch.name} has only {layers} "
                           f"blocks: use at most {layers} stages",
                           field="parallel.pipeline_parallel")
        fewer = (f"at most {layers // p} chunks per GPU" if layers >= 2 * p else
                 f"at most {layers // 2} stages of 2 chunks")
        raise JobError(f"pipeline_parallel={p} x pipeline_chunks={v} model chunks but "
                       f"{arch.name} has only {layers} blocks: use {fewer}",
                       field="parallel.pipeline_chunks")
    e, h = job.parallel.pipeline_embedding_layers, job.parallel.pipeline_head_layers
    per_chunk = (layers + e + h) // (p * v)
    if max(e, h) > per_chunk:  # torchtitan refuses it too
        raise JobError(f"the embedding and the head count as {e} and {h} blocks in the split, "
                       f"but {layers} + {e} + {h} over {p * v} model chunks gives each only "
                       f"{per_chunk}: lower pipeline_embedding_layers / pipeline_head_layers "
                       "or use fewer stages", field="parallel.pipeline_embedding_layers")
    if job.activation_offload:
        raise JobError("activation offloading with pipeline parallelism is not modelled: "
                       "drop one of them")
    flushes = job.parallel.pipeline_flushes
    if job.grad_accum % flushes:
        raise JobError(f"grad_accum={job.grad_accum} micro-batches cannot run as "
                       f"pipeline_flushes={flushes} equal pipeline schedules: make grad_accum "
                       "a multiple of pipeline_flushes")


def micro_batches(job: Job) -> int:
    """Micro-batches of one pipeline schedule (the step runs pipeline_flushes of them)."""
    return max(1, job.grad_accum // job.parallel.pipeline_flushes)


def chunks(job: Job) -> int:
    """Model chunks per rank: pipeline_chunks for the interleaved schedule, else 1."""
    par = job.parallel
    return par.pipeline_chunks if par.pipeline_schedule in CHUNKED_SCHEDULES else 1


def stage_blocks(job: Job, arch: Architecture) -> list[int]:
    """Blocks each pipeline rank holds (all its model chunks), first to last."""
    par = job.parallel
    p, layers = par.pipeline_parallel, sum(s.num_layers for s in arch.stacks)
    e, h = par.pipeline_embedding_layers, par.pipeline_head_layers
    if not (e or h):
        return [math.ceil(layers / p)] * p
    base, extra = divmod(layers + e + h, p * chunks(job))
    per_chunk = [base + (i < extra) for i in range(p * chunks(job))]
    per_chunk[0] -= e
    per_chunk[-1] -= h
    return [sum(per_chunk[r::p]) for r in range(p)]


def in_flight(job: Job, rank: int) -> float:
    """Micro-batches of a stage's blocks whose activations rank `rank` keeps at once."""
    par, m = job.parallel, micro_batches(job)
    p = par.pipeline_parallel
    if par.pipeline_schedule == "interleaved" and p > 1:
        v = par.pipeline_chunks
        return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v) / v
    if par.pipeline_schedule == "gpipe":
        return m
    return min(p - rank, m)


def stages(job: Job, arch: Architecture) -> tuple[Stage, ...]:
    """The stages whose memory can be the largest, the last last: the first (most
    activations, the embedding) and the last (the head and the loss), and, split unevenly,
    one between with more blocks or more blocks x micro-batches in flight than both; the
    whole model without a pipeline."""
    p = job.parallel.pipeline_parallel
    if p == 1:
        return (WHOLE,)
    layers = sum(s.num_layers for s in arch.stacks)
    blocks = stage_blocks(job, arch)

    def stage(name: str, r: int) -> Stage:
        last = r == p - 1
        return Stage(name, blocks[r] / layers, in_flight(job, r), r == 0, last,
                     head_in_flight(job) if last else 1, blocks[r])

    def held(r: int) -> float:
        return blocks[r] * in_flight(job, r)

    between = []
    if p > 2:
        for r in (max(range(1, p - 1), key=held), max(range(1, p - 1), key=blocks.__getitem__)):
            if r not in between and (held(r) > max(held(0), held(p - 1))
                                     or blocks[r] > max(blocks[0], blocks[-1])):
                between.append(r)
    return (stage("first", 0), *(stage(f"rank {r}", r) for r in sorted(between)),
            stage("last", p - 1))


def head_in_flight(job: Job) -> int:
    """Micro-batches whose head, logits and loss tensors the last stage keeps at once: one
    where each forward's backward follows it there (1F1B, interleaved: the last model
    chunk turns straight round); every micro-batch with GPipe, whose stage keeps each
    output and loss graph until the backward pass (PipelineStage's fwd_cache)."""
    return micro_batches(job) if job.parallel.pipeline_schedule == "gpipe" else 1


def bubble_fraction(job: Job) -> float:
    """Share of the step the pipeline's GPUs sit idle: (p - 1) / (v m + p - 1), i.e. an idle
    time of (p - 1) / (v m) of the busy time (Narayanan et al. 2021, sec. 2.2: 1F1B's bubble
    (p - 1) / m, the interleaved schedule's v times smaller), m the micro-batches of one
    schedule (each of the step's pipeline_flushes fills and drains the pipeline)."""
    par = job.parallel
    p, m = par.pipeline_parallel, micro_batches(job)
    if p == 1:
        return 0.0
    return (p - 1) / (chunks(job) * m + p - 1)


def outside_params(arch: Architecture, task: str, stage: Stage) -> int:
    """Parameters outside the blocks that `stage` holds: the embedding on the first; the
    final norm, the head (a copy of a tied embedding) on the last; none on one between."""
    if stage is WHOLE or stage.name == "all":
        return arch.total_params(task) - sum(s.num_layers * s.params_per_layer
                                             for s in arch.stacks)
    if stage.embedding:
        return arch.embedding_params
    if not stage.head:
        return 0
    head = arch.head_params[task]
    tied_copy = (arch.vocab_size * arch.stacks[-1].hidden_size
                 if arch.tied_embeddings and not head else 0)
    return head + arch.other_params + tied_copy
