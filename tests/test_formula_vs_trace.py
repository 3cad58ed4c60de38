"""The formula against the trace on a few small catalog models, for the loss and attention
paths the H200 runs corrected (benchmarks/results/gpu_validation_notes.md). The full
comparison at real sizes is benchmarks/formula_vs_trace.py."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from vramplan import Job  # noqa: E402
from vramplan.engines.formula import estimate  # noqa: E402
from vramplan.engines.trace import trace  # noqa: E402


@pytest.mark.parametrize("fields", [
    # vramplan's chunked loss: 8 checkpointed sequence chunks
    dict(model="qwen2.5-0.5b", batch_size=2, seq_len=1024, loss="chunked"),
    # cross_entropy on bf16 logits under autocast: bf16 log_softmax, fp32 nll input
    dict(model="bert-base-uncased", batch_size=8, seq_len=512),
    # T5's trained position bias under sdpa: CUDA's memory-efficient kernel
    dict(model="t5-small", batch_size=8, seq_len=512, precision="bf16-pure"),
    # a fused q/k/v projection without rotary embeddings: q, k, v are views of its output;
    # gelu_new under autocast
    dict(model="gpt2", batch_size=2, seq_len=1024),
    # eager attention with dropout: the mask and the dropped probabilities are kept
    dict(model="gpt2", batch_size=2, seq_len=1024, attention="eager"),
    # FSDP2 keeps its root unit (embeddings, head) gathered from forward to backward
    dict(model="qwen2.5-0.5b", batch_size=2, seq_len=1024,
         parallel={"strategy": "fsdp", "num_gpus": 2}),
], ids=["chunked-loss", "masked-lm-autocast", "t5-sdpa", "gpt2-fused-qkv", "gpt2-eager-dropout",
        "fsdp-root-unit"])
def test_formula_matches_trace(fields):
    job = Job.model_validate(fields)
    traced, predicted = trace(job).peak_allocated, estimate(job).peak_allocated
    assert predicted == pytest.approx(traced, rel=0.02)


def test_both_engines_choose_the_same_default_lengths():
    # an unset seq_len is min(2048, the model's length); T5 once got 2048 in the formula
    # and its config's 512 in the trace
    from vramplan.models.catalog import list_models
    from vramplan.training.batches import text_len
    from vramplan.training.hf_model import load_model_config, task_of_config

    for entry in list_models():
        config = load_model_config(entry.name)
        if task_of_config(config) not in ("causal-lm", "masked-lm", "seq2seq"):
            continue  # vision has no text; speech caps its decoder at max_target_positions
        report = estimate(Job(model=entry.name, batch_size=1))
        formula_note = next(n for n in report.notes if n.startswith("seq_len not given"))
        notes: list[str] = []
        text_len(None, config, "seq_len", notes)
        assert notes == [formula_note], entry.name


def test_lora_targets_name_the_same_modules_in_both_engines():
    # ViT's linears are q/k/v/o_proj and fc1/fc2 in transformers 5; a new classifier head
    # trains whole beside the adapters in both engines
    job = Job(model="vit-base-patch16-224", batch_size=2, peft={"rank": 8})
    assert trace(job).params_trainable == estimate(job).params_trainable
