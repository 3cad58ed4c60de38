"""The Job x Architecture checks every engine runs first, so that the formula, the trace
and measure refuse the same jobs with the same line: pre-quantised weights no engine
models, a task, an input or a length the model does not have, a precision the GPU lacks,
a parallel layout the model cannot be split into. Each engine adds only what its own model
cannot do (the formula: compile and mxfp8 cases, formula/checks.py; the trace: tensor and
context parallelism).

    >>> check_job(job, load_architecture(job.model))   # raises JobError, or returns
"""

from __future__ import annotations

from vramplan.engines import pipeline
from vramplan.engines.runtime import check_gpu_runs_job
from vramplan.engines.step import Shapes, shapes_of, task_of
from vramplan.errors import JobError, VramplanError
from vramplan.hardware import get_gpu
from vramplan.hardware.gpu import GPU
from vramplan.job import Job
from vramplan.models import Architecture, architecture_from_config, load_architecture
from vramplan.models.families import prequantized


def check_job(job: Job, arch: Architecture, runtime_gpu: GPU | None = None) -> None:
    """Refuse, in one line, a job `arch` cannot run (the checks above, in that order)."""
    prequantized(arch.extra, arch.name, job.peft.method if job.peft else None,
                 job.peft.double_quant if job.peft else False)
    task = task_of(job, arch)
    if job.loss != "standard" and task != "causal-lm":  # as the torch side refuses it
        raise JobError(f"loss {job.loss} scores a causal LM's next tokens; this job is "
                       f"{task}: use loss standard")
    shapes = shapes_of(job, arch, task)
    if runtime_gpu:
        check_gpu_runs_job(job, runtime_gpu)
    check_parallel(job, arch)
    check_context_parallel_split(job, shapes)


def check_job_for_engine(job: Job, model_config: dict | None = None) -> None:
    """check_job for an engine that builds the model itself (trace, measure), when the
    model's Architecture can be read: a factory model, or a config nothing reads without
    building it, is left to the engine, which says what it cannot build."""
    from vramplan.models.catalog import looks_like_factory

    if model_config is None and looks_like_factory(job.model):
        return
    try:
        arch = (architecture_from_config(model_config, job.model) if model_config is not None
                else load_architecture(job.model))
        runtime_gpu = get_gpu(job.gpu) if job.gpu else None
    except VramplanError:
        return  # the engine reads the model (and the GPU) itself and says what is wrong
    check_job(job, arch, runtime_gpu)


def check_parallel(job: Job, arch: Architecture) -> None:
    """One line for a parallel layout the model cannot be split into."""
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
    if tp > 1 and not job.parallel.sequence_parallel and (
            job.checkpointing not in ("none", "full") or job.activation_offload):
        raise JobError(f"parallel.sequence_parallel=false is modelled with checkpointing none "
                       f"or full and no activation offload, not {job.checkpointing}"
                       f"{' with activation offload' if job.activation_offload else ''}: "
                       "set one of those, or keep sequence parallelism on")


def check_context_parallel_split(job: Job, shapes: Shapes) -> None:
    """torch's context parallelism balances causal attention by cutting the sequence into
    2 x cp chunks (head and tail per rank: _context_parallel/_load_balancer.py), and refuses
    a length that does not divide."""
    cp = job.parallel.context_parallel
    if cp > 1 and shapes.stack_seq and shapes.stack_seq[0] % (2 * cp):
        raise JobError(f"context_parallel={cp} splits the sequence into {2 * cp} equal "
                       f"chunks: seq_len {shapes.stack_seq[0]} is not a multiple of {2 * cp}; "
                       f"use a multiple, e.g. {shapes.stack_seq[0] // (2 * cp) * 2 * cp or 2 * cp}")
