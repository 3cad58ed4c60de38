"""Memory-saving techniques: what each changes, how to apply it to a Job, its flag, its
memory effect, its time cost, and whether it changes the maths of training. One table,
read by the planner (its variants), make-it-fit (its combinations), search's suggestions
and the web's `allow` list.

`allow` is the name a user gives (`plan --allow lora,8bit`) to accept a technique that
changes the maths of training (or moves state off the GPU); techniques with allow=None
never do, and the planner may always use them.

`apply(job)` is the Job with the technique, or None where it does not apply (the job
already does it, or it needs a count the planner chooses: tensor / context / pipeline
parallel degrees, more GPUs). `cost` orders techniques by time cost (0: none or faster),
so make-it-fit ranks combinations by how much they change. `planner`: the planner adds
it as a variant when allowed (it searches checkpointing, micro-batches and layouts itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vramplan.errors import JobError
from vramplan.job import SHARDED_STRATEGIES, Job, Peft
from vramplan.planning.layouts import fused_optimizer

Apply = Callable[[Job], "Job | None"]


def _none(job: Job) -> Job | None:
    return None


def _half_batch(job: Job) -> Job | None:
    if job.batch_size < 2:
        return None
    half = job.batch_size // 2
    return job.with_changes(batch_size=half, grad_accum=job.grad_accum * job.batch_size // half)


def _batch_one(job: Job) -> Job | None:
    if job.batch_size < 4:  # at 2 the half is 1: one technique, not two
        return None
    return job.with_changes(batch_size=1, grad_accum=job.grad_accum * job.batch_size)


def _fused(job: Job) -> Job | None:
    change = fused_optimizer(job)
    return job.with_changes(**change) if change and job.optimizer_impl == "foreach" else None


def _set(field_name: str, value: Any, when: Callable[[Job], bool] = lambda job: True) -> Apply:
    def apply(job: Job) -> Job | None:
        if getattr(job, field_name) == value or not when(job):
            return None
        return job.with_changes(**{field_name: value})
    return apply


def _peft(method: str) -> Apply:
    def apply(job: Job) -> Job | None:
        if job.peft is not None and (job.peft.method == method or method == "lora"):
            return None
        if method == "qlora" and job.precision == "fp8":
            return None
        return job.with_changes(peft=Peft(method=method))
    return apply


def _eight_bit(job: Job) -> Job | None:
    if job.optimizer not in ("adam", "adamw"):
        return None
    return job.with_changes(optimizer="adamw-8bit", optimizer_impl="foreach")


def _fp8(job: Job) -> Job | None:
    if job.precision not in ("bf16-mixed", "fp16-mixed") or (
            job.peft is not None and job.peft.method == "qlora"):
        return None
    return job.with_changes(precision="fp8")


def _offload_optimizer(job: Job) -> Job | None:
    if job.offload.optimizer or job.optimizer == "paged-adamw-8bit":
        return None
    return job.with_changes(offload={**job.offload.model_dump(), "optimizer": True})


def _zero2(job: Job) -> Job | None:
    p = job.parallel
    if p.data_parallel < 2 or p.strategy not in ("none", "ddp"):
        return None
    return job.with_changes(parallel=p.changed(strategy="zero2"))


def _fsdp(job: Job) -> Job | None:
    """FSDP over the job's GPUs, or over 2 when it has one (the smallest sharded job)."""
    p = job.parallel
    if p.strategy not in ("none", "ddp", "zero2") or p.model_parallel > 1:
        return None
    return job.with_changes(parallel=p.changed(strategy="fsdp", num_gpus=max(2, p.num_gpus)))


def _sync_each_batch(job: Job) -> Job | None:
    """FSDP that holds whole gradients between micro-batches (fsdp_no_sync) shards them."""
    p = job.parallel
    if not p.fsdp_no_sync or job.grad_accum < 2:
        return None
    return job.with_changes(parallel=p.changed(fsdp_no_sync=False))


def _reshard(job: Job) -> Job | None:
    """FSDP that keeps each unit gathered to its backward (SHARD_GRAD_OP) frees it instead."""
    p = job.parallel
    if p.reshard_after_forward or p.strategy not in SHARDED_STRATEGIES:
        return None
    return job.with_changes(parallel=p.changed(reshard_after_forward=True))


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
    apply: Apply = _none             # the Job with it, None where it does not apply
    cost: int = 0                    # time cost rank: 0 none, 1 small, 2 a few %, 3 large
    planner: bool = False            # the planner adds it as a variant when allowed

    def applied(self, job: Job) -> Job | None:
        """apply(job), None also when the result is refused (framework, combinations)."""
        try:
            return self.apply(job)
        except (JobError, ValueError):
            return None


TECHNIQUES: tuple[Technique, ...] = (
    Technique("gradient accumulation", {"batch_size": "smaller", "grad_accum": "larger"},
              "--batch-size B --grad-accum A",
              "activations scale with the micro-batch; the effective batch stays the same",
              "more, smaller steps: host overhead and the optimizer amortised over fewer tokens",
              False, categories=("activations", "inputs", "temporary"), apply=_half_batch,
              cost=1),
    Technique("fused optimizer", {"optimizer_impl": "fused"}, "--optimizer-impl fused",
              "no parameter-sized temporaries in the optimizer step",
              "faster: one kernel instead of ~10 foreach passes",
              False, categories=("temporary",), apply=_fused, cost=0),
    Technique("chunked loss", {"loss": "chunked"}, "--loss chunked",
              "never holds the logits of the whole sequence at once",
              "recomputes the output head's matmul in backward",
              False, categories=("temporary",),
              apply=_set("loss", "chunked", lambda j: j.loss == "standard"
                         and j.task in (None, "causal-lm")), cost=1),
    Technique("Liger fused loss", {"loss": "chunked:liger"}, "--loss chunked:liger",
              "no logits at all: the head and the loss run in chunks, their gradients in "
              "forward (needs liger-kernel installed; Axolotl also its LigerPlugin)",
              "faster: one Triton kernel instead of the upcast, log-softmax and gradients",
              False, categories=("temporary",),
              apply=_set("loss", "chunked:liger", lambda j: j.loss in ("standard", "chunked")
                         and j.task in (None, "causal-lm") and not j.compile
                         and j.framework not in ("torchtune", "torchtitan")), cost=1),
    Technique("selective checkpointing", {"checkpointing": "selective"},
              "--checkpointing selective",
              "keeps only matmul and attention outputs of each block",
              "recomputes the elementwise work in backward (memory-bound, a few %)",
              False, categories=("activations",),
              apply=_set("checkpointing", "selective", lambda j: j.checkpointing == "none"),
              cost=2),
    Technique("full checkpointing", {"checkpointing": "full"}, "--checkpointing full",
              "keeps only each block's input; one block is recomputed at a time",
              "recomputes each block's forward: about +1/3 of the matmul FLOPs",
              False, categories=("activations",), apply=_set("checkpointing", "full"), cost=3),
    Technique("micro-batch 1", {"batch_size": 1, "grad_accum": "larger"},
              "--batch-size 1 --grad-accum A",
              "the smallest activations; the effective batch stays the same",
              "the most, smallest steps: GPUs run below their best rate",
              False, categories=("activations", "inputs", "temporary"), apply=_batch_one,
              cost=2),
    Technique("optimizer in backward", {"optimizer_in_backward": True},
              "--optimizer-in-backward",
              "each gradient is stepped and freed as soon as it exists: no whole-model "
              "gradients (one GPU or zero1, no accumulation)",
              "about the same: the same step, run inside backward",
              False, categories=("gradients",),
              apply=_set("optimizer_in_backward", True, lambda j: j.grad_accum == 1), cost=0),
    Technique("ZeRO-2", {"parallel": {"strategy": "zero2"}}, "--strategy zero2 -n N",
              "optimizer states and gradients sharded over data-parallel GPUs",
              "reduce-scatter + all-gather instead of all-reduce: about the same traffic",
              False, categories=("optimizer_states", "gradients"), apply=_zero2, cost=1),
    Technique("sync each micro-batch", {"parallel": {"fsdp_no_sync": False}},
              "--no-fsdp-no-sync",
              "FSDP reduce-scatters each micro-batch's gradients and keeps its shard, not "
              "every whole fp32 gradient until the last micro-batch (HF Trainer: "
              "accelerator_config.gradient_accumulation_kwargs.sync_each_batch)",
              "a reduce-scatter per micro-batch instead of per step, overlapped with backward",
              False, categories=("gradients",), apply=_sync_each_batch, cost=1),
    Technique("reshard after forward", {"parallel": {"reshard_after_forward": True}},
              "--reshard-after-forward",
              "FSDP frees each unit's gathered weights after its forward, not after its "
              "backward (FULL_SHARD instead of SHARD_GRAD_OP)",
              "one more all-gather of the weights per micro-batch, in backward (overlapped)",
              False, categories=("weights",), apply=_reshard, cost=1),
    Technique("FSDP / ZeRO-3", {"parallel": {"strategy": "fsdp"}}, "--strategy fsdp -n N",
              "weights, gradients and optimizer states sharded over data-parallel GPUs",
              "weights all-gathered twice per micro-batch (1.5x DDP's traffic), overlapped",
              False, categories=("weights", "optimizer_states", "gradients"), apply=_fsdp,
              cost=3),
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
              True, "lora", ("gradients", "optimizer_states", "weights"), apply=_peft("lora"),
              cost=0, planner=True),
    Technique("QLoRA", {"peft": {"method": "qlora", "rank": 16}}, "--peft qlora --lora-rank 16",
              "the frozen base in 4-bit NF4 (about 0.52 bytes per weight)",
              "dequantises each weight in forward and backward (memory-bound)",
              True, "qlora", ("weights", "gradients", "optimizer_states"), apply=_peft("qlora"),
              cost=1, planner=True),
    Technique("8-bit AdamW", {"optimizer": "adamw-8bit"}, "--optimizer adamw-8bit",
              "optimizer states 2 bytes per parameter instead of 8",
              "a faster step (fewer bytes)", True, "8bit", ("optimizer_states",),
              apply=_eight_bit, cost=0, planner=True),
    Technique("bf16 weights", {"precision": "bf16-pure"}, "--precision bf16-pure",
              "weights, gradients and optimizer states in bf16: no fp32 master copy",
              "about the same (no casts); updates round to bf16, as torchtune trains",
              True, "bf16-pure", ("weights", "gradients", "optimizer_states"),
              apply=_set("precision", "bf16-pure", lambda j: j.precision == "bf16-mixed"),
              cost=0, planner=True),
    Technique("fp8 training", {"precision": "fp8"}, "--precision fp8",
              "linears save fp8 copies of their inputs",
              "fp8 matmuls at twice the bf16 rate on GPUs with fp8 tensor cores",
              True, "fp8", ("activations",), apply=_fp8, cost=0, planner=True),
    Technique("optimizer offload", {"offload": {"optimizer": True}}, "--offload-optimizer",
              "optimizer states in CPU memory",
              "the step runs on the CPU with PCIe copies: much slower steps",
              False, "offload", ("optimizer_states",), apply=_offload_optimizer, cost=3,
              planner=True),
    Technique("activation offload", {"activation_offload": True}, "--activation-offload",
              "saved activations in pinned CPU memory",
              "PCIe copies, partly overlapped with compute",
              False, "offload", ("activations",), apply=_set("activation_offload", True),
              cost=3),
)

ALLOW_NAMES = tuple(sorted({t.allow for t in TECHNIQUES if t.allow}))


# the --allow name that lets the planner choose the global batch (not a technique: the
# planner's own search of micro-batches without accumulation)
PLANNER_ALLOW = "global-batch"


def technique(name: str) -> Technique:
    return next(t for t in TECHNIQUES if t.name == name)


def allowed(allow: tuple[str, ...] | list[str] = ()) -> list[Technique]:
    """Techniques the planner may use: those that keep the maths, and those allowed."""
    return [t for t in TECHNIQUES if t.allow is None or t.allow in allow]


def for_category(category: str, allow: tuple[str, ...] = ALLOW_NAMES) -> list[Technique]:
    """Techniques that shrink a report category (search's suggestions)."""
    return [t for t in allowed(allow) if category in t.categories]


def for_planner(allow: tuple[str, ...] | list[str] = ()) -> list[Technique]:
    """The allowed techniques the planner adds as variants (in table order)."""
    return [t for t in allowed(allow) if t.planner]
