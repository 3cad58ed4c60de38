"""Bytes moved by the memory-bound work of a training step, and how many kernels it takes.

Matmuls are compute-bound at training sizes and are timed from their FLOPs (flops.py);
everything else streams tensors through HBM and is timed from the bytes it reads and
writes. Each entry below counts the passes an eager PyTorch / Hugging Face step makes over
a tensor (a pass = one read or one write of every element), with the kernel that makes
them; they are counts of what the code does, not fitted numbers:

  norms        HF RMSNorm: upcast, pow, mean, rsqrt-mul, downcast, weight-mul (6 kernels);
               LayerNorm: one fused kernel (read x, write y)
  casts        autocast casts each matmul's fp32 weight (and an fp32 input) to 16-bit in
               forward, once per linear call; QLoRA dequantises each 4-bit weight in
               forward and again in backward (bitsandbytes MatMul4Bit)
  rotary       q * cos + rotate_half(q) * sin: slice, neg, cat, 2 muls, add (6 kernels)
  activation   act(gate) * up, or gelu(x); dropout reads, writes and keeps a 1-byte mask
  residual     x + f(x): read 2, write 1
  softmax      eager attention: mask add, fp32 softmax, downcast (flash kernels fuse it)
  lora         x @ A (rank r) and its B are memory-bound: they stream x and the output
  dora         the magnitude's scaling of the base and adapter outputs; in forward only,
               the weight-side work of the column norm (eye, delta, weight casts)
  loss         logits upcast, log_softmax, nll, and their gradients over tokens x vocab
  optimizer    per trainable element: the bytes of the optimizer's own kernels
               (OPTIMIZER_STEPS: torch's loop / foreach / fused, transformers' Adafactor,
               bitsandbytes'), clip_grad_norm's norm and scale

Compiled (job.compile, training/compiled.py): Inductor fuses each elementwise chain into one
kernel that reads its inputs once and writes what is kept once: a norm reads the residual
and writes its 16-bit output (the input casts fused in), rotary (where the model has it)
reads q and k and writes them rotated, eager attention's softmax (and dropout) reads the
scores and writes the probabilities, dropout before a residual add writes only its mask,
act(gate) * up reads both and writes the product; the compiled loss reads the
logits for its max and log-sum-exp and writes nothing token x vocab, and its backward reads
them once and writes their gradient.

Backward runs each elementwise op's gradient: about twice its forward traffic (it reads
the saved input and the output gradient and writes the input gradient). Recomputation
(checkpointing) runs the forward elementwise work again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vramplan.engines.precision import (
    adapter_bytes,
    dtypes_for,
    eager_torchao_nf4,
    frozen_base_bytes,
)
from vramplan.engines.step import Step, describe_step, dora_linears, lora_linears
from vramplan.job import Job
from vramplan.models import Architecture, Stack, load_architecture

# Passes over the tensor per op, forward (see the module docstring).
RMSNORM_PASSES_FP32 = 7      # upcast(r,w) pow(r,w) mean(r) mul(r,w) ... counted in fp32
GATED_ACTIVATION_PASSES = 5  # act(gate): r c, w c; * up: r 2c, w c (per intermediate element)
# the eager loss over fp32 logits: log_softmax reads twice and writes (r 4 x2, w 4), its
# gradient the same; nll's gradient writes one fp32 element
LOG_SOFTMAX_BYTES = 12
NLL_GRAD_BYTES = 4
ROTARY_PASSES = 12           # 6 kernels, each read + write
BACKWARD_OVER_FORWARD = 2.0  # elementwise gradients: read saved input + grad, write grad
# One optimizer step, by (optimizer, optimizer_impl; None: the library has one), read from
# the libraries' code and counted on it by benchmarks/optimizer_ops.py (torch 2.13,
# transformers 5.24, bitsandbytes 0.50.2): bytes read and written per trainable element
# with fp32 and with 16-bit states; kernels per 2-D and per 1-D tensor of a per-tensor
# loop; the tensor lists of each foreach / fused op it launches over all tensors at once
# (foreach_launches); whether it synchronises the device after every tensor (so its host
# and device time add). torch: optim/adamw.py, adam.py, sgd.py, _adafactor.py;
# "adafactor" "loop" is transformers' Adafactor (optimization.py, a per-tensor loop: what
# the HF Trainer's optim="adafactor" builds, with scale_parameter and relative_step off),
# which upcasts 16-bit parameters and gradients to fp32 (3 kernels more a tensor);
# "lion" and the 8-bit and paged AdamWs are bitsandbytes' (optim/optimizer.py
# Optimizer8bit.step: one kernel per tensor, then sync_gpu); tensors under 4096 elements
# keep 32-bit states there, counted as 8-bit.


@dataclass(frozen=True)
class OptimizerStep:
    bytes_fp32: float
    bytes_16bit: float
    per_matrix: int = 0          # kernels per 2-D tensor
    per_vector: int = 0          # kernels per 1-D tensor
    lists: tuple[int, ...] = ()  # each foreach / fused op's tensor lists
    vector_lists: tuple[int, ...] | None = None  # ... over the 1-D tensors, where they are
    #                                              grouped apart (torch's Adafactor)
    device_steps: bool = False   # its step counters live on the GPU: one more foreach add
    upcasts: int = 0             # more kernels per tensor with 16-bit parameters
    syncs: bool = False          # a device synchronisation after every tensor


_ADAMW_FOREACH = (1, 2, 1, 3, 2, 1, 1, 3)  # mul_ (decay), lerp_, mul_, addcmul_, sqrt, div_,
#                                           add_ (eps), addcdiv_
_BNB = dict(per_matrix=1, per_vector=1, syncs=True)
OPTIMIZER_STEPS: dict[tuple[str, str | None], OptimizerStep] = {
    ("adamw", "loop"): OptimizerStep(80, 40, 8, 8),
    ("adamw", "foreach"): OptimizerStep(80, 40, lists=_ADAMW_FOREACH),
    ("adamw", "fused"): OptimizerStep(28, 14, lists=(4,), device_steps=True),  # _fused_adamw_
    ("adam", "loop"): OptimizerStep(72, 36, 7, 7),
    ("adam", "foreach"): OptimizerStep(72, 36, lists=_ADAMW_FOREACH[1:]),
    ("adam", "fused"): OptimizerStep(28, 14, lists=(4,), device_steps=True),
    ("sgd", "loop"): OptimizerStep(12, 6, 1, 1),
    ("sgd", "foreach"): OptimizerStep(12, 6, lists=(2,)),
    ("sgd", "fused"): OptimizerStep(12, 6, lists=(2,)),
    ("sgd-momentum", "loop"): OptimizerStep(32, 16, 3, 3),
    ("sgd-momentum", "foreach"): OptimizerStep(32, 16, lists=(1, 2, 2)),
    ("sgd-momentum", "fused"): OptimizerStep(20, 10, lists=(3,)),
    # transformers' Adafactor: a factored second moment for a matrix, a full one for a vector
    ("adafactor", "loop"): OptimizerStep(84, 102, 24, 16, upcasts=3),
    # torch's: norms, the factors' outer product and a mean per tensor, 13 foreach ops (one
    # of which takes the per-tensor path), and two .item() syncs per tensor (16-bit bytes
    # not counted: half the fp32 ones assumed)
    ("adafactor", "foreach"): OptimizerStep(76, 38, 7, 3, lists=(2, 1, 2, 2, 1, 2, 1, 1, 1,
                                                                 2, 1, 2),
                                            vector_lists=(3, 2, 1, 1, 2, 1, 2), syncs=True),
    ("lion", None): OptimizerStep(20, 14, **_BNB),               # read p g m, write p m
    ("adamw-8bit", None): OptimizerStep(16, 10, **_BNB),         # 8-bit states, read+written
    ("paged-adamw-8bit", None): OptimizerStep(16, 10, **_BNB),
    ("paged-adamw", None): OptimizerStep(28, 22, **_BNB),        # fp32 states
}
# torch's foreach and fused kernels launch through multi_tensor_apply (torch 2.13
# ATen/native/cuda/MultiTensorApply.cuh): each tensor is cut in chunks of 65536 elements,
# and one launch takes at most max_chunks of them and at most max_tensors[d] tensors of d
# lists; by the CUDA major version torch is built with (Runtime.torch_cuda; before 13 the
# kernel arguments are limited to 4 KiB)
FOREACH_CHUNK = 65536
FOREACH_LIMITS = {12: (320, (110, 64, 48, 36, 30)), 13: (2240, (770, 448, 336, 252, 210))}


def foreach_launches(elements: float, tensors: int, lists: int, cuda: int = 13) -> int:
    """CUDA launches of one foreach op over `tensors` tensors of `elements` in all: the
    chunks (each tensor's last one partial, half full on average) or the tensors, whichever
    fills the launches first."""
    max_chunks, max_tensors = FOREACH_LIMITS[min(max(cuda, 12), 13)]
    chunks = math.ceil(elements / FOREACH_CHUNK) + tensors // 2
    return max(math.ceil(chunks / max_chunks), math.ceil(tensors / max_tensors[lists - 1]))


# The ops whose tensors are as wide as the residual stream: tensor parallelism without
# sequence parallelism runs them whole on every rank (the others split over heads or width)
HIDDEN_WIDE_OPS = ("norm", "input cast", "residual", "dropout")
# torchao AdamW4bit / AdamWFp8 (torchao 0.18 optim/adam.py): one torch.compile'd
# single_param_adam call per parameter tensor. Beside p and g (read p g, write p): both
# states read and written at their width (4-bit 2 bytes per element, fp8 4), plus the
# full-size intermediates Inductor materialises, and the loop nests per call, as
# benchmarks/torchao_optim_codegen.py reads them from Inductor's (CPU) code for a
# 1M-element parameter: 4-bit 50 bytes (an int64 code index and an fp32 block copy per
# state), 12 loop nests; fp8 none, 4 loop nests.
TORCHAO_ADAM = {"adamw-4bit": (2 + 50, 12), "adamw-fp8": (4, 4),
                # AdamW8bit: 8-bit states (4) + two fp32 full-size intermediates (16); 11 nests
                "adamw-8bit-torchao": (4 + 16, 11)}
CLIP_PASSES = 3  # clip_grad_norm_: the norm reads each grad; the scale reads and writes it


@dataclass
class Traffic:
    """Bytes and kernel launches of memory-bound work, per phase of one micro-batch
    (optimizer: per optimizer step), for one model replica before TP/CP sharding."""

    bytes: dict[str, float] = field(default_factory=lambda: {
        "forward": 0.0, "backward": 0.0, "recompute": 0.0, "optimizer": 0.0})
    kernels: dict[str, float] = field(default_factory=lambda: {
        "forward": 0.0, "backward": 0.0, "recompute": 0.0, "optimizer": 0.0})
    by_op: dict[str, float] = field(default_factory=dict)  # op -> bytes (all phases)
    by_op_phase: dict[tuple[str, str], float] = field(default_factory=dict)  # (op, phase)
    # nn.Module calls (Python __call__, hooks) per micro-batch; backward calls no module
    modules: dict[str, float] = field(default_factory=lambda: {
        "forward": 0.0, "backward": 0.0, "recompute": 0.0, "optimizer": 0.0})
    # the optimizer synchronises the device after every tensor: its host and device add
    synchronised: bool = False

    def add(self, op: str, phase: str, nbytes: float, kernels: float = 1.0) -> None:
        self.bytes[phase] += nbytes
        self.kernels[phase] += kernels
        self.by_op[op] = self.by_op.get(op, 0.0) + nbytes
        self.by_op_phase[op, phase] = self.by_op_phase.get((op, phase), 0.0) + nbytes


def step_traffic(job: Job, arch: Architecture | None = None, *,
                 step: Step | None = None) -> Traffic:
    """Bytes moved by the non-matmul work of one micro-batch (and of one optimizer step)."""
    arch = arch or load_architecture(job.model)
    step = step or describe_step(job, arch)
    task, shapes, dt, params = step.task, step.shapes, step.activations, step.params
    t = Traffic()
    attention = step.attention
    recompute = job.checkpointing != "none"
    for stack, seq in zip(arch.stacks, shapes.stack_seq):
        fwd, bwd, kernels = _block_forward(job, arch, stack, seq, dt, attention)
        for op, nbytes in fwd.items():
            n = stack.num_layers
            t.add(op, "forward", n * nbytes, 0)
            t.add(op, "backward", n * bwd[op], 0)
            if recompute:
                t.add(op, "recompute", n * nbytes, 0)
        linear_fwd, linear_bwd = _linear_kernels(job, arch, stack, dt)
        if job.peft is None:  # norm weights (and biases): their gradients' AccumulateGrad
            linear_bwd += arch.norms_per_block(stack) * (2 if stack.norm == "layernorm" else 1)
        t.kernels["forward"] += stack.num_layers * (kernels + linear_fwd)
        t.kernels["backward"] += stack.num_layers * (kernels * BACKWARD_OVER_FORWARD
                                                     + linear_bwd)
        if recompute:
            t.kernels["recompute"] += stack.num_layers * (kernels + linear_fwd)
        calls = stack.num_layers * block_modules(job, arch, stack)
        t.modules["forward"] += calls
        if recompute:
            t.modules["recompute"] += calls
    t.modules["forward"] += OUTSIDE_MODULES
    _loss(job, arch, task, shapes, dt, t)
    _weights(job, arch, params, t)
    if job.precision == "fp8":
        _float8_casts(job, arch, shapes, dt, t)
    _dora_weights(job, arch, dt, t)
    _saved_copies(job, arch, params, job.batch_size * shapes.stack_seq[0], dt, t)
    _optimizer(job, _stepped_elements(job, arch, params), _trainable_tensors(job, arch), t)
    return t


def _stepped_elements(job: Job, arch: Architecture, params) -> float:
    """Trainable elements in the adapters' dtype (_optimizer's unit): modules_to_save
    copies, kept in the base's dtype, count at their bytes' share."""
    if not params.saved_copy:
        return params.trainable
    elements = len(job.peft.modules_to_save) * arch.vocab_size * arch.stacks[-1].hidden_size
    nbytes = len(job.peft.modules_to_save) * params.saved_copy
    return params.trainable - elements + nbytes / adapter_bytes(job)


def _saved_copies(job: Job, arch: Architecture, params, tokens: int, dt, t: Traffic) -> None:
    """peft's modules_to_save copies: the token embedding's dense gradient (zeroed, then
    each token's row added), and accumulation into .grad between micro-batches."""
    if not params.saved_copy:
        return
    saved = job.peft.modules_to_save
    h = arch.stacks[-1].hidden_size
    per = params.saved_copy / (arch.vocab_size * h)  # the copy's bytes per element
    if "embed_tokens" in saved:
        rows = tokens * h * (dt.compute + 2 * per)  # read each token's gradient, add it in
        t.add("embedding grad", "backward", params.saved_copy + rows, 2)
    if job.grad_accum > 1:
        t.add("grad accumulate", "backward", 3 * len(saved) * params.saved_copy, len(saved))


OUTSIDE_MODULES = 4  # the model, the embedding, the final norm, the head


def block_modules(job: Job, arch: Architecture, stack: Stack) -> float:
    """nn.Module calls of one block's forward: its linears (each expert of an MoE), norms,
    activation, dropouts, the block and its attention and MLP containers, LoRA's A, B and
    dropout per adapted linear."""
    linears = sum(_calls(arch, ln) for ln in stack.linears)
    dropouts = 3 if (arch.hidden_dropout or arch.attention_dropout) else 0
    adapted = 0
    if job.peft is not None:
        targets = set(job.peft.target_modules)
        adapted = sum(ln.count for ln in stack.linears
                      if "all-linear" in targets or ln.name in targets)
    return linears + arch.norms_per_block(stack) + 1 + dropouts + 3 + 3 * adapted


def eager_norm_bytes(norm: str, r: int, c: int) -> int:
    """Bytes an eager norm moves per element of its r-byte input and c-byte output: HF's
    RMSNorm in its fp32 passes, LayerNorm's one fused kernel (read, write)."""
    return r + RMSNORM_PASSES_FP32 * 4 + 2 * c if norm == "rmsnorm" else r + c


def _block_forward(job: Job, arch: Architecture, stack: Stack, seq: int, dt, attention: str):
    """Forward and backward bytes per op of one block, and its forward kernel count."""
    b, c, r = job.batch_size, dt.compute, dt.residual
    tokens = b * seq
    h, a, k, d = stack.hidden_size, stack.num_heads, stack.num_kv_heads, stack.head_dim
    routed = stack.experts_per_token if stack.num_experts > 1 else 1
    n_h, n_q, n_kv = tokens * h, tokens * a * d, tokens * k * d
    n_f = tokens * stack.intermediate_size * routed
    ops: dict[str, float] = {}
    back: dict[str, float] = {}
    kernels = 0.0

    def add(op: str, nbytes: float, launches: float, backward: float | None = None) -> None:
        """`backward`: the op's gradient bytes where they are not BACKWARD_OVER_FORWARD
        times its forward's."""
        nonlocal kernels
        ops[op] = ops.get(op, 0.0) + nbytes
        back[op] = back.get(op, 0.0) + (BACKWARD_OVER_FORWARD * nbytes if backward is None
                                        else backward)
        kernels += launches

    norms = arch.norms_per_block(stack)
    # self-attention, and cross-attention's scores taken as long as the decoder's
    attentions = [seq] + ([seq] if stack.cross_attention else [])
    residuals = len(attentions) + 1
    if job.compiles_blocks:
        add("norm", norms * n_h * (r + c), norms)
        if arch.traits.rotary:
            add("rotary", 2 * c * (n_q + n_kv), 1)
        for s_k in attentions:
            if attention == "eager":
                # one kernel reads the scores and writes the probabilities (scale, mask,
                # softmax and dropout fused), with dropout's 1-byte mask
                mask = 1 if arch.attention_dropout > 0 else 0
                add("softmax", b * a * seq * s_k * (2 * c + mask), 1)
                add("attention io", c * (3 * n_q + 2 * n_q), 2)  # the bmms' head transposes
            else:
                add("attention io", c * (2 * n_q + 2 * n_kv), 1)
        # dropout fuses into each residual add: only its 1-byte mask is written
        mask = 1 if arch.hidden_dropout > 0 else 0
        add("residual", residuals * (3 * r + mask) * n_h, residuals)
        add("activation", (3 if stack.mlp == "gated" else 2) * c * n_f, 1)
        if job.peft is not None:
            _lora_compiled(job, stack, tokens, c, add)
        return ops, back, kernels
    if stack.norm == "rmsnorm":
        add("norm", norms * n_h * eager_norm_bytes("rmsnorm", r, c), norms * 6)
    else:
        add("norm", norms * n_h * eager_norm_bytes("layernorm", r, c), norms)
    if dt.autocast and r == 4:  # each linear casts its fp32 input to 16-bit on its own
        inputs = sum(1 for ln in stack.linears if ln.role in ("attn_in", "mlp_in", "cross_q"))
        add("input cast", inputs * n_h * (4 + c), inputs)
    if arch.traits.rotary:
        add("rotary", ROTARY_PASSES * c * (n_q + n_kv), 6)
    for s_k in attentions:
        if attention == "eager":
            scores = b * a * seq * s_k
            # mask add (r c, w c), upcast (r c, w 4), softmax (r 4, w 4), downcast (r 4, w c)
            add("softmax", scores * (4 * c + 16), 4)
            if arch.positions == "alibi":  # the bias is one more add over the scores
                add("softmax", scores * 2 * c, 1)
            if arch.attention_dropout > 0:
                add("attention dropout", scores * (2 * c + 1), 1)
            add("attention io", c * (3 * n_q + 2 * n_q), 4)  # repeat_kv, transposes
        else:
            # flash / memory-efficient: read q, k, v, write o (and an fp32 logsumexp)
            add("attention io", c * (2 * n_q + 2 * n_kv), 1)
    add("residual", residuals * 3 * r * n_h, residuals)
    if stack.mlp == "gated":
        add("activation", n_f * GATED_ACTIVATION_PASSES * c, 2)
    else:
        act = arch.traits.activation
        passes = 16 if act == "gelu_new" else 2   # gelu_new: 8 Python-level kernels
        add("activation", n_f * passes * c, passes // 2)
    if arch.hidden_dropout > 0:
        drops = residuals + (1 if stack.mlp == "relu" else 0)
        add("dropout", drops * n_h * (2 * c + 1), drops)
    if stack.num_experts > 1:  # gather tokens to experts, scatter-add them back, router
        launches = (GROUPED_MOE_KERNELS if arch.traits.stacked_experts
                    else 6 + 4 * stack.num_experts)
        add("moe routing", 4 * c * tokens * routed * h + 8 * tokens * stack.num_experts,
            launches)
    if job.peft is not None:
        _lora(job, stack, tokens, dt, add)
    return ops, back, kernels


def _linear_kernels(job: Job, arch: Architecture, stack: Stack, dt) -> tuple[float, float]:
    """Kernels of a block's linears (matmuls included), forward and backward.

    Forward: the matmul (bias fused in addmm), and under autocast with fp32 weights a cast
    of the weight and one of the bias. Backward of a trained linear: the input-gradient and
    weight-gradient matmuls, the bias gradient's reduction, and AccumulateGrad's copy of
    each gradient into .grad (a cast to fp32 under autocast)."""
    fwd = bwd = 0.0
    for ln in stack.linears:
        n = _calls(arch, ln)
        params = 1 + ln.bias
        casts = params if dt.autocast and job.peft is None else 0
        fwd += n * (1 + casts)
        if job.peft is None:
            bwd += n * (2 + ln.bias + params)
        else:
            bwd += n  # the input gradient only
    return fwd, bwd


# DeepSeek's router and grouped-matmul experts (transformers 5,
# integrations/moe.py grouped_mm_experts_forward and DeepseekV3TopkRouter.forward), kernels
# besides the two grouped matmuls: router linear, sigmoid, bias add, group top-2, sum, group
# top-k, zeros, scatter, masked fill, top-k, gather, sum, add, divide, scale (15); sort,
# gather of the tokens, of their weights, histc, cumsum, weighting, inverse permutation
# (empty, arange, index_put), reorder, sum over k, cast (12)
GROUPED_MOE_KERNELS = 27


def _calls(arch: Architecture, ln) -> int:
    """Launches (and module calls) of one linear of a block: one per expert, except for
    experts kept as one stacked parameter (Traits.stacked_experts), one grouped matmul."""
    return 1 if ln.count == 1 or arch.traits.stacked_experts else ln.count


def _lora_compiled(job: Job, stack: Stack, tokens: int, c: int, add) -> None:
    """Each adapted linear's adapter path in a compiled block: the scale and the add to the
    base output fuse into one kernel (read both outputs, write the sum); the dropout's
    output and the two matmuls' stay in memory, as the matmuls read and write them."""
    r = job.peft.rank
    dropout = job.peft.dropout > 0
    for ln in lora_linears(job, stack):
        n_in, n_out = tokens * ln.in_features, tokens * ln.out_features
        drop = n_in * (2 * c + 1) if dropout else 0.0
        add("lora", drop + c * (n_in + 2 * tokens * r) + c * n_out * 4,
            3 + (1 if dropout else 0))
    _dora(job, stack, tokens, c, add)


def _lora(job: Job, stack: Stack, tokens: int, dt, add) -> None:
    """Each adapted linear's adapter path as peft's eager Linear runs it, forward and
    backward (benchmarks/traffic_vs_dispatch.py counts both from a dispatched step):
    x cast to the adapters' dtype (peft's _cast_input_dtype), dropout in that dtype, x @ A
    (autocast casts its input back to 16-bit first), @ B, the scale, and the add to the base
    output (in the promoted dtype, cast back when the adapters are fp32 without autocast).
    Backward: the scale's gradient, B's and A's input- and weight-gradient matmuls (each
    reads the output's gradient or the input once), every cast and the dropout once more,
    and the add of the adapter's input gradient into x's."""
    r, c, a = job.peft.rank, dt.compute, adapter_bytes(job)
    m = c if dt.autocast else a  # the adapter matmuls' dtype, and their output's
    promoted = max(c, m)  # the base output (16-bit) plus the adapter output
    for ln in lora_linears(job, stack):
        n_in, n_out = tokens * ln.in_features, tokens * ln.out_features
        small = 2 * tokens * r * m  # x A written, read by B
        # A reads its input; B writes; scale (r, w); add (r both, w the sum)
        fwd = n_in * m + small + n_out * (m + 2 * m + c + m + promoted)
        # scale's gradient (r, w); B's two matmuls read it; A's write its input gradient
        # and read its input; the add into x's gradient (r 2, w 1)
        bwd = n_out * 4 * m + 2 * small + n_in * (2 * m + 3 * c)
        launches = 5  # A, B, scale, add, and the dropout (eager counts its launch anyway)
        cast_sum = n_out * (promoted + c)  # the sum back to 16-bit; backward, two casts:
        # the sum's gradient to fp32, and the base branch's back to 16-bit
        # (taken, forward bytes, backward bytes, launches beyond those five)
        steps = [(c != a, n_in * (c + a), n_in * (c + a), 1),  # x to the adapters' dtype
                 (job.peft.dropout > 0, n_in * (2 * a + 1), n_in * (2 * a + 1), 0),
                 (dt.autocast and a != c, n_in * (a + c), n_in * (a + c), 1),  # for x @ A
                 (promoted != c, cast_sum, 2 * cast_sum, 1)]
        for taken, forward, backward, extra in steps:
            if taken:
                fwd, bwd, launches = fwd + forward, bwd + backward, launches + extra
        add("lora", fwd, launches, backward=bwd)
    _dora(job, stack, tokens, c, add)


def _dora(job: Job, stack: Stack, tokens: int, c: int, add) -> None:
    """DoRA's output-side work in each adapted linear, beside its LoRA path."""
    for ln in dora_linears(job, stack):
        # (m / norm - 1) base, (m / norm) lora_out, x scaling, their sum, + result: 5 kernels
        # of one read or two and one write over tokens x out
        add("dora", 10 * c * tokens * ln.out_features, 9)


def _dora_weights(job: Job, arch: Architecture, dt, t: Traffic) -> None:
    """DoRA's weight-side work in each adapted linear's forward (and recompute), which no
    backward follows (the norm is detached): eye(in) and its cast, the delta's passes (its
    cast to x's dtype, the scale, the sum, the norm's read), the weight in x's dtype (QLoRA:
    dequantised first) and, with dropout, F.linear's own cast of it (engines/formula/dora.py)."""
    a, w, c = adapter_bytes(job), frozen_base_bytes(job), dt.compute
    cast = dt.autocast and c != a
    qlora = job.peft is not None and job.peft.method == "qlora"
    dropout = job.peft is not None and job.peft.dropout > 0
    for stack in arch.stacks:
        for ln in dora_linears(job, stack):
            n, eye = ln.in_features * ln.out_features, ln.in_features ** 2
            lora_out = c if dt.autocast else a
            nbytes = (eye * (a + (a + c if cast else 0))
                      + n * (lora_out + 6 * a + (lora_out + a if lora_out != a else 0))
                      + (n * (w + a) if w != a else 0) + (n * (0.5 + c) if qlora else 0)
                      + (n * (w + c) if dropout and (dt.autocast or qlora) else 0))
            phases = ("forward", "recompute") if job.checkpointing != "none" else ("forward",)
            for phase in phases:
                t.add("dora weights", phase, stack.num_layers * nbytes, stack.num_layers * 10)


def _loss(job: Job, arch: Architecture, task: str, shapes, dt, t: Traffic) -> None:
    tv = shapes.loss_tokens * arch.vocab_size
    if not tv:
        return
    c = dt.compute
    if job.compiles_loss:  # logits written, read for max and log-sum-exp; backward: r c, w c
        t.add("loss", "forward", 3 * c * tv, 2)
        t.add("loss", "backward", 2 * c * tv, 1)
        return
    if job.loss == "chunked:liger":
        # each chunk's logits written by the matmul, read and overwritten by their gradient
        # in one Triton kernel (engines/formula/loss.py); backward scales grad_input only
        t.add("loss", "forward", 3 * c * tv, 5)
        return
    # forward: logits written, fp32 upcast (r c w 4), log_softmax (r 4 x2, w 4), nll;
    # backward: nll grad (w 4), log_softmax grad (r 4 x2, w 4), downcast (r 4 w c)
    forward = tv * (c + c + 4 + LOG_SOFTMAX_BYTES)
    backward = tv * (NLL_GRAD_BYTES + LOG_SOFTMAX_BYTES + 4 + c)
    t.add("loss", "forward", forward, 5)
    t.add("loss", "backward", backward, 5)
    if job.loss == "chunked":
        t.add("loss", "recompute", forward, 5)


def _weights(job: Job, arch: Architecture, params, t: Traffic) -> None:
    """Per micro-batch work on the weights themselves: autocast casts, QLoRA dequantising,
    gradient accumulation into .grad."""
    dt = dtypes_for(job)
    linear = sum(s.num_layers * sum(ln.in_features * ln.out_features * ln.count
                                    for ln in s.linears) for s in arch.stacks)
    if job.peft is None:
        if dt.autocast:  # fp32 -> 16-bit copy of each matmul weight per forward
            t.add("weight cast", "forward", linear * (4 + dt.linear_saved), 0)
            if job.checkpointing != "none":
                t.add("weight cast", "recompute", linear * (4 + dt.linear_saved), 0)
        # the weight-gradient matmul's output is added into .grad (fp32 under autocast)
        t.add("grad accumulate", "backward", params.trainable * (dt.compute + 2 * dt.grad), 0)
    elif job.peft.method == "qlora":
        # each NF4 weight is dequantised to 16-bit in forward and again for the input
        # gradient in backward (and in recomputation)
        per_element, kernels = nf4_dequantise_cost(job)
        phases = ("forward", "backward") + (("recompute",) if job.checkpointing != "none"
                                            else ())
        for phase in phases:
            t.add("dequantise", phase, linear * per_element, kernels * _linear_count(arch))


# bitsandbytes' dequantize_4bit: one kernel reads the packed codes (0.5 B) and the absmax and
# writes the 16-bit weight (2 B); with double quantisation a second small one for the absmax
BNB_DEQUANTISE = (0.5 + 2, 2)
# torchao's NF4Tensor.get_original_weight, eager (torchao 0.18 quantization/quantize_/
# workflows/nf4/nf4_tensor.py, which torchtune bd2a0fc7's linear_nf4 calls through
# weight.to(dtype)): (op, bytes read, bytes written, kernels) per weight element. The two
# halves of each byte become int64 indices into the 16-value table, the table lookups
# write 16-bit halves, the double-quantised scalers (one int8 per 64 weights) are expanded
# and flattened into a copy per half, multiplied in, and the halves interleaved by a stack.
# benchmarks/nf4_dequantise.py counts the ops on torchao's own code and checks this table
TORCHAO_NF4_EAGER = (
    ("quantized_data >> 4", 0.5, 0.5, 1),
    (".to(torch.long)", 0.5, 4.0, 1),
    ("quantized_data & 0b1111", 0.5, 0.5, 1),
    (".to(torch.long)", 0.5, 4.0, 1),
    ("nf4[first], nf4[second]", 2 * 4.0, 2 * 1.0, 2),
    ("dequantize_scalers: int8 / factor, + mean", (1 + 2) / 64, (2 + 2) / 64, 2),
    ("repeated.flatten(), once per half", 2 * 2 / 64, 2 * 1.0, 2),
    ("scaled_first, scaled_second = half * repeated", 2 * 2.0, 2 * 1.0, 2),
    ("torch.stack", 2.0, 2.0, 1),
)


def nf4_dequantise_cost(job: Job) -> tuple[float, int]:
    """Bytes moved per weight element and kernels per linear of dequantising one NF4 weight
    to 16 bits: bitsandbytes' fused kernel, or torchao's eager ops (TORCHAO_NF4_EAGER:
    about 13x the bytes); compiled blocks fuse torchao's too, assumed as one pass like
    bitsandbytes' (torch.compile traces the NF4 subclass; not read from Inductor's code)."""
    if not eager_torchao_nf4(job):
        return BNB_DEQUANTISE
    return (sum(read + written for _, read, written, _ in TORCHAO_NF4_EAGER),
            sum(kernels for *_, kernels in TORCHAO_NF4_EAGER))


# the roles of block linears that read the same tensor (the attention's and the MLP's input)
SHARED_INPUT_ROLES = ("attn_in", "mlp_in")


def float8_cast_bytes(c: int, compiled: bool, produced: bool = True) -> tuple[float, int]:
    """Bytes per element and kernels of one dynamic float8 cast of a c-byte tensor (torchao
    0.18 float8/float8_scaling_utils.py hp_tensor_to_float8_dynamic, tensorwise). Eager:
    amax = max(abs(x)) (abs r c w c, max r c), then x.to(fp32) * scale, clamp, .to(fp8)
    (r c w 4, r 4 w 4, r 4 w 4, r 4 w 1): 4c + 25 bytes, 6 kernels. Compiled, one fused
    kernel (benchmarks/float8_codegen.py): a tensor the step `produced` (an activation, a
    gradient) has its amax taken by the kernel that wrote it, which reads it once more and
    writes fp8: c + 1; a weight, which no kernel of the step writes, is read for its amax and
    again for the cast: 2c + 1."""
    if not compiled:
        return 4 * c + 25, 6
    return (c + 1 if produced else 2 * c + 1), 1


def _float8_casts(job: Job, arch: Architecture, shapes, dt, t: Traffic) -> None:
    """torchao Float8Linear (precision fp8, engines/precision.py) casts per block linear
    (float8/float8_linear.py matmul_with_hp_or_float8_args, torchao 0.18): forward its
    16-bit input and fp32 weight; backward the output gradient twice (for the input and the
    weight gradient), the weight again and the saved 16-bit input again; recomputation
    repeats the forward's. Compiled, linears that read one tensor (q, k and v; gate and up)
    share its cast: Inductor computes the identical cast once (benchmarks/float8_codegen.py).
    With fp8.fsdp_float8_all_gather each rank casts its own shard of a weight before FSDP
    gathers it in float8 (torchao float8/fsdp_utils.py fsdp_pre_all_gather), forward and
    again for backward's gather, and the gathered weight is not cast again.
    rowwise_with_gw_hp computes the weight gradient from the 16-bit input and output
    gradient (Float8LinearConfig.from_recipe_name: those two casts disabled): backward
    casts the output gradient once and the input not again."""
    compiled = job.compiles_blocks
    gw_hp = job.fp8.recipe == "rowwise_with_gw_hp"
    c, w = dt.compute, 4  # Float8Linear keeps the fp32 weight (no autocast copy)
    act_b, act_k = float8_cast_bytes(c, compiled)
    weight_b, weight_k = float8_cast_bytes(w, compiled, produced=False)
    phases = ("forward", "recompute") if job.checkpointing != "none" else ("forward",)
    shards = job.parallel.shard_degree if job.fp8.fsdp_float8_all_gather else 1
    for stack, seq in zip(arch.stacks, shapes.stack_seq):
        tokens = job.batch_size * seq
        cast_inputs: set[str] = set()
        for ln in stack.linears:
            rows = tokens * (stack.experts_per_token if ln.count > 1 else 1)
            n_out = rows * ln.out_features
            # the input's cast (and recast): once per shared input when compiled
            shared = compiled and ln.count == 1 and ln.role in SHARED_INPUT_ROLES
            n_in = 0 if shared and ln.role in cast_inputs else rows * ln.in_features
            if shared:
                cast_inputs.add(ln.role)
            weights = ln.in_features * ln.out_features * ln.count / shards
            calls = stack.num_layers * _calls(arch, ln)
            layers = stack.num_layers
            input_k = calls * act_k if n_in else 0
            for phase in phases:
                t.add("fp8 input cast", phase, layers * n_in * act_b, input_k)
                t.add("fp8 weight cast", phase, layers * weights * weight_b, calls * weight_k)
            grads = 1 if gw_hp else 2
            t.add("fp8 grad cast", "backward", layers * grads * n_out * act_b,
                  calls * grads * act_k)
            if not gw_hp:
                t.add("fp8 input recast", "backward", layers * n_in * act_b, input_k)
            t.add("fp8 weight cast", "backward", layers * weights * weight_b, calls * weight_k)


def _linear_count(arch: Architecture) -> int:
    return sum(s.num_layers * len(s.linears) for s in arch.stacks)


def _trainable_tensors(job: Job, arch: Architecture) -> tuple[int, int]:
    """(2-D, 1-D) parameter tensors the optimizer steps: its kernel launches scale with them."""
    targets = set(job.peft.target_modules) if job.peft else set()
    matrices = vectors = 0
    for s in arch.stacks:
        if job.peft is None:  # weights; biases and norm weights
            matrices += s.num_layers * len(s.linears)
            vectors += s.num_layers * (sum(ln.bias for ln in s.linears) + arch.norms_per_block(s))
        else:  # lora_A and lora_B of each adapted linear
            matrices += s.num_layers * sum(2 for ln in s.linears
                                           if "all-linear" in targets or ln.name in targets)
    if job.peft is None:
        return matrices + 2, vectors + 1  # embeddings and head; the final norm
    return matrices + len(job.peft.modules_to_save), vectors


def _optimizer(job: Job, trainable: float, tensors: tuple[int, int], t: Traffic) -> None:
    dt = dtypes_for(job)
    matrices, vectors = tensors
    count = matrices + vectors
    # the trained weights' dtype (LoRA adapters': adapter_bytes) is their gradients'; a
    # state is the master copy's dtype, else the weights' (Dtypes.state_bytes)
    grad = adapter_bytes(job) if job.peft is not None else dt.weight
    state = dt.master or grad
    t.add("clip", "optimizer", CLIP_PASSES * grad * trainable, 4)
    if dt.master:  # 16-bit gradients to fp32, and the updated fp32 masters back to 16-bit
        t.add("master copies", "optimizer", 2 * (grad + dt.master) * trainable, 2 * count)
    if job.optimizer in TORCHAO_ADAM:
        states, kernels = TORCHAO_ADAM[job.optimizer]
        t.add("optimizer", "optimizer", (3 * state + states) * trainable, kernels * count)
        return
    cost = optimizer_step(job)
    sixteen = state < 4
    kernels = (cost.per_matrix * matrices + cost.per_vector * vectors
               + (cost.upcasts * count if sixteen else 0))
    # foreach ops over the GPU's share of the elements, every tensor at once (the 1-D ones
    # apart where they are grouped apart: their elements are few); the step counters have
    # one element each
    par = job.parallel
    on_gpu = trainable / (par.tensor_parallel * par.shard_degree)
    cuda = job.runtime.torch_cuda
    if cost.vector_lists is None:
        kernels += sum(foreach_launches(on_gpu, count, n, cuda) for n in cost.lists)
    else:
        kernels += (sum(foreach_launches(on_gpu, matrices, n, cuda) for n in cost.lists
                        if matrices)
                    + sum(foreach_launches(vectors, vectors, n, cuda) for n in cost.vector_lists
                          if vectors))
    if cost.device_steps:
        kernels += foreach_launches(count, count, 1, cuda)
    t.add("optimizer", "optimizer", (cost.bytes_16bit if sixteen else cost.bytes_fp32)
          * trainable, kernels)
    t.synchronised |= cost.syncs


def optimizer_step(job: Job) -> OptimizerStep:
    """The job's optimizer step as its library runs it (OPTIMIZER_STEPS)."""
    return (OPTIMIZER_STEPS.get((job.optimizer, None))
            or OPTIMIZER_STEPS.get((job.optimizer, job.optimizer_impl))
            or OPTIMIZER_STEPS[(job.optimizer, "foreach")])  # no fused kind: foreach
