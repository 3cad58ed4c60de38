"""Models users bring: Hugging Face ids of fine-tuned variants, ids the catalog does not know,
factories, and families outside derive.py's table (read from the model transformers builds on
the meta device)."""

from __future__ import annotations

import json

import pytest

from vramplan import Job
from vramplan.api import estimate, trace
from vramplan.errors import ModelConfigError, UnknownNameError
from vramplan.models import derive, load_architecture
from vramplan.models.derive import architecture_from_config

# ------------------------------------------------------------------ Hugging Face ids


@pytest.mark.parametrize("ref,name", [
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),   # alias + rule
    ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),             # the word mid-name
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
    ("Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b"),                   # no owner
    ("Qwen/Qwen3-8B-Base", "qwen3-8b"),
    ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b"),       # alias
    ("google/gemma-2-9b-it", "gemma-2-9b"),
    ("mistralai/Mistral-7B-Instruct-v0.1", "mistral-7b"),
    ("mistralai/Mistral-7B-Instruct-v0.2", "mistral-7b"),        # alias
    ("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo-12b"),  # alias
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
    ("allenai/OLMo-2-0425-1B-Instruct", "olmo-2-1b"),
])
def test_variant_ids_resolve_to_their_base(ref, name):
    assert load_architecture(ref).name == name


def test_a_variant_word_is_only_removed_as_a_whole_name_part():
    # "it" inside a word is no variant marker; "Instruct" as the first part is the name
    with pytest.raises(UnknownNameError):
        load_architecture("google/gemma-2-9bit")
    with pytest.raises(UnknownNameError):
        load_architecture("Instruct-7B")


def test_unknown_hf_id_says_how_to_pass_a_config_folder():
    with pytest.raises(UnknownNameError) as ei:
        load_architecture("someorg/Foo-7B-Instruct")
    msg = str(ei.value)
    assert "'someorg/Foo-7B-Instruct'" in msg and "downloads nothing" in msg
    assert "config.json" in msg and "vramplan estimate ./my-model/" in msg
    assert "\n" not in msg


def test_mistral_v03_is_not_mistaken_for_v01():
    # v0.3 has 32768 tokens, v0.1 32000: no rule may map one onto the other
    with pytest.raises(UnknownNameError, match="downloads nothing"):
        load_architecture("mistralai/Mistral-7B-Instruct-v0.3")


def test_a_factory_says_use_the_trace():
    with pytest.raises(ModelConfigError, match="use --engine trace"):
        load_architecture("my_models.zoo:build")


# ------------------------------------------------------------------ families outside the table

TINY = {
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=256, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=1024, vocab_size=1000,
                     max_position_embeddings=1024),
    "opt": dict(model_type="opt", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                ffn_dim=1024, dropout=0.0, vocab_size=1000, max_position_embeddings=1024,
                word_embed_proj_dim=256),
    "falcon": dict(model_type="falcon", hidden_size=256, num_hidden_layers=2,
                   num_attention_heads=4, vocab_size=1000, new_decoder_architecture=True,
                   num_kv_heads=2),
}


def _built_param_count(config: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    values = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config["model_type"], **values))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.torch
@pytest.mark.parametrize("family", list(TINY))
def test_unlisted_family_counts_exactly_what_transformers_builds(family):
    arch = architecture_from_config(TINY[family], f"tiny-{family}")
    assert arch.shapes_from != "config"
    assert arch.total_params() == _built_param_count(TINY[family])


@pytest.mark.torch
def test_unlisted_family_shapes():
    neox = architecture_from_config(TINY["gpt_neox"], "neox").stacks[0]
    # one fused query_key_value: (4 heads + 2 x 4 kv heads) x 64 = 768 outputs
    assert [(ln.name, ln.in_features, ln.out_features, ln.bias, ln.role)
            for ln in neox.linears] == [
        ("query_key_value", 256, 768, True, "attn_in"), ("dense", 256, 256, True, "attn_out"),
        ("dense_h_to_4h", 256, 1024, True, "mlp_in"),
        ("dense_4h_to_h", 1024, 256, True, "mlp_out")]
    assert (neox.num_heads, neox.num_kv_heads, neox.head_dim, neox.mlp, neox.norm) == (
        4, 4, 64, "gelu", "layernorm")
    falcon = architecture_from_config(TINY["falcon"], "falcon").stacks[0]
    # new decoder architecture: 2 kv heads, (4 + 2 x 2) x 64 = 512 fused outputs, no biases
    assert (falcon.num_kv_heads, falcon.linears[0].out_features, falcon.linears[0].bias) == (
        2, 512, False)
    opt = architecture_from_config(TINY["opt"], "opt")
    assert opt.stacks[0].mlp == "relu" and opt.tied_embeddings
    # OPT's learned positions are 1024 + 2 (its offset), counted with the embeddings
    assert opt.embedding_params == (1000 + 1026) * 256


@pytest.mark.torch
@pytest.mark.parametrize("family,tolerance", [("gpt_neox", 0.03), ("falcon", 0.03),
                                              ("opt", 0.07)])
def test_formula_follows_the_trace_on_unlisted_families(tmp_path, family, tolerance):
    (tmp_path / "config.json").write_text(json.dumps(TINY[family]))
    job = Job(model=str(tmp_path), batch_size=4, seq_len=512)
    formula, traced = estimate(job), trace(job)
    assert formula.params_total == traced.params_total
    assert abs(formula.peak_allocated / traced.peak_allocated - 1) < tolerance
    assert any("shapes were read from the transformers model built on the meta device" in n
               for n in formula.notes)


def test_without_torch_an_unlisted_family_says_use_the_trace(monkeypatch):
    monkeypatch.setattr(derive.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelConfigError) as ei:
        architecture_from_config(TINY["opt"], "opt.json")
    msg = str(ei.value)
    assert "'opt'" in msg and "use --engine trace" in msg and "llama" in msg



@pytest.mark.torch
def test_the_reader_of_built_models_is_the_one_passed_in(monkeypatch):
    """models/ never imports the torch side: a family without a builder goes to the reader
    that `import vramplan` passed in (use_built_model_reader), and to nothing else."""
    seen = []

    def reader(config, name, source):
        seen.append((config["model_type"], name, source))
        raise ModelConfigError(f"{name}: the stand-in reader")

    from vramplan import hooks

    monkeypatch.setattr(hooks, "built_model_reader", None)
    derive.use_built_model_reader(reader)
    with pytest.raises(ModelConfigError, match="the stand-in reader; the formula reads"):
        architecture_from_config(TINY["opt"], "opt.json", "a source")
    assert seen == [("opt", "opt.json", "a source")]
    monkeypatch.setattr(hooks, "built_model_reader", None)
    with pytest.raises(ModelConfigError, match="no reader of built models was set"):
        architecture_from_config(TINY["opt"], "opt.json")

# ------------------------------------------------------------------ new catalog families


def test_qwen3_counts_its_qk_norms():
    # per layer: q 4096x4096 + k, v 4096x1024 + o 4096x4096 = 41,943,040; SwiGLU 3 x 4096 x
    # 12288 = 150,994,944; input/post-attention norms 2 x 4096 + q_norm/k_norm 2 x 128 = 8,448
    # -> 192,946,432 x 36 layers + embeddings and untied head 2 x 151936 x 4096 + final norm
    layer = 41_943_040 + 150_994_944 + 8_448
    assert load_architecture("qwen3-8b").total_params() == 36 * layer + 2 * 151936 * 4096 + 4096


def test_qwen3_moe_is_one_sparse_stack():
    st = load_architecture("qwen3-30b-a3b").stacks[0]
    assert (st.num_experts, st.experts_per_token, st.intermediate_size) == (128, 8, 768)
    assert [ln.role for ln in st.linears][4:] == ["router", "mlp_in", "mlp_in", "mlp_out"]
    cfg = dict(load_architecture("qwen3-30b-a3b").extra)
    cfg["mlp_only_layers"] = [0]
    with pytest.raises(ModelConfigError, match="use --engine trace"):
        architecture_from_config(cfg, "q.json")


_TINY_NEW = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, intermediate_size=1024, vocab_size=1000,
                 max_position_embeddings=1024, eos_token_id=0, bos_token_id=0, pad_token_id=0)


@pytest.mark.torch
@pytest.mark.parametrize("model_type,extra,tolerance", [
    ("qwen3", {}, 0.03), ("olmo2", {}, 0.03), ("qwen3_moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256), 0.04),
    ("gemma3_text", dict(sliding_window=128, query_pre_attn_scalar=64), 0.04)])
def test_formula_follows_the_trace_on_the_new_families(tmp_path, model_type, extra, tolerance):
    config = dict(_TINY_NEW, model_type=model_type, **extra)
    arch = architecture_from_config(config, model_type)
    assert arch.shapes_from == "config" and arch.stacks[0].qk_norm
    assert arch.total_params() == _built_param_count(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    job = Job(model=str(tmp_path), batch_size=4, seq_len=512)
    formula, traced = estimate(job), trace(job)
    assert abs(formula.peak_allocated / traced.peak_allocated - 1) < tolerance
