"""Job: the one description of a training job that every entry point builds.

Precedence when several sources set a field: CLI flags > job file > defaults.
Validation collects every problem and reports them together, each saying what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vramplan.errors import JobError, JobFileError, validation_message
from vramplan.files import parse_mapping, read_capped_text
from vramplan.units import parse_bytes

DEFAULT_MODEL = "llama-3.1-8b"

Task = Literal[
    "causal-lm", "masked-lm", "seq-classification", "seq2seq", "image-classification",
    "speech-seq2seq",
]
# bf16-master / fp16-master: a 16-bit model whose optimizer keeps fp32 master weights
# (DeepSpeed's bf16 / fp16, Apex AMP O2); engines/precision.py says what each keeps
Precision = Literal["fp32", "fp16-mixed", "bf16-mixed", "bf16-pure", "fp8", "bf16-master",
                    "fp16-master"]
# the master-weight precision of each autocast one (the same 16-bit dtype)
MASTER_OF = {"bf16-mixed": "bf16-master", "fp16-mixed": "fp16-master"}
MASTER_PRECISIONS = tuple(MASTER_OF.values())
# optimizers a master-weight step runs on its fp32 copies (the low-bit ones keep their own
# states and have no master-weight path in DeepSpeed or Apex)
MASTER_OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adafactor", "lion")
Optimizer = Literal[
    "sgd", "sgd-momentum", "adam", "adamw", "adamw-8bit", "paged-adamw-8bit", "adafactor", "lion",
    # bitsandbytes PagedAdamW (32-bit states in CUDA unified memory); torchao AdamW4bit,
    # AdamWFp8 and AdamW8bit (block-wise 4-bit / float8 / 8-bit states; docs/frameworks.md)
    "paged-adamw", "adamw-4bit", "adamw-fp8", "adamw-8bit-torchao",
]
OptimizerImpl = Literal["foreach", "fused", "loop"]
# full: each block keeps its input and is recomputed in backward. selective: a block also
# keeps the outputs of every matmul and attention kernel. selective:torchtitan-op:
# torchtitan's op-level SAC, which recomputes every second matmul of a block.
# selective:every-2nd-layer: full checkpointing of every second block (torchtitan's
# per-layer SAC with N = 2), the other blocks keep everything.
Checkpointing = Literal["none", "selective", "full", "selective:torchtitan-op",
                        "selective:every-2nd-layer"]
# the modes torch's selective activation checkpointing runs (a policy called on every op)
OP_LEVEL_CHECKPOINTING = ("selective", "selective:torchtitan-op")
# eager: the scores are materialised (matmul, softmax, dropout, matmul). The others are
# fused kernels that keep q, k, v, the output and the softmax statistics only (the same
# memory); they differ in speed. sdpa: torch's scaled_dot_product_attention, which picks
# its kernel per GPU (planning/efficiency.py attention_kernel); flash-attn-2 / -3: the
# flash-attn package (transformers' flash_attention_2 / _3, Axolotl's flash_attention,
# LLaMA-Factory's fa2 / fa3); cudnn: cuDNN's fused attention (Transformer Engine, or SDPA
# forced to its CUDNN_ATTENTION backend)
Attention = Literal["eager", "sdpa", "flash-attn-2", "flash-attn-3", "cudnn"]
FUSED_16_BIT_ONLY = ("flash-attn-2", "flash-attn-3", "cudnn")  # no fp32 kernels
# chunked: vramplan's own (8 checkpointed sequence chunks); chunked:torchtune-linear:
# torchtune's LinearCrossEntropyLoss (output projection + CE per chunk, not checkpointed);
# chunked:torchtune-output: torchtune's CEWithChunkedOutputLoss (the model returns 8 chunks);
# chunked:liger: Liger-Kernel's fused linear cross-entropy (the Trainer's use_liger_kernel,
# Axolotl's liger_fused_linear_cross_entropy): chunks of the head and the loss, their
# gradients computed in forward, no logits kept (engines/formula/loss.py)
Loss = Literal["standard", "chunked", "chunked:torchtune-linear", "chunked:torchtune-output",
               "chunked:liger"]
CHUNKED_LOSS_CHUNKS = 8  # chunks of the sequence the chunked loss scores one at a time
Strategy = Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp", "hybrid-shard"]
PeftMethod = Literal["lora", "qlora"]
# whole modules trained beside LoRA adapters (peft's modules_to_save), by Hugging Face's
# Llama names: the token embedding and the LM head
SavedModule = Literal["embed_tokens", "lm_head"]
# ... and what other models call them (transformers' modeling files: Llama / Mistral / Qwen2
# / Gemma / OPT embed_tokens and lm_head, GPT-2 / Qwen / MPT wte, BLOOM / Falcon
# word_embeddings, GPT-NeoX embed_in and embed_out, T5 shared; torchtune's tok_embeddings
# and output), read as the same module
SAVED_MODULE_NAMES = {"embed_tokens": "embed_tokens", "wte": "embed_tokens",
                      "word_embeddings": "embed_tokens", "embed_in": "embed_tokens",
                      "shared": "embed_tokens", "tok_embeddings": "embed_tokens",
                      "lm_head": "lm_head", "embed_out": "lm_head", "output": "lm_head"}
# 1f1b: one forward one backward (PipeDream-Flush, Megatron-LM's default); interleaved:
# each GPU runs pipeline_chunks model chunks (Megatron-LM's virtual pipeline stages); gpipe:
# every micro-batch's forward, then every backward (torch.distributed.pipelining's
# ScheduleGPipe, torchtitan's "GPipe"): 1F1B's bubble, all micro-batches in flight
PipelineSchedule = Literal["1f1b", "interleaved", "gpipe"]
CHUNKED_SCHEDULES = ("interleaved",)  # the schedules that read pipeline_chunks
# the dtype data parallelism's gradient collectives move: grad, the gradients' own (fp32
# under autocast over fp32 weights, 16-bit in a 16-bit model); compute, the 16-bit compute
# dtype (FSDP's MixedPrecision reduce_dtype = param_dtype, as Accelerate sets it; DDP's
# bf16 compression hook; DeepSpeed's communication_data_type bf16); or a dtype itself
# (torchtitan's mixed_precision_reduce, Megatron-Core's fp32 main_grad of a bf16 model)
GradReduceDtype = Literal["grad", "compute", "fp32", "bf16", "fp16"]
# The training framework whose defaults the job takes (vramplan/frameworks/profiles.toml)
# What torch.compile compiles (torchtitan's compile.components: "model" = the blocks, "loss";
# torchtitan before bbb1b616e, 2025-04-02, compiled the blocks only)
CompileComponents = Literal["blocks+loss", "blocks", "loss"]
Framework = Literal["plain", "hf-trainer", "torchtune", "torchtitan", "lightning", "accelerate"]
AdapterDtype = Literal["fp32", "model"]
# whose 4-bit NF4 tensors hold a QLoRA base: bitsandbytes' Linear4bit (peft, the HF stack)
# or torchao's NF4Tensor (torchtune): the same bytes stored, different dequantising kernels
QuantLibrary = Literal["bitsandbytes", "torchao"]
# torchao float8 training recipes (torchao/float8/config.py, Float8LinearRecipeName) and
# MXFP8 (torchao/prototype/moe_training/mxfp8_linear.py, MXFP8Linear; Blackwell only)
Fp8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"]
# both engines refuse it (formula/checks.py, training/kernels.py trace_kernels)
COMPILED_MXFP8_REFUSED = ("compiled blocks with fp8 recipe mxfp8 are not modelled: set "
                          "compile_components=loss (blocks eager), drop compile, or use "
                          "--engine measure on a GPU with torchao")


class _RaisesJobError(type(BaseModel)):
    """Job(...) raises JobError in place of pydantic's ValidationError. (A custom __init__
    would do the same but pydantic would then call it for nested parts too.)"""

    def __call__(cls, *args: Any, **kwargs: Any):
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as error:
            raise _job_error(cls, error) from None


def _is_number(annotation: Any) -> bool:
    """int, float, or either of them or None."""
    args = set(get_args(annotation)) - {type(None)} or {annotation}
    return args <= {int, float}


class _Strict(BaseModel, metaclass=_RaisesJobError):
    """Refuses unknown keys; bad values raise JobError (not pydantic's ValidationError), so
    `except VramplanError` catches every bad job however it is built."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        """pydantic reads true as 1 (batch_size: true is batch 1): a boolean where a number
        belongs is a mistake, so it is refused by name."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if isinstance(value, bool) and field is not None and _is_number(field.annotation):
                    raise ValueError(f"{name}: {str(value).lower()} is a boolean; give a number")
        return data

    @classmethod
    def model_validate(cls, obj: Any, **options: Any):
        try:
            return super().model_validate(obj, **options)
        except ValidationError as error:
            raise _job_error(cls, error) from None

    @classmethod
    def model_validate_json(cls, json_data: Any, **options: Any):
        try:
            return super().model_validate_json(json_data, **options)
        except ValidationError as error:
            raise _job_error(cls, error) from None


class Peft(_Strict):
    """Parameter-efficient fine-tuning: LoRA adapters, or QLoRA (LoRA on a 4-bit NF4 base)."""

    method: PeftMethod = "lora"
    rank: int = Field(16, ge=1, le=4096)
    alpha: float = Field(32.0, gt=0, le=1_000_000, allow_inf_nan=False)
    dropout: float = Field(0.05, ge=0, lt=1)
    # peft's names: module names inside a block, or "all-linear" for every linear in blocks
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    double_quant: bool = True  # QLoRA: quantise the 4-bit blocks' absmax constants too
    quant_library: QuantLibrary = "bitsandbytes"  # QLoRA: whose NF4 kernels (QuantLibrary)
    # DoRA (peft's use_dora): a trained magnitude per output feature; each forward rebuilds
    # the weight's column norms and keeps the base and adapter outputs (engines/formula/dora.py)
    dora: bool = False
    # dtype of the adapters, their gradients and optimizer states: fp32 (peft's
    # autocast_adapter_dtype) or the model's dtype (torchtune). None: fp32, except in a
    # bf16-pure job, where the adapters stay bf16.
    adapter_dtype: AdapterDtype | None = None
    # a trainable copy of each, as peft's modules_to_save makes (the frozen original stays),
    # with its gradients and optimizer states in the copy's dtype: e.g. new tokens' rows
    modules_to_save: tuple[SavedModule, ...] = ()

    @field_validator("modules_to_save", mode="before")
    @classmethod
    def _each_once(cls, names: Any) -> Any:
        """A model's own name (GPT-2's wte) as the module it is; each once, as peft copies a
        module once however often it is named."""
        if isinstance(names, (list, tuple)):
            return tuple(dict.fromkeys(SAVED_MODULE_NAMES.get(n, n) if isinstance(n, str)
                                       else n for n in names))
        return names


# the strategies PyTorch runs with FSDP (vramplan/training/fsdp.py)
FSDP_STRATEGIES = ("zero2", "zero3", "fsdp", "hybrid-shard")
# the strategies that shard the parameters themselves (reshard_after_forward, offload.params)
SHARDED_STRATEGIES = ("zero3", "fsdp", "hybrid-shard")
# FSDP's own parallel settings and the strategies that have them: another strategy drops
# them when a layout changes (Parallel.changed, planning/layouts.py own_settings)
FSDP_OWN_FIELDS = {"fsdp_no_sync": FSDP_STRATEGIES,
                   "reshard_after_forward": SHARDED_STRATEGIES}


class Parallel(_Strict):
    """How the job is spread over GPUs. num_gpus = data x tensor x context x pipeline
    parallel."""

    strategy: Strategy = "none"
    num_gpus: int = Field(1, ge=1, le=1_000_000)
    gpus_per_node: int = Field(8, ge=1, le=1024)  # hybrid-shard shards within a node
    # the cluster's network between nodes, per GPU, one direction, decimal GB/s (e.g. 8 x
    # 400 Gb/s NICs for 8 GPUs: 50); None: the GPU catalog's usual server (gpus.toml)
    network_gb_s: float | None = Field(None, gt=0, le=10_000)
    tensor_parallel: int = Field(1, ge=1, le=1024)
    context_parallel: int = Field(1, ge=1, le=1024)
    # pipeline stages: each holds a contiguous share of the blocks (the embedding on the
    # first, the head on the last); the micro-batches of a step (grad_accum) flow through
    pipeline_parallel: int = Field(1, ge=1, le=1024)
    pipeline_schedule: PipelineSchedule = "1f1b"
    pipeline_chunks: int = Field(2, ge=2, le=64)  # interleaved: model chunks per GPU
    # pipeline schedules per step: its grad_accum micro-batches run as this many schedules
    # of grad_accum / pipeline_flushes, each filling and draining the pipeline (torchtitan
    # runs one per gradient-accumulation step; Megatron-LM one per step)
    pipeline_flushes: int = Field(1, ge=1, le=1_000_000)
    # how many blocks' worth the token embedding and the head count for when the blocks are
    # split into stages (torchtitan's pipeline_parallel_first/last_stage_less_layers, 1 each
    # by default: the first and last stages hold that many blocks fewer, the earlier stages
    # take what does not divide). 0 and 0: every stage holds ceil(blocks / stages), as
    # Megatron-LM's even split does (engines/pipeline.py)
    pipeline_embedding_layers: int = Field(0, ge=0, le=64)
    pipeline_head_layers: int = Field(0, ge=0, le=64)
    # tensor parallelism splits the norms, dropouts and residual stream over its ranks too
    # (sequence parallelism: torchtitan always; Megatron-LM's --sequence-parallel, off by
    # default there). False: each tensor-parallel rank keeps them whole and does their work
    sequence_parallel: bool = True
    # tensor-parallel collectives overlapped with the GEMMs beside them (torchtitan's async
    # TP, Megatron-LM's --tp-comm-overlap); False: on the critical path (planning/comm.py)
    async_tp: bool = False
    # gradient all-reduce / reduce-scatter overlapped with the backward (PyTorch DDP and
    # FSDP, Megatron-LM's --overlap-grad-reduce, DeepSpeed's overlap_comm); False: after it,
    # on the critical path (Megatron-LM without the flag, DeepSpeed ZeRO 0-2 by default)
    overlap_grad_reduce: bool = True
    # FSDP/ZeRO shard over data-parallel x context-parallel ranks, as torchtitan's dp_shard_cp
    # mesh does (distributed/parallel_dims.py); False: over data-parallel ranks only
    shard_over_context_parallel: bool = False
    # FSDP (zero2 / zero3 / fsdp / hybrid-shard) with gradient accumulation: reduce-scatter
    # only a step's last micro-batch's gradients (FSDP2's set_requires_gradient_sync(False),
    # FSDP's no_sync: what the HF Trainer and Accelerate do unless sync_each_batch), holding
    # every parameter's whole gradient in fp32 until then. False: every micro-batch's
    # gradients are reduce-scattered and sharded (torchtitan)
    fsdp_no_sync: bool = False
    # FSDP2's reshard_after_forward (zero3 / fsdp / hybrid-shard): False keeps each unit's
    # gathered parameters from its forward until its backward, so the backward gathers
    # nothing (torchtitan's fsdp_reshard_after_forward 'never', and its 'default' under a
    # pipeline); zero2 never reshards
    reshard_after_forward: bool = True
    # the dtype the gradient all-reduce / reduce-scatter moves (GradReduceDtype): its bytes
    # and so its time (planning/comm.py); the memory counted stays the framework's default
    # gradients (a unit's transient cast buffer is left out)
    grad_reduce_dtype: GradReduceDtype = "grad"

    def changed(self, **changes: Any) -> dict[str, Any]:
        """This layout's fields with `changes`, to build a Job from: a strategy without
        FSDP's gradient-sync switch drops fsdp_no_sync, one that shards no parameters
        reshard_after_forward, unless `changes` set them (the framework's profile decides
        them again in Job.with_changes)."""
        data = {**self.model_dump(exclude_unset=True), **changes}  # unset stays unset
        strategy = changes.get("strategy", self.strategy)
        for name, strategies in FSDP_OWN_FIELDS.items():
            if strategy not in strategies and name not in changes:
                data.pop(name, None)
        return data

    @property
    def defers_gradient_sync(self) -> bool:
        """FSDP reduce-scatters only the last micro-batch's gradients, holding whole ones
        until then: no_sync asked for (fsdp_no_sync), or a pipeline, whose stages run every
        micro-batch but a schedule's last with FSDP2's gradient sync and its resharding after
        backward off (torch 2.13 distributed/pipelining/stage.py backward_maybe_with_nosync,
        perform_reduce_grad)."""
        return self.fsdp_no_sync or (self.strategy in FSDP_STRATEGIES
                                     and self.pipeline_parallel > 1)

    @property
    def gathers_once_per_schedule(self) -> bool:
        """Each FSDP unit's parameters are gathered in a pipeline schedule's first forward
        and held to its end: no reshard after forward, nor (the pipeline's) after backward."""
        return (self.strategy in SHARDED_STRATEGIES and self.pipeline_parallel > 1
                and not self.reshard_after_forward)

    @property
    def model_parallel(self) -> int:
        """GPUs that hold one copy of the model between them: tensor x context x pipeline."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel

    @property
    def data_parallel(self) -> int:
        return self.num_gpus // self.model_parallel

    @property
    def shard_degree(self) -> int:
        """How many ranks share one copy of sharded state (1 = nothing sharded)."""
        ranks = self.data_parallel * (self.context_parallel if self.shard_over_context_parallel
                                      else 1)
        if self.strategy == "hybrid-shard":
            return min(ranks, self.gpus_per_node)
        return ranks if self.strategy in ("zero1", "zero2", "zero3", "fsdp") else 1

    @model_validator(mode="after")
    def _check(self) -> Parallel:
        model_parallel = self.model_parallel
        if self.num_gpus % model_parallel:
            raise ValueError(
                f"num_gpus={self.num_gpus} is not a multiple of tensor_parallel x "
                f"context_parallel x pipeline_parallel = {model_parallel}")
        if self.data_parallel > 1 and self.strategy == "none":
            raise ValueError(
                f"{self.data_parallel} data-parallel ranks need a strategy: "
                "ddp, zero1, zero2, zero3, fsdp or hybrid-shard")
        if not self.reshard_after_forward and self.strategy not in SHARDED_STRATEGIES:
            raise ValueError(
                f"reshard_after_forward is FSDP's: strategy {self.strategy} shards no "
                "parameters (FSDP's SHARD_GRAD_OP is strategy fsdp with "
                "reshard_after_forward false); use zero3, fsdp or hybrid-shard or drop it")
        if self.fsdp_no_sync and self.strategy not in FSDP_STRATEGIES:
            raise ValueError(
                f"fsdp_no_sync is FSDP's: strategy {self.strategy} has no such switch (ddp "
                f"already reduces once per step); use {', '.join(FSDP_STRATEGIES)} or drop it")
        return self


class Float8(_Strict):
    """How precision fp8 runs the block linears: torchao's float8 training
    (docs/frameworks.md has the source of each setting)."""

    recipe: Fp8Recipe = Field("tensorwise", description="tensorwise / rowwise / "
                              "rowwise_with_gw_hp: torchao Float8Linear's scaling; mxfp8: "
                              "torchao MXFP8Linear, 32-element blocks with e8m0 scales "
                              "(Blackwell, compute capability 10.0+)")
    fsdp_float8_all_gather: bool = Field(False, description="FSDP2 all-gathers the block "
                                         "linears' weights in float8 (torchao "
                                         "enable_fsdp_float8_all_gather; tensorwise only)")


class Offload(_Strict):
    """CPU offload (ZeRO-Offload / FSDP CPUOffload) of optimizer states and parameters."""

    optimizer: bool = False
    params: bool = False


class Runtime(_Strict):
    """Memory the framework holds beyond tensors; documented defaults, override when measured.

    cuda_context_bytes: NVML's used memory beyond torch's reserved memory: the CUDA context
      and loaded kernels (lazy module loading) plus what the driver reserves, which NVML
      counts as used. 1390 MiB measured on an H200 (driver 580, CUDA 13.0, torch 2.11: 615
      MiB driver-reserved + 767 MiB context; benchmarks/results/gpu_runtime_probe.json);
      other GPUs are not measured yet: left at this default, each GPU gets the H200's
      figure with the driver's share scaled to its memory (engines/runtime.py,
      runtime_context_bytes); any other value is used as given on every GPU.
    allocator_overhead: reserved / allocated - 1 of the caching allocator at the peak
      (fragmentation and cached blocks), if known (from a measure run, say). None: the
      formula plans it from the step's transient memory (activations and temporaries at
      the peak), by checkpointing mode; the trace replays the allocator instead.
    cublas_workspaces: cuBLAS workspaces held (one per thread x stream that runs a matmul:
      the forward thread and the autograd thread), each 8.125 MiB, 32 MiB on sm90+
      (aten/src/ATen/cuda/CublasHandlePool.cpp).
    torch_cuda: the CUDA major version torch was built with (torch.version.cuda): from 13
      each foreach / fused optimizer launch takes 7x the chunks and tensors (torch 2.13
      ATen/native/cuda/MultiTensorApply.cuh), so a step launches fewer kernels. 13: torch
      2.11 and later as pip installs it (our H200 runs: 2.11.0+cu130); 12 for older builds.
    """

    cuda_context_bytes: int = Field(1390 * 1024**2, ge=0, le=1024**4)  # at most 1 TiB
    allocator_overhead: float | None = Field(None, ge=0, le=1)
    cublas_workspaces: int = Field(2, ge=0, le=64)
    torch_cuda: int = Field(13, ge=11, le=13)

    @field_validator("cuda_context_bytes", mode="before")
    @classmethod
    def _size_with_unit(cls, value: Any) -> Any:
        """Job files and --cuda-context may give a size with its unit, e.g. '1.2GiB'."""
        if isinstance(value, str):
            try:
                return parse_bytes(value)
            except JobError as error:
                raise ValueError(str(error)) from None
        return value


class Job(_Strict):
    """What is trained, and how. Build one from Python, a job file, or CLI flags.

    >>> job = Job(model="llama-3.1-8b", batch_size=4, seq_len=2048, precision="bf16-mixed",
    ...           peft=Peft(method="qlora", rank=16))
    """

    model: str = Field(DEFAULT_MODEL, description="catalog name, Hugging Face id, config.json "
                       "path, model folder or package.module:factory")
    # Applied when the Job is validated from its given fields; with_changes(framework=...)
    # on a built Job changes only the name, as every field is already set
    framework: Framework = Field("plain", description="the framework whose defaults fill the "
                                 "fields this job leaves unset (plain: none)")
    task: Task | None = Field(None, description="the training task; default the model's own "
                              "(causal-lm for decoders, ...)")
    batch_size: int = Field(1, ge=1, le=1_000_000, description="micro-batch per GPU")
    grad_accum: int = Field(1, ge=1, le=1_000_000, description="micro-batches per optimizer "
                            "step")
    seq_len: int | None = Field(None, ge=1, le=100_000_000, description="text tokens per "
                                "sample (encoder side for seq2seq); default min(2048, the "
                                "model's maximum)")
    target_len: int | None = Field(None, ge=1, le=100_000_000, description="seq2seq decoder "
                                   "tokens (default seq_len)")
    image_size: int | None = Field(None, ge=8, le=65536, description="vision: image side in "
                                   "pixels; default the model's own")
    audio_seconds: float | None = Field(None, gt=0, le=86_400, allow_inf_nan=False,
                                        description="speech: clip length; default the "
                                        "model's maximum")
    precision: Precision = Field("bf16-mixed", description="weights and compute dtypes "
                                 "(vramplan/engines/precision.py says what each keeps)")
    optimizer: Optimizer = Field("adamw", description="the optimizer")
    optimizer_impl: OptimizerImpl = Field("foreach", description="torch's implementation; "
                                          "foreach is its CUDA default for Adam/AdamW/SGD")
    checkpointing: Checkpointing = Field("none", description="activation checkpointing "
                                         "policy (see Checkpointing above)")
    attention: Attention = Field("sdpa", description="eager: scores materialised; sdpa: "
                                 "torch's SDPA (flash / memory-efficient / cuDNN kernels); "
                                 "flash-attn-2, flash-attn-3: the flash-attn package; cudnn: "
                                 "cuDNN's fused attention (Transformer Engine)")
    loss: Loss = Field("standard", description="how the loss holds the logits")
    peft: Peft | None = Field(None, description="LoRA / QLoRA adapters; null trains every "
                              "weight")
    optimizer_in_backward: bool = Field(False, description="step each parameter as its "
                                        "gradient arrives")
    activation_offload: bool = Field(False, description="saved activations go to pinned CPU "
                                     "memory")
    keep_grads_between_steps: bool = Field(False, description="zero_grad(set_to_none=False): "
                                           "gradients stay allocated into the next forward "
                                           "(torch < 2.0's default; torchtitan)")
    tf32: bool = Field(False, description="fp32 matmuls on TF32 tensor cores (torch.backends."
                       "cuda.matmul.allow_tf32; the HF Trainer's tf32=True): the step time of "
                       "an fp32 job changes, its memory does not; no effect on 16-bit matmuls")
    compile: bool = Field(False, description="torch.compile of each transformer block and "
                          "of the loss (as torchtitan and torchtune compile; what is "
                          "compiled: compile_components)")
    compile_components: CompileComponents = Field(
        "blocks+loss", description="with compile: what torch.compile compiles, the blocks "
        "and the loss (torchtitan's compile.components default), the blocks only (older "
        "torchtitan), or the loss only")
    parallel: Parallel = Field(Parallel(), description="how the job is spread over GPUs")
    fp8: Float8 = Field(Float8(), description="float8 training options (precision fp8 "
                        "only)")
    offload: Offload = Field(Offload(), description="CPU offload of optimizer states and "
                             "parameters")
    runtime: Runtime = Field(Runtime(), description="memory the framework holds beyond "
                             "tensors")
    gpu: str | None = Field(None, description="the GPU to check; null checks every catalog "
                            "GPU")

    @model_validator(mode="before")
    @classmethod
    def _apply_framework(cls, data: Any) -> Any:
        """Fields the job leaves unset take its framework's defaults (profiles.toml)."""
        if isinstance(data, dict) and data.get("framework", "plain") != "plain":
            from vramplan.frameworks import apply_profile

            return apply_profile(data)
        return data

    @model_validator(mode="before")
    @classmethod
    def _family_lora_targets(cls, data: Any) -> Any:
        """LoRA without target_modules on a family whose linears have other names (T5's q, v;
        GPT-2's c_attn) takes that family's defaults, as peft does (models/lora_targets.py).
        (Defined after _apply_framework so that pydantic runs it first: a profile's own
        target default is for the q_proj family.)"""
        if not isinstance(data, dict) or data.get("peft") is None:
            return data
        peft = data["peft"]
        given = (peft.model_fields_set if isinstance(peft, BaseModel) else
                 set(peft) if isinstance(peft, dict) else {"target_modules"})
        if "target_modules" in given:
            return data
        from vramplan.models.lora_targets import family_lora_targets

        targets = family_lora_targets(data.get("model", DEFAULT_MODEL))
        if targets is None:
            return data
        peft = (peft.model_copy(update={"target_modules": targets}) if isinstance(peft, BaseModel)
                else {**peft, "target_modules": targets})
        return {**data, "peft": peft}

    @model_validator(mode="after")
    def _check_combinations(self) -> Job:
        problems = self._framework_problems()
        if self.optimizer_in_backward and self.grad_accum > 1:
            problems.append("optimizer_in_backward steps as soon as a gradient exists, so it "
                            "cannot accumulate: use grad_accum=1 or turn it off")
        if self.optimizer_in_backward and self.parallel.strategy in ("zero2", "zero3", "fsdp",
                                                                     "hybrid-shard", "ddp"):
            problems.append("optimizer_in_backward is supported on one GPU or with zero1 only")
        if self.offload.params and self.parallel.strategy not in SHARDED_STRATEGIES:
            problems.append("offload.params needs sharded parameters: strategy zero3, fsdp or "
                            "hybrid-shard")
        if self.peft and self.peft.method == "qlora" and self.precision == "fp8":
            problems.append("QLoRA computes in 16-bit; fp8 training of a 4-bit base is not "
                            "supported: use bf16-mixed or fp16-mixed")
        problems += self._fp8_problems() + self._master_problems()
        if self.optimizer in ("paged-adamw-8bit", "paged-adamw") and self.offload.optimizer:
            problems.append(f"{self.optimizer} already pages its states to the CPU; drop "
                            "offload.optimizer")
        if self.loss.startswith("chunked:torchtune") and self.framework not in (
                "torchtune", "plain"):
            problems.append(f"loss {self.loss} is torchtune's; {self.framework} does not use "
                            "it: use loss standard or chunked")
        if self.loss == "chunked:liger" and self.framework == "torchtune":
            problems.append("loss chunked:liger is Liger-Kernel's, which torchtune's recipes "
                            "do not apply: use its chunked:torchtune-linear")
        if self.loss == "chunked:liger" and self.compile:
            problems.append("loss chunked:liger with torch.compile is not modelled: drop "
                            "compile, or use loss standard")
        if self.attention in FUSED_16_BIT_ONLY and self.precision == "fp32":
            problems.append(f"attention {self.attention} runs in fp16 / bf16 only, and "
                            "precision fp32 computes in fp32: use a 16-bit precision "
                            "(bf16-mixed), or attention sdpa")
        if self.optimizer_impl == "fused" and self.optimizer in ("adafactor", "lion") :
            problems.append(f"{self.optimizer} has no fused implementation in torch: use "
                            "foreach or loop")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _fp8_problems(self) -> list[str]:
        if self.precision != "fp8":
            # (the framework's own fp8 defaults may stay on a job whose precision changed)
            return [] if self.fp8 in (Float8(), self._framework_fp8()) else [
                "fp8.recipe and fp8.fsdp_float8_all_gather apply to precision fp8 only: set "
                "precision fp8 or drop them"]
        problems = []
        if self.fp8.fsdp_float8_all_gather and self.fp8.recipe != "tensorwise":
            problems.append(f"fp8.fsdp_float8_all_gather supports the tensorwise recipe only "
                            f"(torchao Float8LinearConfig), not {self.fp8.recipe}: use "
                            "recipe tensorwise or drop it")
        if self.fp8.fsdp_float8_all_gather and self.parallel.strategy not in (
                "fsdp", "hybrid-shard"):
            problems.append("fp8.fsdp_float8_all_gather changes FSDP2's parameter all-gather: "
                            "use strategy fsdp or hybrid-shard, or drop it")
        return problems

    def _framework_fp8(self) -> Float8:
        """The fp8 options the job's framework sets by default."""
        from vramplan.frameworks import get_profile

        settings = get_profile(self.framework).settings
        return Float8(**{name.removeprefix("fp8."): setting.value
                         for name, setting in settings.items() if name.startswith("fp8.")})

    def _master_problems(self) -> list[str]:
        if self.precision not in MASTER_PRECISIONS:
            return []
        problems = []
        if self.optimizer not in MASTER_OPTIMIZERS:
            problems.append(f"precision {self.precision} runs the optimizer on fp32 master "
                            f"weights; {self.optimizer} keeps low-bit states of its own: use "
                            f"one of {', '.join(MASTER_OPTIMIZERS)}, or precision bf16-pure "
                            "or bf16-mixed")
        if self.optimizer_in_backward:
            problems.append(f"precision {self.precision} steps the fp32 master weights after "
                            "backward: drop optimizer_in_backward")
        return problems

    def _framework_problems(self) -> list[str]:
        if self.framework == "plain":
            return []
        from vramplan.frameworks import profile_problems

        fields = {"parallel.strategy": self.parallel.strategy, "optimizer": self.optimizer,
                  "loss": self.loss, "peft.method": self.peft.method if self.peft else None,
                  "fp8.recipe": self.fp8.recipe if self.precision == "fp8" else None,
                  "fp8.fsdp_float8_all_gather": self.fp8.fsdp_float8_all_gather
                  if self.precision == "fp8" else None,
                  "compile_components": self.compile_components if self.compile else None,
                  "parallel.fsdp_no_sync": self.parallel.fsdp_no_sync}
        problems = profile_problems(self.framework, fields)
        if self.framework == "torchtune" and self.activation_offload and (
                self.checkpointing == "none"):
            problems.append("torchtune offloads activations only with activation "
                            "checkpointing on: set checkpointing (full) or drop "
                            "activation_offload")
        return problems

    @property
    def compiles_blocks(self) -> bool:
        """torch.compile runs each transformer block as a compiled graph."""
        return self.compile and "blocks" in self.compile_components

    @property
    def compiles_loss(self) -> bool:
        """torch.compile runs the loss as a compiled graph."""
        return self.compile and "loss" in self.compile_components

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step across all data-parallel ranks."""
        return self.batch_size * self.grad_accum * self.parallel.data_parallel

    def with_changes(self, **changes: Any) -> Job:
        """A copy with fields changed, validated again (search and sweeps use this). The
        framework's conditional defaults the change leaves alone are decided again for the
        changed job (frameworks/profiles.py redecide_conditional)."""
        # what the job left unset stays unset (a node size from the GPU catalog, not 8)
        data = {**self.model_dump(exclude_unset=True), **changes}
        if data.get("framework") == self.framework != "plain":
            from vramplan.frameworks.profiles import redecide_conditional

            data = redecide_conditional(self.framework, self, changes, data)
        return Job.model_validate(data)


# --- building a Job from dicts and files, with errors a person can act on -------------------


def job_from_dict(data: dict[str, Any], origin: str = "job") -> Job:
    """Validate a plain dict (a job file's content, CLI overrides) into a Job."""
    try:
        return Job.model_validate(data)
    except JobError as error:
        raise JobError(f"{origin}: {error}") from None


def _job_error(model: type[BaseModel], error: ValidationError) -> JobError:
    return JobError(validation_message(error.errors(), model))


def load_job_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML, TOML or JSON job file into a dict; errors name the file and line."""
    path = Path(path)
    text = read_capped_text(path, "job file", JobFileError, "a job file holds a few dozen lines")
    return parse_mapping(text, path, "job file", JobFileError)[0]


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge overrides (CLI flags) onto base (file); None means 'not given'."""
    merged = dict(base)
    for key, value in overrides.items():
        if value is None:
            continue
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def choices() -> dict[str, list[str]]:
    """Every choice of a Job (a field whose type is a Literal of names) and its allowed
    values, the default first, keyed by its path ("precision", "parallel.strategy"): what
    the web page's selects offer, so a value added to the Job reaches them; and under
    "fsdp_strategies" the strategies that have FSDP's gradient-sync switch, under
    "sharded_strategies" those that shard the parameters (reshard_after_forward), under
    "chunked_schedules" the pipeline schedules that read pipeline_chunks."""
    out = {}
    for prefix, model in (("", Job), ("parallel.", Parallel)):
        for name, field in model.model_fields.items():
            if get_origin(field.annotation) is Literal:
                values = list(get_args(field.annotation))
                out[prefix + name] = [field.default] + [v for v in values if v != field.default]
    out["fsdp_strategies"] = list(FSDP_STRATEGIES)  # where parallel.fsdp_no_sync applies
    out["sharded_strategies"] = list(SHARDED_STRATEGIES)
    out["chunked_schedules"] = list(CHUNKED_SCHEDULES)  # where parallel.pipeline_chunks applies
    return out
