"""Synthetic micro-batches for Hugging Face tasks, and the job's text length."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vramplan.errors import ModelConfigError
from vramplan.job import Job
from vramplan.models import families
from vramplan.models.derive import architecture_from_config
from vramplan.training.tensors import model_dtype


def hf_batch_factory(config: dict, task: str, job: Job, device: torch.device,
                     notes: list[str]) -> Callable[[], dict]:
    """Synthetic micro-batch, as a data loader delivers it (no padding, so no attention mask:
    Hugging Face then skips building a [B, 1, L, L] mask, as it does for all-ones masks)."""
    b, vocab = job.batch_size, int(config.get("vocab_size") or 2)
    seq = text_len(job.seq_len, config, "seq_len", notes)
    floats = model_dtype(job)
    num_labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)

    def tokens(length: int) -> torch.Tensor:
        return torch.randint(1, vocab, (b, length), device=device)

    if task in ("causal-lm", "masked-lm"):
        return lambda: (lambda ids: {"input_ids": ids, "labels": tokens(seq)})(tokens(seq))
    if task == "seq-classification":
        return lambda: {"input_ids": tokens(seq),
                        "labels": torch.randint(0, num_labels, (b,), device=device)}
    if task == "seq2seq":
        target = job.target_len or seq
        return lambda: {"input_ids": tokens(seq), "labels": tokens(target),
                        "decoder_input_ids": tokens(target)}
    if task == "image-classification":
        size = job.image_size or int(config.get("image_size") or 224)
        channels = int(config.get("num_channels") or 3)
        return lambda: {"pixel_values": torch.randn(b, channels, size, size, dtype=floats,
                                                    device=device),
                        "labels": torch.randint(0, num_labels, (b,), device=device)}
    if task == "speech-seq2seq":
        mels = int(config.get("num_mel_bins") or 80)
        frames = 2 * int(config.get("max_source_positions") or 1500)  # stride-2 conv frontend
        if job.audio_seconds:
            frames = round(job.audio_seconds * 100)  # 10 ms hop of the log-mel features
        limit = int(config.get("max_target_positions") or seq)
        target = job.target_len or min(job.seq_len or limit, limit)
        if not job.target_len and job.seq_len and job.seq_len > limit:
            notes.append(f"decoder tokens capped at the model's max_target_positions={limit}")
        return lambda: {"input_features": torch.randn(b, mels, frames, dtype=floats,
                                                      device=device),
                        "labels": tokens(target), "decoder_input_ids": tokens(target)}
    raise ModelConfigError(f"no batch factory for task {task!r}")


# models whose positions are a learned table: longer sequences index past its end
def text_len(requested: int | None, config: dict, field: str, notes: list[str]) -> int:
    """The job's text length, by the formula engine's rule and the model length it derives
    (families.text_len); a config of a family it does not know gives its own length."""
    name = config.get("_name_or_path") or config.get("model_type") or "the model"
    try:
        limit = architecture_from_config(config, name).max_positions
    except ModelConfigError:
        limit = config.get("max_position_embeddings") or config.get("n_positions")
    return families.text_len(requested, limit, config.get("model_type", ""), name, field, notes)
