"""Optimizer states that depend on each parameter's size: block-wise low-bit states and
paged states, tensor by tensor (docs/frameworks.md has the sources).

Which layout a state gets depends on the size of its own parameter (a threshold, a block
size that must divide it), so these are summed over the trainable tensors rather than
computed from the total count.

torchao (0.19.0, torchao/optim/adam.py _new_buffer): a state is quantised when its
parameter has >= 4096 elements and a multiple of the block size, else it is a plain tensor
of the parameter's dtype. AdamW4bit (subclass_4bit.py): block 128, two 4-bit codes per
byte, one fp32 scale per block and a 16-entry fp32 code map per state. AdamWFp8
(subclass_fp8.py): block 256, one float8 code per element and one fp32 scale per block.

bitsandbytes (0.50.2.dev0, optim/optimizer.py get_state_buffer): a paged optimizer takes
the state buffers of parameters with >= 1e5 elements from cudaMallocManaged (unified
memory, outside torch's allocator); smaller ones, and the 8-bit absmax vectors, are
ordinary torch tensors. 32-bit states are fp32 whatever the parameter's dtype.
"""

from __future__ import annotations

from vramplan.engines.precision import BNB_BLOCK, BNB_MIN_8BIT_SIZE
from vramplan.models import Architecture

TORCHAO_MIN_QUANT_SIZE = 4096
TORCHAO_4BIT_BLOCK = 128
TORCHAO_4BIT_QMAP_BYTES = 16 * 4
TORCHAO_FP8_BLOCK = 256
TORCHAO_8BIT_BLOCK = 256
TORCHAO_8BIT_QMAP_BYTES = 256 * 4
BNB_PAGED_MIN_SIZE = 100_000  # get_state_buffer: `p.numel() < 1e5` stays a torch tensor

TORCHAO_STATES = ("adamw-4bit", "adamw-fp8", "adamw-8bit-torchao")
PER_TENSOR_OPTIMIZERS = (*TORCHAO_STATES, "paged-adamw", "paged-adamw-8bit")
_TORCHAO_BLOCK = {"adamw-4bit": TORCHAO_4BIT_BLOCK, "adamw-fp8": TORCHAO_FP8_BLOCK,
                  "adamw-8bit-torchao": TORCHAO_8BIT_BLOCK}

# (elements of one tensor, how many such tensors)
Tensors = list[tuple[int, int]]


def state_bytes(optimizer: str, numel: int, param_bytes: int) -> tuple[float, float]:
    """(bytes in torch's allocator, bytes in unified memory) of one parameter's states."""
    if optimizer in TORCHAO_STATES:
        block = _TORCHAO_BLOCK[optimizer]
        if numel < TORCHAO_MIN_QUANT_SIZE or numel % block:
            return 2.0 * numel * param_bytes, 0.0
        if optimizer == "adamw-4bit":
            return 2.0 * (numel / 2 + 4 * numel / block + TORCHAO_4BIT_QMAP_BYTES), 0.0
        if optimizer == "adamw-8bit-torchao":
            return 2.0 * (numel + 4 * numel / block + TORCHAO_8BIT_QMAP_BYTES), 0.0
        return 2.0 * (numel + 4 * numel / block), 0.0
    paged = numel >= BNB_PAGED_MIN_SIZE
    if optimizer == "paged-adamw":
        states = 2.0 * 4 * numel
        return (0.0, states) if paged else (states, 0.0)
    if optimizer == "paged-adamw-8bit":
        if numel < BNB_MIN_8BIT_SIZE:
            return 2.0 * 4 * numel, 0.0  # 32-bit states below min_8bit_size, never paged
        absmax = 2.0 * 4 * -(-numel // BNB_BLOCK)
        codes = 2.0 * numel
        return (absmax, codes) if paged else (absmax + codes, 0.0)
    raise ValueError(f"{optimizer} has no per-tensor state layout")


def split_state_bytes(optimizer: str, tensors: Tensors, param_bytes: int) -> tuple[float, float]:
    """(torch allocator bytes, unified memory bytes) of all trainable tensors' states."""
    torch_bytes = unified = 0.0
    for numel, count in tensors:
        in_torch, in_unified = state_bytes(optimizer, numel, param_bytes)
        torch_bytes += count * in_torch
        unified += count * in_unified
    return torch_bytes, unified


def full_model_tensors(arch: Architecture, task: str) -> Tensors:
    """Every parameter of the model: block linears by shape, the embedding (and an untied
    LM head) as matrices; the rest of a block (norms, biases) as hidden-size vectors."""
    tensors: Tensors = []
    for stack in arch.stacks:
        linear = 0
        for ln in stack.linears:
            tensors.append((ln.in_features * ln.out_features, stack.num_layers * ln.count))
            linear += ln.in_features * ln.out_features * ln.count
        _add_vectors(tensors, (stack.params_per_layer - linear) * stack.num_layers,
                     stack.hidden_size)
    hidden = arch.stacks[-1].hidden_size if arch.stacks else 1
    outside = arch.total_params(task) - sum(s.params_per_layer * s.num_layers
                                            for s in arch.stacks)
    if arch.vocab_size and arch.stacks:
        matrices = 1 if arch.tied_embeddings or not arch.head_params.get(task) else 2
        tensors.append((arch.vocab_size * hidden, matrices))
        outside -= matrices * arch.vocab_size * hidden
    _add_vectors(tensors, outside, hidden)
    return tensors


def lora_tensors(arch: Architecture, targets: set[str], rank: int, head: int) -> Tensors:
    """LoRA's A (rank x in) and B (out x rank) per targeted linear, and a trained head."""
    tensors: Tensors = []
    for stack in arch.stacks:
        for ln in stack.linears:
            if "all-linear" in targets or ln.name in targets:
                n = stack.num_layers * ln.count
                tensors += [(rank * ln.in_features, n), (ln.out_features * rank, n)]
    if head:
        tensors.append((head, 1))
    return tensors


def _add_vectors(tensors: Tensors, params: int, width: int) -> None:
    if params <= 0:
        return
    full, rest = divmod(params, max(width, 1))
    if full:
        tensors.append((width, full))
    if rest:
        tensors.append((rest, 1))
