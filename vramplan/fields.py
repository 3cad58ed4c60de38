"""One table of Job fields and their flags: the CLI's job options (cli/options.py), the
command that reproduces a job (report/command.py), the changes a plan or make-it-fit
prints (planning/changes.py) and the web's exports all read it.

    >>> field_for(("parallel", "tensor_parallel")).written
    '--tp'

A field's option is --NAME (plus `short` names); `flag` is how commands are written back
(--tp rather than --tensor-parallel). Booleans also take --no-NAME.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobField:
    name: str                     # the option's name: --batch-size for batch_size
    path: tuple[str, ...]         # where the value goes in the Job
    short: tuple[str, ...] = ()   # extra option names (-b, --tp)
    flag: str = ""                # written back as ("": --NAME)
    text: bool = False            # the Job parses the value from text (lists, sizes)
    help: str = ""

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def written(self) -> str:
        """The flag commands are written with."""
        return self.flag or self.option

    @property
    def negative(self) -> str:
        """A boolean's flag when it is False."""
        return "--no-" + self.written[2:]


JOB_FIELDS: tuple[JobField, ...] = (
    JobField("task", ("task",), help="the training task (default: the model's own)"),
    JobField("batch_size", ("batch_size",), short=("-b",), help="micro-batch per GPU"),
    JobField("grad_accum", ("grad_accum",), help="micro-batches per optimizer step"),
    JobField("seq_len", ("seq_len",), short=("-s",), help="tokens per sample"),
    JobField("target_len", ("target_len",), help="decoder tokens (seq2seq, speech)"),
    JobField("image_size", ("image_size",), help="image side in pixels (vision)"),
    JobField("audio_seconds", ("audio_seconds",), help="clip length (speech)"),
    JobField("precision", ("precision",), short=("-p",), help="weights and compute dtypes"),
    JobField("fp8_recipe", ("fp8", "recipe"),
             help="with -p fp8: torchao's tensorwise (default), rowwise, rowwise_with_gw_hp, or"
                  " mxfp8 (Blackwell)"),
    JobField("fp8_all_gather", ("fp8", "fsdp_float8_all_gather"),
             help="with -p fp8 and fsdp: all-gather the block linears' weights in float8 "
                  "(tensorwise)"),
    JobField("optimizer", ("optimizer",), short=("-o",), help="the optimizer"),
    JobField("optimizer_impl", ("optimizer_impl",), help="torch's optimizer implementation"),
    JobField("framework", ("framework",), short=("-f",),
             help="whose defaults fill what the job leaves unset "
                  "(vramplan/frameworks/profiles.toml; docs/frameworks.md)"),
    JobField("checkpointing", ("checkpointing",),
             help="full recomputes each block; selective keeps every matmul output; "
                  "selective:torchtitan-op recomputes every second matmul; "
                  "selective:every-2nd-layer checkpoints every second block"),
    JobField("attention", ("attention",),
             help="eager: scores materialised; sdpa: torch's SDPA (its kernel per GPU); "
             "flash-attn-2 / -3: the flash-attn package; cudnn: cuDNN's fused attention"),
    JobField("loss", ("loss",), help="chunked never holds all logits at once; chunked:liger "
             "is Liger-Kernel's fused linear cross-entropy"),
    JobField("peft", ("peft", "method"), help="LoRA adapters, or QLoRA (LoRA on a 4-bit base)"),
    JobField("lora_rank", ("peft", "rank"), help="LoRA rank"),
    JobField("lora_alpha", ("peft", "alpha"), help="LoRA alpha"),
    JobField("lora_targets", ("peft", "target_modules"), text=True,
             help="comma-separated module names, or all-linear (default "
                  "q_proj,k_proj,v_proj,o_proj; GPT-2: c_attn, BERT: query,value, T5: q,v)"),
    JobField("dora", ("peft", "dora"),
             help="DoRA (peft use_dora): a trained magnitude per output; each forward rebuilds "
                  "the weights' column norms"),
    JobField("lora_dtype", ("peft", "adapter_dtype"),
             help="dtype of LoRA adapters and their states: fp32 (peft) or model (torchtune); "
                  "default fp32, 16-bit in a bf16-pure or master-weight job"),
    JobField("optimizer_in_backward", ("optimizer_in_backward",), help="step inside backward"),
    JobField("keep_grads", ("keep_grads_between_steps",),
             help="zero_grad(set_to_none=False): gradients stay allocated into the next forward"),
    JobField("tf32", ("tf32",), help="fp32 matmuls on TF32 tensor cores (time only)"),
    JobField("compile", ("compile",), help="torch.compile each transformer block and the loss"),
    JobField("activation_offload", ("activation_offload",), help="offload saved activations"),
    JobField("num_gpus", ("parallel", "num_gpus"), short=("-n",), help="GPUs in the job"),
    JobField("strategy", ("parallel", "strategy"), help="data-parallel strategy"),
    JobField("tensor_parallel", ("parallel", "tensor_parallel"), short=("--tp",), flag="--tp",
             help="tensor-parallel degree"),
    JobField("context_parallel", ("parallel", "context_parallel"), short=("--cp",), flag="--cp",
             help="context-parallel degree"),
    JobField("pipeline_parallel", ("parallel", "pipeline_parallel"), short=("--pp",), flag="--pp",
             help="pipeline-parallel stages (the blocks split between them)"),
    JobField("pipeline_schedule", ("parallel", "pipeline_schedule"),
             short=("--pp-schedule",), flag="--pp-schedule",
             help="1f1b, interleaved (--set parallel.pipeline_chunks=N chunks per GPU, "
                  "default 2), or gpipe (every forward, then every backward)"),
    JobField("fsdp_no_sync", ("parallel", "fsdp_no_sync"),
             help="FSDP reduce-scatters only a step's last micro-batch's gradients, holding "
                  "every whole fp32 gradient until then (HF Trainer / Accelerate no_sync; "
                  "default from --framework)"),
    JobField("reshard_after_forward", ("parallel", "reshard_after_forward"),
             help="FSDP frees each unit's gathered weights after its forward (default); "
                  "--no-reshard-after-forward keeps them until its backward (FSDP's "
                  "SHARD_GRAD_OP: no backward all-gather)"),
    JobField("grad_reduce_dtype", ("parallel", "grad_reduce_dtype"),
             help="the dtype the gradient all-reduce / reduce-scatter moves: grad (the "
                  "gradients' own), compute (16-bit: Accelerate's FSDP), fp32, bf16, fp16; "
                  "communication time only (default from --framework)"),
    JobField("offload_optimizer", ("offload", "optimizer"), help="optimizer states in CPU memory"),
    JobField("offload_params", ("offload", "params"), help="parameters in CPU memory (zero3/fsdp)"),
    JobField("gpu", ("gpu",), short=("-g",), help="the GPU to check (default: every catalog GPU)"),
    JobField("cuda_context", ("runtime", "cuda_context_bytes"), text=True,
             help="memory outside torch's allocator, e.g. 1.2GiB (measure shows it as context "
                  "overhead; default 1390 MiB, an H200's)"),
    JobField("allocator_overhead", ("runtime", "allocator_overhead"),
             help="formula: reserved / allocated - 1, e.g. 0.1 (default: planned by "
                  "checkpointing)"),
)
_BY_PATH = {f.path: f for f in JOB_FIELDS}


def field_for(path: tuple[str, ...]) -> JobField | None:
    """The table's row for a Job field path, None when it has no flag (use --set)."""
    return _BY_PATH.get(path)


def flag_words(path: tuple[str, ...], value: Any) -> list[str]:
    """The command-line words that set `path` to `value` ([] when it has no flag)."""
    row = field_for(path)
    if row is None or value is None:
        return []
    if isinstance(value, bool):
        return [row.written if value else row.negative]
    if isinstance(value, (list, tuple)):
        return [row.written, ",".join(str(v) for v in value)]
    return [row.written, f"{value:g}" if isinstance(value, float) else str(value)]
