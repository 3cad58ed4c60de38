"""Bytes per element by precision and optimizer: the one table every engine agrees on.

Precision semantics follow the Hugging Face Trainer / Lightning conventions:
  fp32        weights, grads, activations in fp32
  *-mixed     fp32 weights and grads, torch.autocast runs matmuls in 16-bit
  bf16-pure   everything in bf16, optimizer states too (torch keeps states in param dtype)
  fp8         as bf16-mixed, with torchao's Float8Linear in the blocks: it casts the input to
              bf16 and saves it and the fp32 weight (no copy) for backward, where it casts
              both to fp8 again (torchao float8/float8_linear.py,
              matmul_with_hp_or_float8_args, torchao 0.19); no autocast weight copies.
              Job.fp8.recipe picks torchao's scaling (tensorwise, rowwise,
              rowwise_with_gw_hp: the same saved tensors) or MXFP8Linear (mxfp8)
  bf16-master, fp16-master
              the model, its gradients and activations in 16-bit (no autocast); the
              optimizer keeps an fp32 master copy of every trainable weight and fp32 states,
              and each step copies the 16-bit gradients to fp32, frees them, updates the
              masters and copies them back: DeepSpeed's bf16 / fp16 with ZeRO (engine.py
              casts the module, zero/stage_1_and_2.py step(): flat fp32 gradient partition,
              16-bit gradients released; DeepSpeed 0.19.6) and Apex AMP O2. Megatron-Core's
              fp32 main_grad buffer is not this (it keeps fp32 gradients throughout)
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.job import MASTER_PRECISIONS, Job

# bitsandbytes block sizes, shared by the formula and the trace's low-bit stand-ins.
# 4-bit NF4 (functional.quantize_4bit; QLoRA paper sec. 2): two codes per byte and one
# absmax per 64 weights, fp32, or with double quantisation uint8 plus one fp32 per 256.
NF4_BLOCK = 64
NF4_DOUBLE_QUANT_BLOCK = 256
NF4_BYTES_PER_PARAM = 0.5 + 4 / NF4_BLOCK
NF4_DOUBLE_QUANT_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_DOUBLE_QUANT_BLOCK)

# 8-bit optimizers (optim/optimizer.py, Optimizer2State.init_state): uint8 states with one
# fp32 absmax per 256-element block; tensors under 4096 elements keep 32-bit states
# (min_8bit_size).
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of each kind of tensor under one precision setting."""

    weight: int        # a trainable parameter as stored
    grad: int          # its gradient
    compute: int       # matmul outputs and most activations
    residual: int      # the residual stream between blocks (fp32 under autocast)
    autocast: bool     # torch.autocast is active
    linear_saved: int  # bytes per element a linear saves of its input for backward
    master: int = 0    # the optimizer's master copy of a trainable element (0: none)

    @property
    def state_bytes(self) -> int:
        """An optimizer state element: the master copy's dtype, else the weight's own."""
        return self.master or self.weight


def dtypes_for(job: Job) -> Dtypes:
    p = job.precision
    if p == "fp32":
        return Dtypes(weight=4, grad=4, compute=4, residual=4, autocast=False, linear_saved=4)
    if p == "bf16-pure":
        return Dtypes(weight=2, grad=2, compute=2, residual=2, autocast=False, linear_saved=2)
    if p in MASTER_PRECISIONS:
        return Dtypes(weight=2, grad=2, compute=2, residual=2, autocast=False, linear_saved=2,
                      master=4)
    return Dtypes(weight=4, grad=4, compute=2, residual=4, autocast=True, linear_saved=2)


def sixteen_bit_model(job: Job) -> bool:
    """The model itself is stored in 16-bit (no fp32 weights, no autocast)."""
    return dtypes_for(job).weight == 2


def frozen_base_bytes(job: Job) -> int:
    """PEFT loads the frozen base in 16-bit unless the whole job is fp32 (common practice)."""
    return 4 if job.precision == "fp32" else 2


def eager_torchao_nf4(job: Job) -> bool:
    """QLoRA whose 4-bit base is torchao's NF4Tensor dequantised by its eager ops
    (peft.quant_library torchao, blocks not compiled): what its time (planning/traffic.py
    TORCHAO_NF4_EAGER) and memory (param_memory.py TORCHAO_NF4_DEQUANTISE_PEAK) cost;
    bitsandbytes' kernel, or a compiled block, is one fused pass."""
    return (job.peft is not None and job.peft.method == "qlora"
            and job.peft.quant_library == "torchao" and not job.compiles_blocks)


def adapter_bytes(job: Job) -> int:
    """Bytes per element of LoRA adapters (and their gradients): fp32 as peft upcasts them
    (autocast_adapter_dtype=True), or the model's dtype as torchtune builds them. Unset, a
    bf16-pure job keeps them in bf16 (as vramplan.training.peft asks peft to), and so does a
    master-weight job (DeepSpeed casts the whole module, adapters included)."""
    dtype = job.peft.adapter_dtype if job.peft else None
    if dtype is None:
        dtype = "model" if sixteen_bit_model(job) else "fp32"
    return 4 if dtype == "fp32" else frozen_base_bytes(job)


# Optimizer state per trainable element, in units of the parameter's own bytes ("x param")
# or in fixed bytes. Adafactor is factored per matrix and computed separately.
STATE_COPIES = {  # number of param-sized state tensors
    "sgd": 0,            # no state
    "sgd-momentum": 1,   # momentum buffer
    "adam": 2,           # exp_avg, exp_avg_sq
    "adamw": 2,
    "lion": 1,           # exp_avg only (Chen et al. 2023)
    "adafactor": 0,      # factored: see optimizer_state_bytes
    "adamw-8bit": 0,     # fixed bytes: see optimizer_state_bytes
    "paged-adamw-8bit": 0,
    # per tensor (block layouts, paging thresholds): see engines/optimizer_states.py
    "paged-adamw": 0,
    "adamw-4bit": 0,
    "adamw-fp8": 0,
    "adamw-8bit-torchao": 0,
}


def eight_bit_state_bytes(numel: int) -> float:
    """bitsandbytes 8-bit Adam: two uint8 states + two fp32 absmax per block."""
    if numel < BNB_MIN_8BIT_SIZE:
        return numel * 8.0
    return numel * 2.0 + 2 * 4 * -(-numel // BNB_BLOCK)


def optimizer_step_temp_copies(job: Job) -> float:
    """Param-sized temporaries the optimizer step allocates, as a fraction of all trainable
    params. foreach Adam materialises sqrt(exp_avg_sq) for every param at once
    (torch/optim/adam.py _multi_tensor_adam); fused kernels and 8-bit optimizers do not."""
    # bitsandbytes' kernels and torchao's compiled per-parameter step (torchao/optim/adam.py)
    # allocate no all-parameter buffer
    if job.optimizer in ("adamw-8bit", "paged-adamw-8bit", "paged-adamw", "adamw-4bit",
                         "adamw-fp8", "adamw-8bit-torchao") or job.optimizer_impl == "fused":
        return 0.0
    if job.optimizer_impl == "foreach" and job.optimizer in ("adam", "adamw", "adafactor"):
        return 1.0
    return 0.0  # loop and sgd/lion: one param at a time, see largest_param_temp
