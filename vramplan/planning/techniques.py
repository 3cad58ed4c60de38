"""Memory-saving techniques: what each changes, its flag, its memory effect, its time cost,
and whether it changes the maths of training. One table, shared by the planner, `make it
fit` and search's suggestions.

`allow` is the name a user gives (`plan --allow lora,8bit`) to accept a technique that
changes the maths of training; techniques with allow=None never do, and the planner may
always use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Technique:
    name: str
    changes: dict[str, Any]          # the Job change (nested keys as dicts)
    flags: str                       # what to paste on the command line
    memory: str                      # what it saves
    time: str                        # what it costs in time
    changes_maths: bool              # does training compute something different?
    allow: str | None = None         # the --allow name that accepts it (None: always allowed)
    categories: tuple[str, ...] = field(default=())  # report categories it shrinks


TECHNIQUES: tuple[Technique, ...] = (
    Technique("gradient accumulation", {"batch_size": "smaller", "grad_accum": "larger"},
              "--batch-size B --grad-accum A",
              "activations scale with the micro-batch; the effective batch stays the same",
              "more, smaller steps: host overhead and the optimizer amortised over fewer tokens",
              False, categories=("activations", "inputs", "temporary")),
    Technique("selective checkpointing", {"checkpointing": "selective"},
              "--checkpointing selective",
              "keeps only matmul and attention outputs of each block",
              "recomputes the elementwise work in backward (memory-bound, a few %)",
              False, categories=("activations",)),
    Technique("full checkpointing", {"checkpointing": "full"}, "--checkpointing full",
              "keeps only each block's input; one block is recomputed at a time",
              "recomputes each block's forward: about +1/3 of the matmul FLOPs",
              False, categories=("activations",)),
    Technique("chunked loss", {"loss": "chunked"}, "--loss chunked",
              "never holds the logits of the whole sequence at once",
              "recomputes the output head's matmul in backward",
              False, categories=("temporary",)),
    Technique("fused optimizer", {"optimizer_impl": "fused"}, "--optimizer-impl fused",
              "no parameter-sized temporaries in the optimizer step",
              "faster: one kernel instead of ~10 foreach passes",
              False, categories=("temporary",)),
    Technique("ZeRO-2", {"parallel": {"strategy": "zero2"}}, "--strategy zero2 -n N",
              "optimizer states and gradients sharded over data-parallel GPUs",
              "reduce-scatter + all-gather instead of all-reduce: about the same traffic",
              False, categories=("optimizer_states", "gradients")),
    Technique("FSDP / ZeRO-3", {"parallel": {"strategy": "fsdp"}}, "--strategy fsdp -n N",
              "weights, gradients and optimizer states sharded over data-parallel GPUs",
              "weights all-gathered twice per micro-batch (1.5x DDP's traffic), overlapped",
              False, categories=("weights", "optimizer_states", "gradients")),
    Technique("tensor parallelism", {"parallel": {"tensor_parallel": "N"}}, "--tp N",
              "every block's weights and activations split over N GPUs",
              "4 activation all-reduces per block on the critical path: keep it in a node",
              False, categories=("weights", "activations", "optimizer_states", "gradients")),
    Technique("context parallelism", {"parallel": {"context_parallel": "N"}}, "--cp N",
              "activations of long sequences split over N GPUs",
              "k/v ring exchange, overlapped with attention",
              False, categories=("activations",)),
    Technique("pipeline parallelism", {"parallel": {"pipeline_parallel": "N"}},
              "--pp N --grad-accum M",
              "each of N stages holds 1/N of the blocks; stage 0 keeps up to N micro-batches "
              "of activations (1F1B)",
              "idle bubble of (N - 1) / (M + N - 1) of the step (less interleaved), p2p sends",
              False, categories=("weights", "optimizer_states", "gradients")),
    Technique("more GPUs", {"parallel": {"num_gpus": "N"}}, "-n N",
              "sharded state divides by the shard degree",
              "faster, unless communication dominates; cost per token rises with it",
              False, categories=("weights", "optimizer_states", "gradients")),
    Technique("LoRA", {"peft": {"method": "lora", "rank": 16}}, "--peft lora --lora-rank 16",
              "no gradients or optimizer states for the frozen base (16-bit)",
              "no weight gradients: backward is about half the matmul FLOPs",
              True, "lora", ("gradients", "optimizer_states", "weights")),
    Technique("QLoRA", {"peft": {"method": "qlora", "rank": 16}}, "--peft qlora --lora-rank 16",
              "the frozen base in 4-bit NF4 (about 0.52 bytes per weight)",
              "dequantises each weight in forward and backward (memory-bound)",
              True, "qlora", ("weights", "gradients", "optimizer_states")),
    Technique("8-bit AdamW", {"optimizer": "adamw-8bit"}, "--optimizer adamw-8bit",
              "optimizer states 2 bytes per parameter instead of 8",
              "a faster step (fewer bytes)", True, "8bit", ("optimizer_states",)),
    Technique("fp8 training", {"precision": "fp8"}, "--precision fp8",
              "linears save fp8 copies of their inputs",
              "fp8 matmuls at twice the bf16 rate on GPUs with fp8 tensor cores",
              True, "fp8", ("activations",)),
    Technique("optimizer offload", {"offload": {"optimizer": True}}, "--offload-optimizer",
              "optimizer states in CPU memory",
              "the step runs on the CPU with PCIe copies: much slower steps",
              False, "offload", ("optimizer_states",)),
    Technique("activation offload", {"activation_offload": True}, "--activation-offload",
              "saved activations in pinned CPU memory",
              "PCIe copies, partly overlapped with compute",
              False, "offload", ("activations",)),
)

ALLOW_NAMES = tuple(sorted({t.allow for t in TECHNIQUES if t.allow}))


def technique(name: str) -> Technique:
    return next(t for t in TECHNIQUES if t.name == name)


def allowed(allow: tuple[str, ...] | list[str] = ()) -> list[Technique]:
    """Techniques the planner may use: those that keep the maths, and those allowed."""
    return [t for t in TECHNIQUES if t.allow is None or t.allow in allow]


def for_category(category: str, allow: tuple[str, ...] = ALLOW_NAMES) -> list[Technique]:
    """Techniques that shrink a report category (search's suggestions)."""
    return [t for t in allowed(allow) if category in t.categories]
