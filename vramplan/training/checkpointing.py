"""Gradient checkpointing of a Hugging Face model, as the job asks (full or selective)."""

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
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _save_matmuls_only():
    """Selective checkpointing as torchtitan's "op" policy: inside each block keep the
    outputs of matmuls and attention kernels, recompute everything else in backward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    kept = {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
