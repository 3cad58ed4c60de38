"""What differs between two jobs, in words and as the CLI flags that make the change
(plan rows, make-it-fit fixes, search num-gpus)."""

from __future__ import annotations

from vramplan.job import Job


def describe_changes(before: Job, after: Job) -> tuple[list[str], str]:
    """What differs between two jobs, in words and as CLI flags."""
    changes, flags = [], []
    pairs = [("batch_size", "--batch-size"), ("grad_accum", "--grad-accum"),
             ("checkpointing", "--checkpointing"), ("optimizer", "--optimizer"),
             ("optimizer_impl", "--optimizer-impl"), ("precision", "--precision"),
             ("activation_offload", "--activation-offload"), ("loss", "--loss"),
             ("optimizer_in_backward", "--optimizer-in-backward")]
    for name, flag in pairs:
        old, new = getattr(before, name), getattr(after, name)
        if old != new:
            changes.append(f"{name} {old} -> {new}")
            flags.append(flag if isinstance(new, bool) else f"{flag} {new}")
    p0, p1 = before.parallel, after.parallel
    for name, flag in (("num_gpus", "-n"), ("strategy", "--strategy"),
                       ("tensor_parallel", "--tp"), ("context_parallel", "--cp"),
                       ("pipeline_parallel", "--pp"), ("pipeline_schedule", "--pp-schedule")):
        if getattr(p0, name) != getattr(p1, name):
            changes.append(f"{name} {getattr(p0, name)} -> {getattr(p1, name)}")
            flags.append(f"{flag} {getattr(p1, name)}")
    if before.peft != after.peft and after.peft is not None:
        changes.append(f"peft {after.peft.method} rank {after.peft.rank}")
        flags.append(f"--peft {after.peft.method} --lora-rank {after.peft.rank}")
    if after.offload.optimizer and not before.offload.optimizer:
        changes.append("optimizer states offloaded to the CPU")
        flags.append("--offload-optimizer")
    if after.offload.params and not before.offload.params:
        changes.append("parameters offloaded to the CPU")
        flags.append("--offload-params")
    return changes, " ".join(flags)
