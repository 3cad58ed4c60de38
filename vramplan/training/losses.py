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


# torchtune splits the scored tokens into 8 chunks (num_output_chunks = 8)
TORCHTUNE_CHUNKS = 8


def _decoder_and_head(model: nn.Module, batch: dict):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.get_decoder()(input_ids=batch["input_ids"]).last_hidden_state
    labels = nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]  # next token
    return hidden, base.get_output_embeddings(), labels


def _chunk_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100,
                                       reduction="sum")


def project_and_score(head: nn.Module, hidden: torch.Tensor,
                      labels: torch.Tensor) -> torch.Tensor:
    """One chunk of torchtune's LinearCrossEntropyLoss (compute_cross_entropy): the output
    projection, .float() and cross-entropy; what torchtune compiles."""
    return _chunk_ce(head(hidden), labels)


def torchtune_linear_ce_loss(model: nn.Module, batch: dict, *,
                             score: Callable = project_and_score) -> torch.Tensor:
    """torchtune's LinearCrossEntropyLoss (modules/loss/cross_entropy_loss.py, bd2a0fc7):
    the ignored positions are dropped from the flattened hidden states, which are split
    into 8 chunks; each runs the output projection, .float() and cross-entropy, eagerly
    (no checkpointing)."""
    hidden, head, labels = _decoder_and_head(model, batch)
    # torchtune selects the rows whose label is not ignored (index_select, a copy). In the
    # synthetic batch the ignored ones are each sequence's last position (the shifted-out
    # label): slicing them off copies the same rows without a data-dependent index, which
    # fake tensors cannot follow
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    labels = labels[:, :-1].reshape(-1)
    total = sum(score(head, h, y) for h, y in zip(
        hidden.tensor_split(TORCHTUNE_CHUNKS), labels.tensor_split(TORCHTUNE_CHUNKS)))
    return total / max(labels.numel(), 1)


def torchtune_chunked_output_loss(model: nn.Module, batch: dict, *,
                                  score: Callable = _chunk_ce) -> torch.Tensor:
    """torchtune's CEWithChunkedOutputLoss (ce_chunked_output_loss.py): the model returns
    its logits as 8 sequence chunks, all alive until the loss is computed; each chunk is
    upcast and scored on its own. The recipe drops the chunks before backward."""
    hidden, head, labels = _decoder_and_head(model, batch)
    logits = [head(h) for h in hidden.tensor_split(TORCHTUNE_CHUNKS, dim=1)]
    total = sum(score(x.reshape(-1, x.shape[-1]), y.reshape(-1)) for x, y in zip(
        logits, labels.tensor_split(TORCHTUNE_CHUNKS, dim=1)))
    del logits
    return total / labels.numel()


LOSSES = {"standard": hf_loss, "chunked": chunked_causal_lm_loss,
          "chunked:torchtune-linear": torchtune_linear_ce_loss,
          "chunked:torchtune-output": torchtune_chunked_output_loss}


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
