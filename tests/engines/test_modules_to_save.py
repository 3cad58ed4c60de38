"""peft's modules_to_save beside LoRA: a trainable copy of the token embedding and / or the
LM head, with its gradient and optimizer states in the frozen base's dtype."""

import pytest

from vramplan import Job, JobError
from vramplan.engines.param_memory import param_memory
from vramplan.models import load_architecture
from vramplan.planning.flops import step_flops
from vramplan.planning.traffic import step_traffic

MODEL = "llama-3.2-1b"  # tied embeddings: each listed module still gets its own copy


def _params(**peft):
    job = Job(model=MODEL, batch_size=1, seq_len=128, peft={"rank": 8, **peft})
    return job, param_memory(job, load_architecture(MODEL), "causal-lm")


def test_each_copy_adds_a_matrix_with_its_gradient_and_adam_states_in_bf16():
    arch = load_architecture(MODEL)
    matrix = arch.vocab_size * arch.stacks[-1].hidden_size  # 128256 x 2048
    _, without = _params()
    for saved in (("lm_head",), ("embed_tokens", "lm_head")):
        _, with_copies = _params(modules_to_save=saved)
        n = len(saved) * matrix
        # bf16-mixed LoRA: peft loads the base in bf16 and deep-copies the module as it is
        assert with_copies.trainable - without.trainable == n
        assert with_copies.weights - without.weights == n * 2
        assert with_copies.gradients - without.gradients == n * 2
        assert with_copies.optimizer - without.optimizer == 2 * n * 2  # AdamW: 2 states
        # foreach AdamW's one all-parameter temporary, in the copies' dtype
        assert with_copies.step_temp - without.step_temp == n * 2
        assert with_copies.saved_copy == matrix * 2


def test_a_master_weight_step_keeps_fp32_states_for_the_copies():
    job = Job(model=MODEL, batch_size=1, seq_len=128, precision="bf16-master",
              peft={"rank": 8, "modules_to_save": ("lm_head",)})
    plain = job.with_changes(peft={"rank": 8})
    arch = load_architecture(MODEL)
    matrix = arch.vocab_size * arch.stacks[-1].hidden_size
    a, b = (param_memory(j, arch, "causal-lm") for j in (job, plain))
    assert a.optimizer - b.optimizer == matrix * (2 * 4 + 4)  # AdamW states + fp32 master


def test_the_head_copy_adds_its_weight_gradient_matmul_and_the_embedding_its_gradient():
    arch = load_architecture(MODEL)
    h, vocab = arch.stacks[-1].hidden_size, arch.vocab_size
    base = Job(model=MODEL, batch_size=2, seq_len=128, peft={"rank": 8})
    head = base.with_changes(peft={"rank": 8, "modules_to_save": ("lm_head",)})
    before, after = (step_flops(j).by_class["head"] for j in (base, head))
    # the head's weight gradient: one more matmul over the 2 x 128 positions' logits
    assert after.backward - before.backward == 2 * (2 * 128) * h * vocab
    assert after.forward == before.forward

    # without checkpointing, a frozen first block computes no input gradient, unless the
    # embedding it reads trains
    emb = base.with_changes(peft={"rank": 8, "modules_to_save": ("embed_tokens",)})
    assert step_flops(emb).by_class["linear"].backward > step_flops(base).by_class[
        "linear"].backward
    grad = step_traffic(emb).by_op_phase[("embedding grad", "backward")]
    tokens = 2 * 128
    # zeroed vocab x hidden bf16 gradient, then each token's bf16 row read and added
    assert grad == vocab * h * 2 + tokens * h * (2 + 2 * 2)


@pytest.mark.parametrize("fields, match", [
    (dict(task="seq-classification", peft={"modules_to_save": ("lm_head",)}),
     "has no LM head"),
    (dict(peft={"modules_to_save": ("embed_tokens",)},
          parallel={"pipeline_parallel": 2, "num_gpus": 2}), "pipeline parallelism"),
])
def test_copies_the_formula_cannot_place_are_refused(fields, match):
    from vramplan.engines.formula import estimate

    with pytest.raises(JobError, match=match):
        estimate(Job(model=MODEL, batch_size=1, seq_len=128, **fields))


@pytest.mark.torch
@pytest.mark.parametrize("saved, fields", [
    (("lm_head",), dict(batch_size=8, seq_len=512)),
    (("embed_tokens",), dict(optimizer="adamw-8bit")),
    (("embed_tokens", "lm_head"), dict(optimizer_impl="loop")),
    (("lm_head",), dict(precision="bf16-master")),
    (("embed_tokens", "lm_head"), dict(grad_accum=2, optimizer="adafactor")),
    (("lm_head",), dict(peft_method="qlora", batch_size=4, seq_len=256)),
], ids=["head-backward-peak", "embedding-8bit", "both-loop", "head-master", "both-adafactor",
        "head-qlora"])
def test_formula_matches_the_trace(tmp_path, saved, fields):
    import json

    from vramplan.engines.formula import estimate
    from vramplan.engines.trace import trace

    config = dict(model_type="llama", hidden_size=512, intermediate_size=1024,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=32000, max_position_embeddings=1024, tie_word_embeddings=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    fields = {"batch_size": 2, "seq_len": 64, **fields}
    method = fields.pop("peft_method", "lora")
    job = Job(model=str(path), **fields, runtime={"cublas_workspaces": 0},
              peft={"method": method, "rank": 8, "modules_to_save": saved})
    traced, predicted = trace(job), estimate(job)
    assert traced.params_trainable == predicted.params_trainable
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=0.01)


def test_a_models_own_names_read_as_the_module_once():
    peft = Job(model=MODEL, peft={"modules_to_save": ["wte", "embed_tokens", "embed_out"]}).peft
    assert peft.modules_to_save == ("embed_tokens", "lm_head")
    with pytest.raises(JobError, match="must be one of 'embed_tokens' or 'lm_head'"):
        Job(model=MODEL, peft={"modules_to_save": ["norm"]})


def test_the_optimizer_steps_the_copies_at_their_own_dtype():
    from vramplan.planning.traffic import CLIP_PASSES, OPTIMIZER_STEPS

    arch = load_architecture(MODEL)
    n = arch.vocab_size * arch.stacks[-1].hidden_size
    base = Job(model=MODEL, batch_size=1, seq_len=128, peft={"rank": 8})  # fp32 adapters
    head = base.with_changes(peft={"rank": 8, "modules_to_save": ("lm_head",)})
    before, after = (step_traffic(j).by_op_phase for j in (base, head))
    step = ("optimizer", "optimizer")
    # foreach AdamW's passes over the bf16 copy (2 bytes an element), not the adapters' 4
    assert after[step] - before[step] == OPTIMIZER_STEPS[("adamw", "foreach")].bytes_16bit * n
    clip = ("clip", "optimizer")
    assert after[clip] - before[clip] == CLIP_PASSES * 2 * n
    # accumulation into the copy's .grad between micro-batches: read both, write one
    accum = head.with_changes(grad_accum=4)
    assert step_traffic(accum).by_op_phase[("grad accumulate", "backward")] == 3 * 2 * n
