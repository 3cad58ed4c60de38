"""The model catalog and config parsing (vramplan.models).

Parameter counts are checked against transformers: the same config is built on the meta device
(no weights are allocated) and its unique parameters counted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vramplan.errors import ModelConfigError, UnknownNameError
from vramplan.models import (
    SUPPORTED_MODEL_TYPES,
    Architecture,
    architecture_from_config,
    list_models,
    load_architecture,
)

CATALOG = [e.name for e in list_models()]

def _auto_class(model_type: str, task: str):
    import transformers as tf
    return {
        "causal-lm": tf.AutoModelForCausalLM,
        "masked-lm": tf.AutoModelForMaskedLM,
        "seq-classification": tf.AutoModelForSequenceClassification,
        "seq2seq": tf.AutoModelForSeq2SeqLM,
        "image-classification": tf.AutoModelForImageClassification,
        "speech-seq2seq": tf.AutoModelForSpeechSeq2Seq,
    }[task]


def _hf_param_count(arch: Architecture, task: str) -> int:
    import torch
    from transformers import AutoConfig

    raw = dict(arch.extra)
    raw.pop("architectures", None)
    if task in ("seq-classification", "image-classification"):
        raw.pop("id2label", None), raw.pop("label2id", None)
        raw["num_labels"] = arch.num_labels
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = _auto_class(arch.model_type, task).from_config(config)
    return sum(p.numel() for p in model.parameters())   # unique: tied weights counted once


def _cases():
    for name in CATALOG:
        arch = load_architecture(name)
        for task in arch.tasks:
            yield pytest.param(name, task, id=f"{name}:{task}")


@pytest.mark.torch
@pytest.mark.parametrize("name,task", list(_cases()))
def test_param_count_matches_transformers(name, task):
    arch = load_architecture(name)
    assert arch.total_params(task) == _hf_param_count(arch, task)


# ------------------------------------------------------------------ catalog


def test_catalog_size_and_known_totals():
    assert len(CATALOG) >= 32
    assert load_architecture("llama-3.1-8b").total_params() == 8_030_261_248
    gpt2 = load_architecture("gpt2")
    assert gpt2.total_params() == 124_439_808
    assert gpt2.tied_embeddings and gpt2.head_params["causal-lm"] == 0
    assert load_architecture("resnet-50").total_params() == 25_557_032


def test_catalog_entries_are_complete():
    for e in list_models():
        assert e.hf_id and e.family and e.description and e.path.is_file()
        assert e.source.startswith("https://huggingface.co/") and e.source.endswith("config.json")
        assert len(e.date) == 10 and e.params > 0
        assert load_architecture(e.name).source == e.source


def test_list_models_filters():
    llamas = list_models(family="LLAMA")
    assert {e.name for e in llamas} >= {"llama-2-7b", "llama-3.1-8b", "llama-3.2-1b"}
    assert all(e.family == "llama" for e in llamas)
    assert [e.name for e in list_models(name_contains="Qwen2.5-7B")] == ["qwen2.5-7b"]
    small = list_models(max_params=200_000_000)
    assert "gpt2" in {e.name for e in small} and all(e.params <= 200_000_000 for e in small)
    big = list_models(min_params=100_000_000_000)
    assert {e.name for e in big} == {"llama-3.1-405b", "deepseek-v3"}
    assert list_models(family="nope") == []


def test_lookup_by_hf_id_and_case():
    a = load_architecture("meta-llama/Llama-3.1-8B")
    assert a.name == "llama-3.1-8b"
    assert load_architecture("LLaMA-3.1-8B") is a
    assert load_architecture("llama_3_1_8b").name == "llama-3.1-8b"   # separators ignored
    assert load_architecture("Qwen/Qwen2.5-72B").name == "qwen2.5-72b"
    assert load_architecture("google/vit-huge-patch14-224-in21k").name == "vit-huge-patch14-224"
    assert load_architecture("Llama-2-7b-hf").name == "llama-2-7b"


@pytest.mark.parametrize("typo,suggestion", [("lama-3.1-8b", "llama-3.1-8b"),
                                             ("mistal-7b", "mistral-7b")])
def test_misspelling_suggests(typo, suggestion):
    with pytest.raises(UnknownNameError) as ei:
        load_architecture(typo)
    assert suggestion in str(ei.value) and "Did you mean" in str(ei.value)


def test_unknown_names():
    with pytest.raises(UnknownNameError):
        load_architecture("")
    # (an -Instruct id resolves to its base: tests/models/test_user_models.py)
    with pytest.raises(UnknownNameError, match="Did you mean .meta-llama/Llama-3.1-8B."):
        load_architecture("meta-llama/Llama-3.1-8C-Instruct")


def test_import_does_not_load_torch():
    code = ("import sys, vramplan, vramplan.models as m; m.list_models(); "
            "m.load_architecture('llama-3.1-8b'); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ local configs


def _llama_cfg() -> dict:
    return json.loads(list_models(name_contains="llama-3.2-1b")[0].path.read_text())


def test_load_config_file_and_folder(tmp_path):
    cfg = _llama_cfg()
    f = tmp_path / "my.json"
    f.write_text(json.dumps(cfg))
    a = load_architecture(str(f))
    assert a.total_params() == load_architecture("llama-3.2-1b").total_params()
    assert a.name == str(f) and a.extra["hidden_size"] == 2048
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_architecture(str(folder)).total_params() == a.total_params()
    assert load_architecture(folder).total_params() == a.total_params()   # PathLike


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(ModelConfigError, match="no such file"):
        load_architecture(str(tmp_path / "nope" / "config.json"))
    with pytest.raises(ModelConfigError, match="no such file"):
        load_architecture("./nope/config.json")
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_architecture(str(tmp_path))


def test_malformed_json_names_line(tmp_path):
    f = tmp_path / "config.json"
    f.write_text('{\n  "model_type": "llama",\n  "hidden_size": 4096,,\n}\n')
    with pytest.raises(ModelConfigError) as ei:
        load_architecture(str(f))
    assert "line 3" in str(ei.value) and str(f) in str(ei.value)


def test_unsupported_model_type_lists_supported(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"model_type": "mamba", "hidden_size": 768}))
    with pytest.raises(ModelConfigError) as ei:
        load_architecture(str(f))
    msg = str(ei.value)
    # mamba builds in transformers but has no attention blocks the formula reads
    assert "mamba" in msg and all(t in msg for t in ("llama", "bert", "whisper", "resnet"))
    assert "use --engine trace" in msg
    assert set(SUPPORTED_MODEL_TYPES) >= {"gpt2", "bert", "roberta", "t5", "llama", "mistral",
                                          "mixtral", "qwen2", "gemma2", "phi3", "vit", "resnet",
                                          "whisper"}
    with pytest.raises(ModelConfigError, match="model_type"):
        architecture_from_config({"hidden_size": 1}, "x.json")


def test_missing_key_names_key_and_file():
    cfg = _llama_cfg()
    del cfg["intermediate_size"]
    with pytest.raises(ModelConfigError) as ei:
        architecture_from_config(cfg, "/some/config.json")
    assert "intermediate_size" in str(ei.value) and "/some/config.json" in str(ei.value)


# ------------------------------------------------------------------ shapes


def test_attention_shapes():
    a = load_architecture("llama-3.1-8b")
    (s,) = a.stacks
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim) == (
        32, 4096, 32, 8, 128)
    assert s.mlp == "gated" and s.norm == "rmsnorm" and a.kind == "decoder"
    assert a.vocab_size == 128256 and a.max_positions == 131072 and not a.tied_embeddings
    names = [lin.name for lin in s.linears]
    assert names == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert {lin.name: lin.out_features for lin in s.linears}["k_proj"] == 1024

    assert load_architecture("llama-2-7b").stacks[0].num_kv_heads == 32
    assert load_architecture("llama-2-70b").stacks[0].num_kv_heads == 8
    g9 = load_architecture("gemma-2-9b").stacks[0]
    assert g9.head_dim == 256 and g9.num_heads * g9.head_dim == 4096 != g9.hidden_size
    assert load_architecture("gemma-2-27b").stacks[0].head_dim == 128
    assert load_architecture("gemma-2-2b").tied_embeddings
    q = load_architecture("qwen2.5-7b").stacks[0]
    assert q.num_kv_heads == 4 and [lin.bias for lin in q.linears[:4]] == [True, True, True, False]
    phi = load_architecture("phi-3-mini-4k").stacks[0]
    assert [lin.name for lin in phi.linears] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def test_moe():
    a = load_architecture("mixtral-8x7b")
    (s,) = a.stacks
    assert s.num_experts == 8 and s.experts_per_token == 2 and s.intermediate_size == 14336
    experts = [lin for lin in s.linears if lin.count == 8]
    assert len(experts) == 3 and all(lin.name in ("w1", "w2", "w3") for lin in experts)


def test_encoder_decoder_and_encoders():
    t5 = load_architecture("t5-3b")
    enc, dec = t5.stacks
    assert (enc.role, dec.role, dec.cross_attention) == ("encoder", "decoder", True)
    assert enc.num_heads * enc.head_dim == 4096 and enc.intermediate_size == 16384
    assert [lin.name for lin in dec.linears] == ["q", "k", "v", "o"] * 2 + ["wi", "wo"]
    bert = load_architecture("bert-base-uncased")
    assert bert.kind == "encoder" and bert.max_positions == 512
    assert set(bert.tasks) == {"masked-lm", "seq-classification"}
    assert load_architecture("roberta-base").max_positions == 512
    assert load_architecture("gpt2").stacks[0].linears[0].name == "c_attn"


def test_vision_and_speech():
    vit = load_architecture("vit-base-patch16-224")
    assert (vit.image_size, vit.patch_size, vit.num_channels, vit.num_labels) == (224, 16, 3, 1000)
    assert vit.stacks[0].sequence == "patches" and vit.kind == "vision"
    assert load_architecture("vit-huge-patch14-224").num_labels == 1000   # in21k: no labels
    w = load_architecture("whisper-large-v3")
    assert w.num_mel_bins == 128 and w.max_source_positions == 3000 and w.max_positions == 448
    assert [s.sequence for s in w.stacks] == ["audio", "text"]
    assert w.kind == "encoder-decoder" and w.tied_embeddings


def _saved_feature_maps(config: dict, size: int) -> list[tuple[int, int]]:
    """(channels, stride) of every per-sample tensor autograd saves, each storage once."""
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(**config)).train()
    batch = 2
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, out = set(), []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen and t.dim() >= 2 and t.shape[0] == batch:
            seen.add(ptr)
            out.append((t.shape[1], size // t.shape[2] if t.dim() == 4 else size))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(pixel_values=torch.randn(batch, config.get("num_channels", 3), size, size))
    return out


@pytest.mark.torch
@pytest.mark.parametrize("config", [
    "resnet-50",
    {"model_type": "resnet", "layer_type": "basic", "embedding_size": 16, "depths": [2, 1, 2],
     "hidden_sizes": [16, 32, 64], "num_labels": 10},
    {"model_type": "resnet", "layer_type": "bottleneck", "embedding_size": 8, "depths": [1, 2],
     "hidden_sizes": [32, 64], "downsample_in_first_stage": True, "downsample_in_bottleneck": True},
], ids=["resnet-50", "basic", "downsample-variants"])
def test_resnet_feature_maps_match_autograd(config):
    arch = (load_architecture(config) if isinstance(config, str)
            else architecture_from_config(config, "test"))
    size = 64
    expected = [(c, s if s != arch.image_size else size) for c, s in arch.feature_maps]
    assert sorted(_saved_feature_maps(dict(arch.extra), size)) == sorted(expected)
    if not isinstance(config, str):
        assert arch.total_params() == _hf_param_count(arch, "image-classification")


# ------------------------------------------------------------------ broken configs

TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256, max_position_embeddings=128)
TINY_GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                 n_positions=64)


@pytest.mark.parametrize("base, change, needle", [
    (TINY_LLAMA, dict(num_attention_heads=0), "attention heads must be at least 1"),
    (TINY_LLAMA, dict(num_key_value_heads=3), "multiple of the key/value heads"),
    (TINY_LLAMA, dict(hidden_size=float("nan")), "'hidden_size' is nan"),
    (TINY_LLAMA, dict(vocab_size=float("inf")), "'vocab_size' is inf"),
    (TINY_LLAMA, dict(hidden_size=10**30), "whole number from 0 to"),
    (TINY_LLAMA, dict(num_hidden_layers=0), "layers must be at least 1"),
    (TINY_LLAMA, dict(attention_dropout=2), "from 0 to 1"),
    (TINY_LLAMA, dict(attention_dropout="x"), "from 0 to 1"),
    (TINY_GPT2, dict(n_head=3), "must be divisible by the 3 attention heads"),
    (TINY_GPT2, dict(n_head=0), "attention heads must be at least 1"),
    (TINY_GPT2, dict(vocab_size=0), "vocab_size must be at least 1"),
    (dict(model_type="vit", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
          num_attention_heads=2, image_size=16), dict(patch_size=0), "patch_size"),
    (dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
          num_attention_heads=4, vocab_size=256, num_local_experts=2),
     dict(num_experts_per_tok=3), "cannot exceed the experts"),
    (dict(model_type="resnet", embedding_size=8, depths=[1, 1], num_labels=3),
     dict(hidden_sizes=[float("nan"), 32]), "must be a whole number"),
    (dict(model_type="resnet", embedding_size=8, depths=[1, 1], num_labels=3),
     dict(hidden_sizes="16,32"), "must be a list"),
])
def test_broken_configs_are_refused_before_anything_is_computed(base, change, needle):
    # each used to give a traceback (ZeroDivisionError, ValueError on NaN, OverflowError)
    # or plausible numbers for a model transformers refuses to build
    with pytest.raises(ModelConfigError, match="x.json") as error:
        architecture_from_config({**base, **change}, "x.json")
    assert needle in str(error.value)


def test_nan_in_a_config_file_is_refused_with_the_file_named(tmp_path):
    from vramplan import Job, estimate
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA).replace('"hidden_size": 64', '"hidden_size": NaN'))
    with pytest.raises(ModelConfigError, match="hidden_size"):
        estimate(Job(model=str(path)))


@pytest.mark.torch
@pytest.mark.parametrize("change", [dict(n_head=3), dict(n_head=0), dict(n_embd=0),
                                    dict(n_layer=1.5)])
def test_configs_transformers_refuses_are_refused(change):
    import torch
    import transformers
    config = {**TINY_GPT2, **change}
    with pytest.raises(Exception):  # noqa: B017 (transformers raises several kinds)
        with torch.device("meta"):
            transformers.AutoModel.from_config(transformers.AutoConfig.for_model(**config))
    with pytest.raises(ModelConfigError):
        architecture_from_config(config, "x.json")


# ------------------------------------------------------------------ MPT (llm-foundry)

def _mpt_cfg(**change) -> dict:
    cfg = json.loads(list_models(name_contains="mpt-7b")[0].path.read_text())
    cfg.update(d_model=64, n_heads=4, n_layers=2, vocab_size=256, max_seq_len=128)
    attn = {**cfg["attn_config"], **change.pop("attn_config", {})}
    return {**cfg, **change, "attn_config": attn}


def test_mpt_parameter_counts_from_shapes():
    # mpt-7b: fused Wqkv (d x 3d), out_proj (d x d), up/down (d x 4d), no biases; two
    # bias-free LayerNorms per block and a final one; ALiBi (no position table); tied head
    d, layers, vocab = 4096, 32, 50432
    block = d * 3 * d + d * d + 2 * d * 4 * d + 2 * d
    assert load_architecture("mpt-7b").total_params() == layers * block + vocab * d + d \
        == 6_649_286_656
    d, layers = 7168, 48
    block = d * 3 * d + d * d + 2 * d * 4 * d + 2 * d
    assert load_architecture("mosaicml/mpt-30b").total_params() == layers * block + vocab * d + d
    # the catalog-wide test checks both against transformers' meta-built MptForCausalLM


def test_mpt_llm_foundry_variants_count_what_llm_foundry_builds():
    # biases everywhere (no_bias false), a learned position table (no ALiBi), grouped-query
    # attention with 2 kv heads, qk LayerNorms, expansion_ratio 2.5, an untied head
    cfg = _mpt_cfg(no_bias=False, learned_pos_emb=True, expansion_ratio=2.5,
                   tie_word_embeddings=False,
                   attn_config=dict(alibi=False, attn_type="grouped_query_attention",
                                    kv_n_heads=2, qk_ln=True))
    arch = architecture_from_config(cfg, "x.json")
    d, hd, kv, f, vocab, npos = 64, 16, 2, 160, 256, 128
    block = (d * (4 + 2 * kv) * hd + (4 + 2 * kv) * hd      # Wqkv + bias
             + d * d + d                                     # out_proj
             + d * f + f + f * d + d                         # up_proj, down_proj
             + 2 * 2 * d                                     # norm_1, norm_2 (with bias)
             + 2 * d + 2 * kv * hd)                          # q_ln, k_ln
    assert arch.total_params() == 2 * block + (vocab + npos) * d + 2 * d + vocab * d
    assert arch.stacks[0].num_kv_heads == 2 and arch.positions == "learned"
    assert arch.stacks[0].intermediate_size == 160


@pytest.mark.parametrize("shape,seq,published", [
    ((8192, 64, 80), 2048, 64_862_437_376),    # MPT-70b
    ((4096, 32, 32), 65536, 6_918_905_856),    # MPT-7b at 64k tokens
    ((768, 12, 12), 512, 124_131_840),         # MPT-125m
])
def test_mpt_counts_equal_llm_foundry_benchmark_num_params(shape, seq, published):
    # llm-foundry's benchmark configs (scripts/train/benchmarking/README.md NumParams,
    # mosaicml/llm-foundry@5e85bd62): its defaults, biases and a learned position table
    # of max_seq_len rows, vocab 50368, tied head
    d, heads, layers = shape
    cfg = dict(model_type="mpt", d_model=d, n_heads=heads, n_layers=layers, vocab_size=50368,
               max_seq_len=seq, expansion_ratio=4, no_bias=False, attn_config={"alibi": False})
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    assert architecture_from_config(cfg, "x.json").total_params() \
        == layers * block + (50368 + seq) * d + 2 * d == published


def test_mpt_defaults_that_differ_between_transformers_and_llm_foundry_are_required():
    cfg = _mpt_cfg()
    del cfg["no_bias"], cfg["attn_config"]["alibi"]
    with pytest.raises(ModelConfigError, match="'no_bias', 'attn_config.alibi'"):
        architecture_from_config(cfg, "x.json")


def test_mpt_refuses_a_sequence_past_max_seq_len():
    from vramplan import Job, estimate
    from vramplan.errors import JobError
    with pytest.raises(JobError, match="2048 positions"):
        estimate(Job(model="mpt-7b", seq_len=4096))


def test_mpt_step_flops_count_every_linear():
    from vramplan import Job
    from vramplan.planning.flops import step_flops
    job = Job(model="mpt-7b", batch_size=1, seq_len=2048)
    arch = load_architecture("mpt-7b")
    flops = step_flops(job, arch)
    block_weights = sum(ln.in_features * ln.out_features for ln in arch.stacks[0].linears)
    assert flops.by_class["linear"].forward == 2 * 2048 * 32 * block_weights
    assert flops.by_class["head"].forward == 2 * 2048 * 4096 * 50432


@pytest.mark.torch
def test_mpt_trace_refuses_what_transformers_does_not_build():
    from vramplan import Job
    from vramplan.training.hf_model import _hf_config
    with pytest.raises(ModelConfigError, match="biases .no_bias false.*--engine formula"):
        _hf_config(_mpt_cfg(no_bias=False), "causal-lm", Job(model="gpt2"))


@pytest.mark.torch
def test_strict_config_int_field_given_a_whole_float_is_normalised():
    # llm-foundry writes attn_pdrop: 0.0; transformers 5 annotates it int and its strict
    # dataclass raised StrictDataclassFieldValidationError (a traceback in estimate)
    from vramplan.training.hf_config import to_hf_config
    hf = to_hf_config(_mpt_cfg(attn_config=dict(attn_pdrop=0.0)), "x.json")
    assert hf.attn_config.attn_pdrop == 0
    with pytest.raises(ModelConfigError,
                       match="'attn_config.attn_pdrop' as int, got float 0.1: .*--engine formula"):
        to_hf_config(_mpt_cfg(attn_config=dict(attn_pdrop=0.1)), "x.json")
    with pytest.raises(ModelConfigError, match="'n_embd' as int, got str"):
        to_hf_config(dict(TINY_GPT2, n_embd="x"), "x.json")


# ------------------------------------------------------------------ vision-language configs

TINY_VLM = {
    "llava": dict(model_type="llava", text_config=dict(TINY_LLAMA),
                  vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, image_size=28, patch_size=14)),
    # Gemma-3 used to end in a TypeError traceback (its top level has no hidden_size)
    "gemma3": dict(model_type="gemma3", text_config=dict(
        model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14)),
    # as transformers saves it (google/gemma-3-4b-pt): text_config without the values that
    # equal Gemma3TextConfig's defaults (heads, head size, vocabulary)
    "gemma3-sparse": dict(model_type="gemma3", text_config=dict(
        model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14)),
    # llava-hf/llava-1.5-7b-hf's text_config is Llama-2-7B, written as its diff from
    # LlamaConfig's defaults: the vocabulary and length only
    "llava-sparse": dict(model_type="llava", text_config=dict(
        model_type="llama", vocab_size=32064, max_position_embeddings=4096),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14)),
    # Qwen2-VL keeps its language model's keys at the top level, beside vision_config
    "qwen2_vl": dict(model_type="qwen2_vl", hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=256, tie_word_embeddings=True,
                     rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3]),
                     vision_config=dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64)),
}


@pytest.mark.torch
@pytest.mark.parametrize("family", sorted(TINY_VLM))
def test_vision_language_configs_estimate_their_language_model(family):
    import torch
    import transformers

    from vramplan import Job, estimate

    config = TINY_VLM[family]
    arch = architecture_from_config(config, "x.json")
    assert any("vision tower and projector are not counted" in n for n in arch.notes)
    report = estimate(Job(model="x", batch_size=1, seq_len=32), model_config=config)
    assert any("not counted" in n for n in report.notes)
    # the same count as the language model and LM head transformers builds for the config
    hf = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(hf)
    lm = model.model.language_model
    head = model.lm_head.weight
    tied = head is lm.get_input_embeddings().weight
    expected = sum(p.numel() for p in lm.parameters()) + (0 if tied else head.numel())
    assert arch.total_params() == expected


@pytest.mark.torch
def test_recurrent_blocks_are_refused_for_their_real_cause():
    # RWKV was refused as "dense and sparse layers mixed" (its first block has an extra norm)
    cfg = dict(model_type="rwkv", hidden_size=64, num_hidden_layers=2, vocab_size=256,
               attention_hidden_size=64, context_length=128)
    with pytest.raises(ModelConfigError, match="'rwkv' has no attention heads") as error:
        architecture_from_config(cfg, "x.json")
    assert "sparse" not in str(error.value) and "use --engine trace" in str(error.value)


@pytest.mark.torch
def test_meta_built_family_missing_a_shape_key_is_refused():
    # pythia-160m without hidden_size read as 2.9B parameters (GPT-NeoX-20B's 6144 width)
    cfg = dict(model_type="gpt_neox", num_hidden_layers=12, num_attention_heads=12,
               intermediate_size=3072, vocab_size=50304, max_position_embeddings=2048)
    with pytest.raises(ModelConfigError, match="missing 'hidden_size' .transformers' default"):
        architecture_from_config(cfg, "x.json")
    assert architecture_from_config({**cfg, "hidden_size": 768}, "x.json").stacks[0] \
        .hidden_size == 768


def test_prequantized_bitsandbytes_weights_are_the_qlora_job_they_load_as():
    from vramplan import Job, estimate
    config = {**TINY_LLAMA, "quantization_config": dict(
        quant_method="bitsandbytes", load_in_4bit=True, bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True)}
    job = Job(model="x", batch_size=1, seq_len=32, peft={"method": "qlora"})
    report = estimate(job, model_config=config)
    assert any(n.startswith("pre-quantised bitsandbytes NF4") for n in report.notes)
    assert report.peak_allocated == estimate(job, model_config=TINY_LLAMA).peak_allocated


MISSING_DROPOUT = {  # configs that leave every dropout key out
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=512,
                 n_positions=64),
    "bert": dict(model_type="bert", hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
                 max_position_embeddings=64),
    "t5": dict(model_type="t5", d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
               vocab_size=512),
}


@pytest.mark.parametrize("family", sorted(MISSING_DROPOUT))
def test_a_missing_dropout_rate_is_transformers_default(family):
    # GPT-2, BERT and T5's config classes default their dropout to 0.1; vramplan read a
    # missing key as 0, so its model had no dropout masks where transformers' has them
    arch = architecture_from_config(MISSING_DROPOUT[family], "tiny")
    assert (arch.hidden_dropout, arch.attention_dropout) == (0.1, 0.1)
    explicit = {"gpt2": dict(resid_pdrop=0.0, attn_pdrop=0.0), "t5": dict(dropout_rate=0.0),
                "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)}
    arch = architecture_from_config({**MISSING_DROPOUT[family], **explicit[family]}, "tiny")
    assert (arch.hidden_dropout, arch.attention_dropout) == (0.0, 0.0)


def test_dropout_defaults_file_matches_the_installed_transformers():
    pytest.importorskip("transformers")
    import tomllib
    from pathlib import Path

    from transformers import CONFIG_MAPPING

    import vramplan.models.derive as derive
    data = tomllib.loads(Path(derive.__file__).with_name("dropout_defaults.toml").read_text())
    for family, rates in data.items():
        if isinstance(rates, dict):
            built = CONFIG_MAPPING[family]()
            assert {key: getattr(built, key) for key in rates} == rates
