"""Losses of the training step: the model's own, the chunked causal-LM loss, and the
stand-in for factory models without one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vramplan.job import CHUNKED_LOSS_CHUNKS


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    # The model's own loss (logits upcast to fp32 inside); the output, with its logits,
    # is dropped on return, as in Trainer.compute_loss.
    return model(**batch).loss


def chunked_causal_lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Cross-entropy over sequence chunks, each chunk's logits recomputed in backward."""
    from torch.utils.checkpoint import checkpoint
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=batch["input_ids"]).last_hidden_state
    head = base.get_output_embeddings()
    labels = nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]  # next token

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                           ignore_index=-100, reduction="sum")

    total = sum(checkpoint(chunk_loss, h, y, use_reentrant=False) for h, y in zip(
        hidden.chunk(CHUNKED_LOSS_CHUNKS, dim=1), labels.chunk(CHUNKED_LOSS_CHUNKS, dim=1)))
    return total / labels.numel()


def generic_loss(model: nn.Module, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    if isinstance(batch, dict):
        output = model(**batch)
    elif isinstance(batch, (tuple, list)):
        output = model(*batch)
    else:
        output = model(batch)
    if loss_fn is not None:
        return loss_fn(output, batch)
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if isinstance(output, (tuple, list)):
        output = output[0]
    return output.float().mean()  # stands in for the user's loss: same backward graph
