"""What to try when nothing fits, by the category that fills memory."""

from __future__ import annotations

from collections.abc import Callable

from vramplan.frameworks import framework_allows
from vramplan.job import Job


def _can(job: Job, dotted: str, value: object) -> bool:
    """The job's framework supports this change (torchtitan has no 8-bit optimizer, ...)."""
    return framework_allows(job.framework, dotted, value)


_SUGGESTIONS: dict[str, list[tuple[str, Callable[[Job], bool]]]] = {
    "optimizer_states": [
        ("an 8-bit optimizer (optimizer: adamw-8bit)",
         lambda j: j.optimizer in ("adam", "adamw") and _can(j, "optimizer", "adamw-8bit")),
        ("shard optimizer states over GPUs (strategy: zero1 / zero2 / fsdp)",
         lambda j: j.parallel.shard_degree == 1 and _can(j, "parallel.strategy", "zero1")),
        ("shard optimizer states over GPUs (strategy: fsdp)",
         lambda j: j.parallel.shard_degree == 1 and not _can(j, "parallel.strategy", "zero1")),
        ("offload optimizer states to the CPU (offload.optimizer)",
         lambda j: not j.offload.optimizer),
        ("LoRA, so only adapters have optimizer states (peft.method: lora)",
         lambda j: j.peft is None)],
    "weights": [
        ("QLoRA: a 4-bit base with LoRA adapters (peft.method: qlora)",
         lambda j: not (j.peft and j.peft.method == "qlora")
         and _can(j, "peft.method", "qlora")),
        ("shard parameters over GPUs (strategy: fsdp / zero3)",
         lambda j: j.parallel.strategy not in ("zero3", "fsdp", "hybrid-shard")),
        ("a GPU with more memory", lambda j: True)],
    "gradients": [
        ("LoRA, so only adapters have gradients (peft.method: lora)", lambda j: j.peft is None),
        ("shard gradients over GPUs (strategy: zero2 / fsdp)",
         lambda j: j.parallel.strategy in ("none", "ddp", "zero1")
         and _can(j, "parallel.strategy", "zero2")),
        ("shard gradients over GPUs (strategy: fsdp)",
         lambda j: j.parallel.strategy in ("none", "ddp")
         and not _can(j, "parallel.strategy", "zero2")),
        ("apply the optimizer in backward (optimizer_in_backward)",
         lambda j: not j.optimizer_in_backward and j.grad_accum == 1)],
    "activations": [
        ("activation checkpointing (checkpointing: full)", lambda j: j.checkpointing != "full"),
        ("a shorter sequence (seq_len) or a smaller micro-batch with grad_accum",
         lambda j: True),
        ("flash / memory-efficient attention (attention: sdpa)",
         lambda j: j.attention != "sdpa"),
        ("offload saved activations to the CPU (activation_offload)",
         lambda j: not j.activation_offload)],
    "temporary": [
        ("a chunked cross-entropy loss that never holds all logits (loss: chunked)",
         lambda j: not j.loss.startswith("chunked") and _can(j, "loss", "chunked")),
        ("a shorter sequence (seq_len)", lambda j: True)],
    "inputs": [("a shorter sequence or smaller images", lambda j: True)],
    "allocator_overhead": [
        ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (fragmentation)", lambda j: True)],
    "runtime_context": [("a GPU with more memory: the CUDA context alone does not fit",
                         lambda j: True)],
}


def suggestions_for(job: Job, category: str) -> list[str]:
    return [text for text, unused in _SUGGESTIONS.get(category, []) if unused(job)]
