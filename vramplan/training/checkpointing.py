"""Gradient checkpointing of a Hugging Face model, by the job's named policy.

  full                      every block keeps its input and is recomputed in backward
  selective                 blocks also keep every matmul and attention output
  selective:torchtitan-op   torchtitan's op-level SAC: every second matmul recomputed
  selective:every-2nd-layer blocks 1, 3, 5, ... fully checkpointed, the others untouched
(docs/frameworks.md; the formula's side is engines/activations.py)
"""

from __future__ import annotations

import torch
from torch import nn

from vramplan.job import Job


def apply_checkpointing(model: nn.Module, job: Job, notes: list[str]) -> None:
    if job.checkpointing == "none":
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        notes.append(f"{type(model).__name__} does not support gradient checkpointing: "
                     "traced without it")
        return
    kwargs = {"use_reentrant": False}
    if job.checkpointing == "selective":
        kwargs["context_fn"] = _save_matmuls_only
    elif job.checkpointing == "selective:torchtitan-op":
        kwargs["context_fn"] = _save_every_other_matmul
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if job.checkpointing == "selective:every-2nd-layer":
        _checkpoint_every_second_block(model)


def _saved_ops() -> set:
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default}


def _save_matmuls_only():
    """Inside each block keep the outputs of matmuls and attention kernels, recompute
    everything else in backward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _save_every_other_matmul():
    """torchtitan's op policy (b5bcd76c distributed/activation_checkpoint.py, SelectiveAC):
    as _save_matmuls_only, but a count of aten.mm calls, kept per block and per pass
    (forward, recompute), recomputes each mm whose count is even. addmm (a linear with a
    bias) and bmm are saved and not counted, as there."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept, counted = _saved_ops(), {torch.ops.aten.mm.default, torch.ops.aten.linear.default}
    counts = {False: 0, True: 0}  # ctx.is_recompute -> mm count; a new one for each block call

    def policy(ctx, op, *args, **kwargs):
        if op in counted:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpoint_every_second_block(model: nn.Module) -> None:
    """torchtitan's per-layer SAC with N = 2 (removed in 114151ad4): block i (from 0, over
    all stacks in module order) is checkpointed when (i + 1) % 2 == 0."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for index, block in enumerate(blocks):
        block.gradient_checkpointing = (index + 1) % 2 == 0
