"""The phase table: the memory of each phase of one step on one GPU, and the peak."""

from __future__ import annotations

from vramplan.engines import pipeline
from vramplan.engines.checks import check_job
from vramplan.engines.formula import dora
from vramplan.engines.formula.checks import (
    check_compiled,
    check_mxfp8_inputs,
)
from vramplan.engines.formula.loss import kept_until_backward, loss_buffers
from vramplan.engines.formula.notes import framework_notes, technique_notes
from vramplan.engines.formula.per_gpu import per_gpu_params
from vramplan.engines.formula.saved import (
    hidden_wide_activations,
    offloaded_activations,
    outside_block_activations,
    stack_activations,
)
from vramplan.engines.memory_report import CATEGORIES, MemoryReport
from vramplan.engines.param_memory import (
    hidden_size,
    largest_trainable_bytes,
    unified_state_bytes,
)
from vramplan.engines.runtime import (
    fit_table,
    runtime_context_bytes,
    workspaces_bytes,
)
from vramplan.engines.step import Step, describe_step, task_of
from vramplan.hardware import get_gpu, list_gpus
from vramplan.hardware.gpu import GPU
from vramplan.job import Job
from vramplan.models import Architecture, architecture_from_config, load_architecture
from vramplan.units import format_bytes


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
    runtime_gpu = get_gpu(job.gpu) if job.gpu else None
    check_job(job, arch, runtime_gpu)  # what every engine refuses
    if job.compile:
        check_compiled(job, arch, task_of(job, arch))
    step = describe_step(job, arch)
    check_mxfp8_inputs(job, step.activations)
    # with pipeline stages, the first (most activations) or the last (the head) is largest
    reports = [stage_report(step, runtime_gpu, stage) for stage in step.stages]
    report = max(reports, key=lambda r: r.device_total)
    catalog = gpus if gpus is not None else ([runtime_gpu] if runtime_gpu else list_gpus())
    return report.model_copy(update={"fits": fit_table(report, job.runtime, catalog,
                                                       runtime_gpu)})


def stage_report(step: Step, runtime_gpu: GPU | None, stage: pipeline.Stage) -> MemoryReport:
    """The report of one pipeline stage (the whole model without a pipeline)."""
    job, arch, task, shapes = step.job, step.arch, step.task, step.shapes
    whole, dt = step.params, step.activations
    params = step.stage_params(stage)
    tp, cp = job.parallel.tensor_parallel, job.parallel.context_parallel
    layer_acts, block_acts = stack_activations(job, arch, shapes, dt)
    layer_acts *= stage.layer_share * stage.in_flight
    activations = (layer_acts + outside_block_activations(job, arch, shapes, dt, task, stage)
                   ) / (tp * cp)
    if job.activation_offload and arch.stacks:  # (a CNN has no blocks to offload)
        activations = offloaded_activations(job, arch, shapes, dt, task, stage,
                                             layer_acts) / (tp * cp)
    replicated = 0.0  # per GPU, beyond the 1/tp share already counted
    if tp > 1 and not job.parallel.sequence_parallel:  # (checks.py: checkpointing none/full)
        wide, wide_block = hidden_wide_activations(job, arch, shapes, dt, task, stage)
        activations += wide * (tp - 1) / (tp * cp)
        replicated = wide_block * (tp - 1) / (tp * cp)
    logits_fwd, logits_bwd = (loss_buffers(job, arch, shapes, dt, task) if stage.head
                              else (0.0, 0.0))
    if stage.head and stage.head_in_flight > 1:  # GPipe: the other micro-batches' logits
        activations += (stage.head_in_flight - 1) * kept_until_backward(job, arch, shapes,
                                                                        dt, task)

    w, g, o, cast, gathered, root_gathered, comm, notes, gathered_end = per_gpu_params(
        job, params)
    if stage is not pipeline.WHOLE:
        # a received activation and the gradient sent back: the stages' p2p buffers
        comm += 2 * job.batch_size * shapes.stack_seq[-1] * hidden_size(arch) * dt.compute / (
            tp * cp)
        notes.append(f"pipeline stage {stage.name} of {job.parallel.pipeline_parallel} "
                     f"({job.parallel.pipeline_schedule}): "
                     f"{stage.blocks} blocks, activations of "
                     f"{stage.in_flight:g} micro-batch{'' if stage.in_flight == 1 else 'es'}"
                     " in flight"
                     + (", the embedding" if stage.embedding else
                        ", the head and the loss" if stage.head else ""))
    ws = workspaces_bytes(job.runtime, runtime_gpu)
    inputs = shapes.input_bytes / cp
    keeps_grads = job.keep_grads_between_steps and not job.optimizer_in_backward
    g_kept = g if job.grad_accum > 1 or keeps_grads else 0.0
    if job.parallel.defers_gradient_sync and job.grad_accum > 1:
        # until the last micro-batch's reduce-scatter FSDP2 keeps each parameter's whole
        # gradient, upcast to its fp32 reduce dtype (torch/distributed/fsdp/_fully_shard/
        # _fsdp_param.py to_accumulated_grad_if_needed; training/fsdp.py's policy)
        g_kept = params.trainable * 4 / tp
        notes.append(f"FSDP without gradient sync until the last micro-batch: "
                     f"{format_bytes(int(g_kept))} of fp32 gradients, unsharded, held between "
                     "micro-batches " + (
                         "(sync_each_batch / fsdp_no_sync false shards them)"
                         if job.parallel.fsdp_no_sync else "(torch's pipeline schedules turn "
                         "FSDP's gradient sync off until a schedule's last micro-batch)"))
    step_temp = params.step_temp / (tp * job.parallel.shard_degree)
    if job.optimizer_in_backward:
        # the largest gradient left: a block's, or a modules_to_save copy's (one matrix)
        g = min(g, max(params.largest_block, params.saved_copy)
                / (tp * job.parallel.shard_degree))
        # one parameter is stepped at a time: no buffer spans all parameters
        step_temp = min(step_temp, largest_trainable_bytes(job, arch, task) / tp)
    # a master-weight step copies the 16-bit gradients to fp32 (both live), frees the
    # 16-bit ones, then updates the masters with its own temporaries
    master_grads = params.master_grads / (tp * job.parallel.shard_degree)
    if job.offload.optimizer:
        step_temp = master_grads = 0.0  # the step runs on the CPU, next to the offloaded states
    unified = (unified_state_bytes(job, arch, task) / (tp * job.parallel.shard_degree)
               * params.trainable / max(whole.trainable, 1))  # a pipeline stage's share

    recompute = dict(activations=0.0, cast=0.0)
    layers = sum(st.num_layers for st in arch.stacks) * stage.layer_share  # on this GPU
    cast_fwd = cast  # autocast's cache keeps every copy until the forward ends
    if job.checkpointing != "none" and layers:
        # saved tensors of checkpointed blocks hold no weight copies, so those copies go
        # when the forward ends; during backward one block at a time is recomputed, with
        # its activations and weight copies
        block_cast = max(0.0, cast - params.cast_head / tp)
        cast -= block_cast * checkpointed_share(job, arch)
        recompute = dict(activations=block_acts / (tp * cp) + replicated,
                         cast=block_cast / layers)
        if job.compiles_blocks:  # a compiled block casts its weights in its graph: no cache
            cast_fwd = cast

    saved_inputs = (shapes.input_bytes - shapes.label_bytes) / cp  # what backward still holds
    base = dict(weights=w, optimizer_states=o, inputs=saved_inputs)
    # DoRA rebuilds each adapted weight's norm as its layer runs: in forward, before the
    # head's logits exist, and again while a checkpointed block is recomputed
    dora_temp = dora.transient(job, arch, dt) if stage.layer_share else 0.0
    recompute["cast"] += dora_temp if job.checkpointing != "none" else 0.0
    phases = {
        "forward": dict(base, inputs=inputs, gradients=g_kept, activations=activations,
                        temporary=cast_fwd + max(logits_fwd, dora_temp) + gathered + comm
                        + ws),
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
                             temporary=gathered_end + comm + ws
                             + params.tied_grad_transient / tp),
        "optimizer": dict(base, inputs=0.0, gradients=g, activations=0.0,
                          temporary=step_temp + comm + ws),
    }
    if master_grads:
        # the fp32 gradients with the 16-bit ones, or, once the step's own 16-bit gradients
        # are freed, with the update's temporaries (zero1 keeps the other ranks' gradients
        # until zero_grad; DeepSpeed frees them first: this errs on the safe side)
        freed = g / job.parallel.shard_degree if job.parallel.strategy == "zero1" else g
        phases["optimizer"].update(
            (dict(gradients=g, temporary=master_grads + comm + ws) if freed > step_temp else
             dict(gradients=g - freed, temporary=master_grads + step_temp + comm + ws)))
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak_name = max(totals, key=totals.get)
    at_peak = {k: int(round(v)) for k, v in phases[peak_name].items()}
    allocated = sum(at_peak.values())
    # reserved memory is the most the allocator held at any phase, not only at the peak
    reserved = max(totals[name] + allocator_overhead(job, arch, name, totals[name], parts)
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
        notes=[*shapes.notes, *params.notes, *notes, *technique_notes(job, arch),
               *framework_notes(job, unified)],
        unified_memory_bytes=int(round(unified)),
    )
    return report


# (activations + temporaries), by checkpointing mode: recomputation frees and reallocates
# blocks of many sizes. Medians of 19 H200 runs (benchmarks/results/gpu_validation.json:
# 6.4%, 13%, 33%) and 29 trace replays (formula_vs_trace.json: 5.7%, 10%, 29%).
ALLOCATOR_OVERHEAD = {"none": 0.06, "selective": 0.12, "full": 0.30}


# Phases in which checkpointing recomputes blocks (and so fragments the cache); the others
# see the allocator as without checkpointing.
RECOMPUTE_PHASES = ("backward", "backward_recompute", "backward_gather")


def allocator_overhead(job: Job, arch: Architecture, phase: str, allocated: float,
                       parts: dict[str, float]) -> float:
    if job.runtime.allocator_overhead is not None:
        return allocated * job.runtime.allocator_overhead
    # checkpointing is ignored on a model without blocks (ResNet), and outside backward
    # nothing is recomputed: the optimizer step's temporaries fragment no more than usual
    recomputes = bool(arch.stacks) and phase in RECOMPUTE_PHASES
    mode = job.checkpointing.split(":")[0] if recomputes else "none"
    return (parts["activations"] + parts["temporary"]) * ALLOCATOR_OVERHEAD[mode]


def checkpointed_share(job: Job, arch: Architecture) -> float:
    """Share of the blocks whose saved tensors are recomputed (so hold no weight copies)."""
    if job.checkpointing != "selective:every-2nd-layer":
        return 1.0
    layers = sum(st.num_layers for st in arch.stacks)
    return sum(st.num_layers // 2 for st in arch.stacks) / max(layers, 1)
