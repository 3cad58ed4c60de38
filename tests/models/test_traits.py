"""Family traits are typed fields set in models/ (Architecture.traits), and the engines and
the performance model read them, never a model_type name; no module imports another's
private names; the step description is derived once and read by both models."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vramplan.engines.step import describe_step
from vramplan.job import Job
from vramplan.models import load_architecture
from vramplan.models.families import Traits, family_traits

PACKAGE = Path(__file__).resolve().parents[1] / "vramplan"
NAME_TEST = re.compile(r"model_type\s*(==|!=|\bnot in\b|\bin\b)")
# lookups in tables that are not family traits: transformers' own task mappings (which
# class exists for a model type) and the web's list of model types it accepts
NOT_A_TRAIT = re.compile(r"model_type\s+(not\s+)?in\s+(auto\.|getattr\(auto|SUPPORTED_MODEL_TYPES)")


def _sources(*, outside: str = "") -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if not outside or outside not in p.parts]


def test_no_model_type_name_test_outside_models():
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for path in _sources(outside="models")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if NAME_TEST.search(line) and not NOT_A_TRAIT.search(line)]
    assert found == []


def test_the_name_test_finder_finds_one():
    # the grep above must be able to fail
    assert NAME_TEST.search('    stacked = arch.model_type in STACKED_EXPERTS')
    assert NAME_TEST.search('norm_scales_input=arch.model_type == "t5"')
    assert not NAME_TEST.search('traits = family_traits(self.model_type, self.extra)')


PRIVATE_IMPORT = re.compile(r"^\s*from\s+(vramplan[\w.]*)\s+import\s+(\([^)]*\)|[^\n]*)", re.M)


def _private_imports(text: str, package: str = "") -> list[str]:
    """Private names `text` imports from a vramplan package other than `package` (a
    package's own modules may share private helpers)."""
    names = []
    for module, imported in PRIVATE_IMPORT.findall(text):
        if module == "vramplan.training.private_api":  # torch's private API, wrapped once
            continue
        if package and module.split(".")[1:2] == [package]:
            continue
        names += [f"{module}.{n.split()[0]}" for n in imported.strip("()").split(",")
                  if n.strip().startswith("_") and not n.strip().startswith("__")]
    return names


def test_no_package_imports_another_packages_private_names():
    found = {}
    for path in _sources():
        parts = path.relative_to(PACKAGE).parts
        package = parts[0] if len(parts) > 1 else path.stem  # vramplan/job.py: "job"
        found[str(path.relative_to(PACKAGE))] = _private_imports(path.read_text(), package)
    assert {k: v for k, v in found.items() if v} == {}


def test_the_private_import_finder_finds_one():
    assert _private_imports("from vramplan.engines.formula import (\n    _param_memory,\n"
                            "    estimate,\n)\n") == ["vramplan.engines.formula._param_memory"]
    assert _private_imports("from vramplan.job import Job, _check\n") == ["vramplan.job._check"]
    assert _private_imports("from vramplan.engines.step import describe_step\n") == []
    assert _private_imports("from vramplan.engines.trace import _Tracker\n", "engines") == []
    assert _private_imports("from vramplan.engines.trace import _Tracker\n", "planning") == [
        "vramplan.engines.trace._Tracker"]


# --- the traits of a few families, from their bundled configs --------------------------------


def test_llama_traits():
    t = load_architecture("llama-3.2-1b").traits
    assert t == Traits(activation="silu", rotary=True, upcast_softmax=True)


def test_gemma2_traits_soft_caps_and_post_norms():
    arch = load_architecture("gemma-2-2b")
    # config.json: attn_logit_softcapping 50.0, final_logit_softcapping 30.0
    assert arch.traits == Traits(activation="gelu_pytorch_tanh", post_norms=True,
                                 upcast_softmax=True, attention_softcap=50.0,
                                 final_logit_softcap=30.0, eager_attention_only=True)
    assert arch.norms_per_block(arch.stacks[0]) == 4


def test_gemma3_has_post_norms_like_gemma2():
    arch = load_architecture("gemma-3-12b-text")
    assert arch.traits.post_norms and arch.norms_per_block(arch.stacks[0]) == 4
    assert not arch.traits.eager_attention_only and arch.traits.attention_softcap == 0


def test_t5_gpt2_vit_mpt_traits():
    t5 = load_architecture("t5-small").traits
    assert (t5.activation, t5.rotary, t5.norm_scales_input, t5.trained_attention_bias) == (
        "relu", False, True, True)
    gpt2 = load_architecture("gpt2").traits
    assert (gpt2.activation, gpt2.rotary, gpt2.upcast_softmax) == ("gelu_new", False, False)
    assert load_architecture("vit-base-patch16-224").traits.rotary is False
    mpt = load_architecture("mpt-7b")  # positions from its config: ALiBi
    assert mpt.positions == "alibi" and not mpt.traits.rotary
    assert mpt.traits.eager_in_transformers


@pytest.mark.parametrize("name", ["vit-base-patch16-224", "mpt-7b", "deepseek-v3", "llama-3.2-1b"])
def test_eager_softmax_upcasts_where_transformers_code_does(name):
    # transformers 5.24: softmax(..., dtype=torch.float32) (ViT, DeepSeek, Llama) or
    # softmax(scores.float()) (MPT); GPT-2, BERT, T5 and Whisper keep the scores' dtype
    assert load_architecture(name).traits.upcast_softmax


@pytest.mark.parametrize("name", ["gpt2", "bert-base-uncased", "t5-small", "whisper-small"])
def test_eager_softmax_keeps_the_scores_dtype_elsewhere(name):
    assert not load_architecture(name).traits.upcast_softmax


def test_moe_layouts():
    v3 = load_architecture("deepseek-v3").traits
    assert v3.stacked_experts and {"gate_proj", "up_proj", "down_proj"} <= v3.peft_expert_targets
    mixtral = load_architecture("mixtral-8x7b").traits
    assert not mixtral.stacked_experts and mixtral.peft_expert_targets == frozenset()


def test_learned_positions_are_not_rotary_whatever_the_family():
    # OPT and GPT-Neo learn a position table (OPTLearnedPositionalEmbedding, GPT-Neo's wpe)
    assert not family_traits("opt", {}).rotary and not family_traits("gpt_neo", {}).rotary
    assert family_traits("mpt", {}, positions="rotary").rotary
    assert family_traits("whisper", {"activation_function": "gelu"}).activation == "gelu"
    assert family_traits("t5", {"feed_forward_proj": "gated-gelu"}).activation == "gelu"


def test_gemma3_block_has_a_post_mlp_norm_in_transformers():
    """Why Gemma-3 has post_norms (the early stop of full checkpointing cannot skip its
    down projection, whose output the post-feedforward norm saves): transformers builds it."""
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    config = pytest.importorskip("transformers").Gemma3TextConfig(
        hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, num_hidden_layers=1, vocab_size=32)
    layer = gemma3.Gemma3DecoderLayer(config, 0)
    assert hasattr(layer, "post_attention_layernorm")
    assert hasattr(layer, "post_feedforward_layernorm")


# --- the step description ------------------------------------------------------------------


def test_step_description_is_what_both_models_read():
    arch = load_architecture("llama-3.2-1b")
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024, peft={"method": "lora"},
              parallel={"strategy": "fsdp", "num_gpus": 4, "pipeline_parallel": 2})
    step = describe_step(job, arch)
    assert (step.task, step.shapes.stack_seq, step.attention) == ("causal-lm", (1024,), "sdpa")
    assert step.shapes.loss_tokens == 2 * 1024
    assert [s.name for s in step.stages] == ["first", "last"]
    assert step.activations.residual == 2  # a 16-bit LoRA base keeps a 16-bit residual
    assert step.params.trainable == sum(
        s.num_layers * 16 * (ln.in_features + ln.out_features)
        for s in arch.stacks for ln in s.linears if ln.name in job.peft.target_modules)
    # the last stage holds half the blocks (16 of 32... here 8 of 16) and the head
    last = step.stage_params(step.stages[-1])
    assert last.trainable == step.params.trainable // 2
