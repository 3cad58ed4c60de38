"""Architecture from a Hugging Face config.json dict, one builder per model_type.

Parameter counts are exact: they reproduce what transformers builds from the same config
(unique parameters, tied embeddings counted once). Nothing here imports torch or transformers.

Linear.name is the last component of the module name inside the block, the way peft's
`target_modules` matches it ("q_proj", "c_attn", "query", "dense", "wi_0" ...). A block can
hold several linears with the same name (BERT's three "dense", a decoder's self- and
cross-attention "q"); like peft, a target name selects all of them.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import tomllib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import hooks
from ..errors import ModelConfigError
from .arch import Architecture, LatentAttention, Linear, Stack

_MISSING = object()
# Larger sizes are typos: no tensor dimension or layer count comes near 2**31 (and torch
# indexes with int32 in places), and they would overflow the arithmetic downstream.
MAX_CONFIG_INT = 2**31 - 1


@functools.cache
def _dropout_defaults() -> dict[str, dict[str, float]]:
    """model_type -> config key -> the rate transformers takes when the key is missing."""
    with open(Path(__file__).with_name("dropout_defaults.toml"), "rb") as f:
        data = tomllib.load(f)
    return {family: rates for family, rates in data.items() if isinstance(rates, dict)}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Cfg:
    """Read access to a config dict that names the key and the file when a key is missing."""

    def __init__(self, config: dict, name: str):
        self.raw, self.name = config, name
        self.model_type = config.get("model_type", "?")

    def req(self, *keys: str) -> Any:
        """The first of keys that is present (aliases), else ModelConfigError."""
        for k in keys:
            v = self.raw.get(k, _MISSING)
            if v is not _MISSING and v is not None:
                return v
        alias = f" (or {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""
        raise ModelConfigError(
            f"{self.name}: config is missing required key {keys[0]!r}{alias} for model_type "
            f"{self.model_type!r}; add it to the config.json")

    def get(self, key: str, default: Any = None) -> Any:
        v = self.raw.get(key, default)
        return default if v is None else v

    def int(self, *keys: str) -> int:
        v = self.req(*keys)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or int(v) != v or v < 0 or v > MAX_CONFIG_INT):
            raise ModelConfigError(
                f"{self.name}: config key {keys[0]!r} must be a whole number from 0 to "
                f"{MAX_CONFIG_INT:,}, got {_short(v)}")
        return int(v)

    def int_list(self, key: str) -> list[int]:
        values = self.req(key)
        if not isinstance(values, list) or not values:
            raise ModelConfigError(f"{self.name}: config key {key!r} must be a list of whole "
                                   f"numbers, got {_short(values)}")
        return [_Cfg({key: v}, self.name).int(key) for v in values]

    def opt_int(self, key: str, default: int) -> int:
        return self.int(key) if self.raw.get(key) is not None else default

    def float(self, key: str) -> float:
        """A probability (dropout rates are the only floats read); a missing one is what
        transformers' config class defaults it to (dropout_defaults.toml)."""
        v = self.raw.get(key)
        if v is None:
            return _dropout_defaults().get(self.model_type, {}).get(key, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ModelConfigError(
                f"{self.name}: config key {key!r} must be a number from 0 to 1, got {_short(v)}")
        return float(v)

    def num_labels(self, default: int) -> int:
        id2label = self.raw.get("id2label")
        if isinstance(id2label, dict) and id2label:
            return len(id2label)
        return self.opt_int("num_labels", default)


def _lin(name: str, i: int, o: int, bias: bool, count: int = 1) -> Linear:
    return Linear(name, int(i), int(o), bool(bias), int(count))


def _lin_params(linears: tuple[Linear, ...] | list[Linear]) -> int:
    return sum((lin.in_features * lin.out_features + (lin.out_features if lin.bias else 0))
               * lin.count for lin in linears)


def _ln(h: int) -> int:      # LayerNorm: weight + bias
    return 2 * h


# ---------------------------------------------------------------- llama-like decoders


# Pre-norm RMSNorm decoders with rotary positions, SwiGLU/GeGLU MLP and (optional) GQA.
# qwen3/qwen3_moe/olmo2 add RMSNorms on the queries and keys (qk-norm): per head (head_dim
# weights, Qwen3) or over all heads (nh*hd and kv*hd weights, OLMo-2); OLMo-2 normalises
# after attention and MLP instead of before.
# gemma3_text is Gemma-2's block (four norms) with Qwen3's per-head qk-norm.
_LLAMA_LIKE = ("llama", "mistral", "mixtral", "qwen2", "gemma2", "phi3", "qwen3", "qwen3_moe",
               "olmo2", "gemma3_text")
_GEMMA = ("gemma2", "gemma3_text")


def _llama_like(c: _Cfg) -> Architecture:
    mt = c.model_type
    h = c.int("hidden_size")
    layers = c.int("num_hidden_layers")
    nh = c.int("num_attention_heads")
    kv = c.opt_int("num_key_value_heads", nh)
    hd = c.opt_int("head_dim", h // nh if nh else 0)
    inter = c.int("intermediate_size")
    vocab = c.int("vocab_size")
    tie = bool(c.get("tie_word_embeddings", mt in _GEMMA))

    if mt == "qwen2":
        qkv_bias, o_bias = True, False
    elif mt in ("llama", "qwen3", "qwen3_moe", "olmo2", *_GEMMA):
        qkv_bias = o_bias = bool(c.get("attention_bias", False))
    else:
        qkv_bias = o_bias = False
    mlp_bias = bool(c.get("mlp_bias", False)) if mt == "llama" else False

    if mt == "phi3":
        attn = [_lin("qkv_proj", h, (nh + 2 * kv) * hd, False), _lin("o_proj", nh * hd, h, False)]
    else:
        attn = [_lin("q_proj", h, nh * hd, qkv_bias), _lin("k_proj", h, kv * hd, qkv_bias),
                _lin("v_proj", h, kv * hd, qkv_bias), _lin("o_proj", nh * hd, h, o_bias)]

    experts, top_k = 1, 1
    if mt == "qwen3_moe":
        # every layer sparse (the Qwen3 MoE releases); other layouts are not one uniform stack
        if c.get("mlp_only_layers") or c.opt_int("decoder_sparse_step", 1) != 1:
            raise ModelConfigError(
                f"{c.name}: qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step "
                "> 1) is not one uniform stack the formula models; use --engine trace")
        experts = c.int("num_experts")
        top_k = c.int("num_experts_per_tok")
        inter = c.int("moe_intermediate_size")
        # checkpoint names (mlp.experts.N.gate_proj/up_proj/down_proj), per expert;
        # "gate" is the router
        mlp = [_lin("gate", h, experts, False), _lin("gate_proj", h, inter, False, experts),
               _lin("up_proj", h, inter, False, experts),
               _lin("down_proj", inter, h, False, experts)]
    elif mt == "mixtral":
        experts = c.int("num_local_experts")
        top_k = c.int("num_experts_per_tok")
        # transformers 5 fuses w1/w3 into experts.gate_up_proj; the names are the checkpoint's
        # (block_sparse_moe.experts.N.w1/w3/w2), per expert. "gate" is the router.
        mlp = [_lin("gate", h, experts, False), _lin("w1", h, inter, False, experts),
               _lin("w3", h, inter, False, experts), _lin("w2", inter, h, False, experts)]
    elif mt == "phi3":
        mlp = [_lin("gate_up_proj", h, 2 * inter, False), _lin("down_proj", inter, h, False)]
    else:
        mlp = [_lin("gate_proj", h, inter, mlp_bias), _lin("up_proj", h, inter, mlp_bias),
               _lin("down_proj", inter, h, mlp_bias)]

    linears = tuple(attn + mlp)
    norms = (4 if mt in _GEMMA else 2) * h            # RMSNorm: weight only
    if mt in ("qwen3", "qwen3_moe", "gemma3_text"):
        norms += 2 * hd                               # q_norm, k_norm over one head
    elif mt == "olmo2":
        norms += (nh + kv) * hd                       # q_norm, k_norm over all heads
    stack = Stack(role="decoder", num_layers=layers, hidden_size=h, num_heads=nh, num_kv_heads=kv,
                  head_dim=hd, intermediate_size=inter, mlp="gated", norm="rmsnorm",
                  linears=linears, params_per_layer=_lin_params(linears) + norms,
                  num_experts=experts, experts_per_token=top_k,
                  qk_norm=mt in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text"))
    num_labels = c.num_labels(2)
    return Architecture(
        name=c.name, model_type=mt, kind="decoder", stacks=(stack,),
        embedding_params=vocab * h, other_params=h,
        head_params={"causal-lm": 0 if tie else vocab * h, "seq-classification": h * num_labels},
        default_task="causal-lm", vocab_size=vocab,
        max_positions=c.opt_int("max_position_embeddings", 0) or None, tied_embeddings=tie,
        hidden_dropout=c.float("resid_pdrop") if mt == "phi3" else 0.0,
        attention_dropout=c.float("attention_dropout"), num_labels=num_labels)


# ---------------------------------------------------------------- deepseek (MLA + MoE)


# transformers 5.24's defaults for the keys a DeepSeek config may leave out
# (models/deepseek_v2|v3/configuration_deepseek_v2|v3.py); V3's are DeepSeek-V3's values
_DEEPSEEK_DEFAULTS = {
    "deepseek_v2": dict(first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536,
                        n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=1407),
    "deepseek_v3": dict(first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
                        n_routed_experts=256, n_shared_experts=1, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=2048,
                        num_experts_per_tok=8),
}


def _deepseek(c: _Cfg) -> Architecture:
    """DeepSeek-V2/V3 (transformers' DeepseekV2/V3ForCausalLM): multi-head latent attention
    in every block; the first `first_k_dense_replace` blocks have a dense SwiGLU MLP, the
    rest a MoE of routed experts (one 3-D parameter each for gate/up and down), a router
    and shared experts (one SwiGLU MLP of n_shared_experts x moe_intermediate_size). They
    are two stacks: dense, then sparse. DeepSeek-V3's multi-token-prediction layer
    (num_nextn_predict_layers) is not built by transformers, so it is not counted."""
    mt = c.model_type
    defaults = _DEEPSEEK_DEFAULTS[mt]

    def opt(key: str) -> int:
        return c.opt_int(key, defaults[key]) if key in defaults else c.int(key)

    h, layers, nh = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads")
    vocab, inter = c.int("vocab_size"), c.int("intermediate_size")
    # an explicit null q_lora_rank means one q_proj (DeepSeek-V2-Lite); a missing key, the default
    q_rank = c.raw.get("q_lora_rank", defaults["q_lora_rank"])
    q_rank = 0 if q_rank is None else _Cfg({"q_lora_rank": q_rank}, c.name).int("q_lora_rank")
    mla = LatentAttention(q_rank, opt("kv_lora_rank"), opt("qk_nope_head_dim"),
                          opt("qk_rope_head_dim"), opt("v_head_dim"))
    experts, top_k = opt("n_routed_experts"), opt("num_experts_per_tok")
    moe_inter, shared = opt("moe_intermediate_size"), opt("n_shared_experts")
    dense_layers = min(opt("first_k_dense_replace"), layers)
    attn_bias = bool(c.get("attention_bias", False))
    mlp_bias = bool(c.get("mlp_bias", False)) if mt == "deepseek_v2" else False
    tie = bool(c.get("tie_word_embeddings", False))

    dq = mla.qk_head_dim
    if q_rank:
        query = [Linear("q_a_proj", h, q_rank, attn_bias, role="attn_in"),
                 Linear("q_b_proj", q_rank, nh * dq, False, role="attn_latent")]
    else:
        query = [Linear("q_proj", h, nh * dq, False, role="attn_in")]
    attn = query + [
        Linear("kv_a_proj_with_mqa", h, mla.kv_lora_rank + mla.qk_rope_head_dim, attn_bias,
               role="attn_in"),
        Linear("kv_b_proj", mla.kv_lora_rank, nh * (mla.qk_nope_head_dim + mla.v_head_dim),
               False, role="attn_latent"),
        Linear("o_proj", nh * mla.v_head_dim, h, attn_bias, role="attn_out")]
    # RMSNorms: input and post-attention (h each), q_a_layernorm, kv_a_layernorm
    norms = 2 * h + q_rank + mla.kv_lora_rank

    def gated(width: int, role_in: str, role_out: str) -> list[Linear]:
        return [Linear("gate_proj", h, width, mlp_bias, role=role_in),
                Linear("up_proj", h, width, mlp_bias, role=role_in),
                Linear("down_proj", width, h, mlp_bias, role=role_out)]

    def stack(n: int, mlp: list[Linear], **moe) -> Stack:
        linears = tuple(attn + mlp)
        return Stack(role="decoder", num_layers=n, hidden_size=h, num_heads=nh, num_kv_heads=nh,
                     head_dim=dq, intermediate_size=moe.pop("width", inter), mlp="gated",
                     norm="rmsnorm", linears=linears,
                     params_per_layer=_lin_params(linears) + norms, latent_attention=mla,
                     **moe)

    stacks = []
    if dense_layers:
        stacks.append(stack(dense_layers, gated(inter, "mlp_in", "mlp_out")))
    if layers > dense_layers:
        # checkpoint names (mlp.experts.N.gate_proj/up_proj/down_proj) with the experts'
        # prefix, apart from the shared experts' and dense MLPs' nn.Linear; "gate" is the
        # router. (LoRA targets on these names are refused: families.PEFT_EXPERT_TARGETS)
        routed = [Linear("gate", h, experts, False, role="router"),
                  *(Linear(f"experts.{n}", i, o, False, experts, role)
                    for n, i, o, role in (("gate_proj", h, moe_inter, "mlp_in"),
                                          ("up_proj", h, moe_inter, "mlp_in"),
                                          ("down_proj", moe_inter, h, "mlp_out")))]
        stacks.append(stack(layers - dense_layers,
                            routed + gated(moe_inter * shared, "shared_in", "shared_out"),
                            width=moe_inter, num_experts=experts, experts_per_token=top_k,
                            router="sigmoid" if mt == "deepseek_v3" else "softmax",
                            shared_intermediate_size=moe_inter * shared))
    num_labels = c.num_labels(2)
    return Architecture(
        name=c.name, model_type=mt, kind="decoder", stacks=tuple(stacks),
        embedding_params=vocab * h, other_params=h,
        head_params={"causal-lm": 0 if tie else vocab * h, "seq-classification": h * num_labels},
        default_task="causal-lm", vocab_size=vocab,
        max_positions=c.opt_int("max_position_embeddings", 0) or None, tied_embeddings=tie,
        attention_dropout=c.float("attention_dropout"), num_labels=num_labels)


# ---------------------------------------------------------------- gpt2


def _gpt2(c: _Cfg) -> Architecture:
    h = c.int("n_embd", "hidden_size")
    layers = c.int("n_layer", "num_hidden_layers")
    nh = c.int("n_head", "num_attention_heads")
    inner = c.opt_int("n_inner", 4 * h)
    vocab = c.int("vocab_size")
    npos = c.int("n_positions", "max_position_embeddings")
    tie = bool(c.get("tie_word_embeddings", True))
    linears = (_lin("c_attn", h, 3 * h, True), _lin("c_proj", h, h, True),
               _lin("c_fc", h, inner, True), _lin("c_proj", inner, h, True))
    stack = Stack(role="decoder", num_layers=layers, hidden_size=h, num_heads=nh, num_kv_heads=nh,
                  head_dim=h // nh if nh else 0, intermediate_size=inner, mlp="gelu",
                  norm="layernorm",
                  linears=linears, params_per_layer=_lin_params(linears) + 2 * _ln(h))
    num_labels = c.num_labels(2)
    return Architecture(
        name=c.name, model_type="gpt2", kind="decoder", stacks=(stack,),
        embedding_params=(vocab + npos) * h, other_params=_ln(h),
        head_params={"causal-lm": 0 if tie else vocab * h, "seq-classification": h * num_labels},
        default_task="causal-lm", vocab_size=vocab, max_positions=npos, tied_embeddings=tie,
        hidden_dropout=c.float("resid_pdrop"), attention_dropout=c.float("attn_pdrop"),
        num_labels=num_labels)


# ---------------------------------------------------------------- mpt


# Keys whose default differs between transformers' MptConfig (5.24) and llm-foundry's
# MPTConfig (the publisher's, mosaicml/llm-foundry@8c8dd48f
# llmfoundry/models/mpt/configuration_mpt.py, models/utils/config_defaults.py): a config
# without them means different models to the two, so they are required.
_MPT_AMBIGUOUS = {"no_bias": "transformers defaults it to true, llm-foundry to false",
                  "attn_config.alibi": "transformers defaults it to true, llm-foundry to false"}
_MPT_LAYERNORMS = ("layernorm", "low_precision_layernorm")
_MPT_RMSNORMS = ("rmsnorm", "low_precision_rmsnorm", "triton_rmsnorm")


def _mpt(c: _Cfg) -> Architecture:
    """MPT as llm-foundry builds it (llmfoundry/models/mpt/modeling_mpt.py, layers/
    attention.py, layers/ffn.py): pre-norm blocks of norm_1 -> fused Wqkv (grouped-query
    when kv_n_heads < n_heads) -> out_proj, norm_2 -> up_proj -> GELU -> down_proj of width
    expansion_ratio x d_model; every linear and norm has a bias unless no_bias (attention_bias
    overrides it for Wqkv); positions from ALiBi or rotary (no parameters) or a learned table
    (learned_pos_emb, which alibi and rope turn off); the LM head tied to wte by default.
    transformers' MptForCausalLM builds the no-bias, 4x, ALiBi, multi-head case only
    (mpt_transformers_gaps)."""
    attn = c.get("attn_config", {})
    if not isinstance(attn, dict):
        raise ModelConfigError(f"{c.name}: config key 'attn_config' must be an object, got "
                               f"{_short(attn)}")
    ffn = c.get("ffn_config", {})
    ffn = ffn if isinstance(ffn, dict) else {}
    missing = [k for k in _MPT_AMBIGUOUS
               if (attn.get(k.split(".")[1]) if "." in k else c.raw.get(k)) is None]
    if missing:
        raise ModelConfigError(
            f"{c.name}: mpt config is missing {', '.join(repr(k) for k in missing)} ("
            + "; ".join(_MPT_AMBIGUOUS[k] for k in missing) + "): add it to the config.json")
    a = _Cfg({f"attn_config.{k}": v for k, v in attn.items()}, c.name)  # messages name the path
    a.model_type = "mpt"
    d, nh, layers = c.int("d_model"), c.int("n_heads"), c.int("n_layers")
    vocab, npos = c.int("vocab_size"), c.opt_int("max_seq_len", 2048)
    hd = c.opt_int("head_dim", d // nh if nh else 0)
    ratio = c.get("expansion_ratio", 4)
    ffn_hidden = ffn.get("ffn_hidden_size")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (
            0 < ratio * d <= MAX_CONFIG_INT):
        raise ModelConfigError(f"{c.name}: config key 'expansion_ratio' must be a positive "
                               f"number, got {_short(ratio)}")
    inter = (_Cfg(ffn, c.name).int("ffn_hidden_size") if ffn_hidden is not None
             else int(d * ratio))
    attn_type = str(attn.get("attn_type", "multihead_attention"))
    kv = {"multihead_attention": nh, "multiquery_attention": 1}.get(attn_type)
    if attn_type == "grouped_query_attention":
        kv = a.int("attn_config.kv_n_heads")
    if kv is None:
        raise ModelConfigError(f"{c.name}: unknown MPT attn_type {attn_type!r}: use "
                               "multihead_attention, multiquery_attention or "
                               "grouped_query_attention")
    ffn_type = str(ffn.get("ffn_type", "mptmlp"))
    if ffn_type not in ("mptmlp", "mptglu"):
        raise ModelConfigError(f"{c.name}: MPT ffn_type {ffn_type!r} (mixture of experts or "
                               "TransformerEngine) is not modelled: the formula reads mptmlp "
                               "and mptglu")
    norm_type = str(c.get("norm_type", "low_precision_layernorm")).lower()
    if norm_type not in _MPT_LAYERNORMS + _MPT_RMSNORMS:
        raise ModelConfigError(f"{c.name}: MPT norm_type {norm_type!r} is not modelled: the "
                               f"formula reads {', '.join(_MPT_LAYERNORMS + _MPT_RMSNORMS)}")
    if attn.get("qk_gn") or attn.get("reuse_kv_layer_idx") is not None or c.get("block_overrides"):
        raise ModelConfigError(f"{c.name}: MPT qk_gn, reuse_kv_layer_idx and block_overrides "
                               "(blocks that differ) are not modelled: use a config without "
                               "them")
    bias = not bool(c.get("no_bias"))
    qkv_bias = bool(c.get("attention_bias", bias))
    rmsnorm = norm_type in _MPT_RMSNORMS

    def norm(width: int) -> int:  # llm-foundry's no_bias also drops the norms' biases
        return width * (1 + (bias and not rmsnorm))

    if attn.get("fused_qkv", True):
        qkv = [Linear("Wqkv", d, (nh + 2 * kv) * hd, qkv_bias, role="attn_in")]
    else:
        qkv = [Linear("Wq", d, nh * hd, qkv_bias, role="attn_in"),
               Linear("Wk", d, kv * hd, qkv_bias, role="attn_in"),
               Linear("Wv", d, kv * hd, qkv_bias, role="attn_in")]
    gated = ffn_type == "mptglu"
    mlp = ([Linear("gate_proj", d, inter, bias, role="mlp_in")] if gated else []) + [
        Linear("up_proj", d, inter, bias, role="mlp_in"),
        Linear("down_proj", inter, d, bias, role="mlp_out")]
    linears = tuple(qkv + [Linear("out_proj", nh * hd, d, bias, role="attn_out")] + mlp)
    qk_ln = bool(attn.get("qk_ln"))
    norms = 2 * norm(d) + (norm(nh * hd) + norm(kv * hd) if qk_ln else 0)
    stack = Stack(role="decoder", num_layers=layers, hidden_size=d, num_heads=nh,
                  num_kv_heads=kv, head_dim=hd, intermediate_size=inter,
                  mlp="gated" if gated else "gelu", norm="rmsnorm" if rmsnorm else "layernorm",
                  linears=linears, params_per_layer=_lin_params(linears) + norms, qk_norm=qk_ln)
    alibi, rope = bool(attn.get("alibi")), bool(attn.get("rope"))
    learned = bool(c.get("learned_pos_emb", True)) and not (alibi or rope)
    tie = bool(c.get("tie_word_embeddings", True))
    num_labels = c.num_labels(2)
    return Architecture(
        name=c.name, model_type="mpt", kind="decoder", stacks=(stack,),
        embedding_params=(vocab + (npos if learned else 0)) * d, other_params=norm(d),
        head_params={"causal-lm": 0 if tie else vocab * d, "seq-classification": d * num_labels},
        default_task="causal-lm", vocab_size=vocab, max_positions=npos, tied_embeddings=tie,
        hidden_dropout=c.float("resid_pdrop"),
        attention_dropout=a.float("attn_config.attn_pdrop"),
        num_labels=num_labels,
        positions="alibi" if alibi else "rotary" if rope else "learned" if learned else "none")


def mpt_transformers_gaps(config: dict) -> list[str]:
    """What transformers' MptForCausalLM (models/mpt/modeling_mpt.py, 5.24) would build
    differently from this MPT config: it always builds bias-free linears and norms, a 4 x
    d_model MLP, ALiBi, fused multi-head attention with d_model / n_heads heads and
    LayerNorm, whatever the config says. The trace builds that model, so it refuses these."""
    attn = config.get("attn_config") or {}
    ffn = config.get("ffn_config") or {}
    attn = attn if isinstance(attn, dict) else {}
    ffn = ffn if isinstance(ffn, dict) else {}
    checks = [
        (not config.get("no_bias", True), "biases (no_bias false)"),
        (config.get("attention_bias") is True, "attention_bias"),
        (config.get("expansion_ratio", 4) != 4 or ffn.get("ffn_hidden_size") is not None,
         f"expansion_ratio {config.get('expansion_ratio')} (transformers builds 4)"),
        (not attn.get("alibi", True), "positions other than ALiBi"),
        (attn.get("rope"), "rotary positions"),
        (attn.get("attn_type", "multihead_attention") != "multihead_attention",
         f"attn_type {attn.get('attn_type')}"),
        (attn.get("qk_ln") or attn.get("qk_gn"), "qk_ln"),
        (attn.get("fused_qkv", True) is False, "unfused Wq/Wk/Wv"),
        (ffn.get("ffn_type", "mptmlp") != "mptmlp", f"ffn_type {ffn.get('ffn_type')}"),
        (config.get("head_dim") not in (None, (config.get("d_model") or 0)
                                        // max(1, config.get("n_heads") or 1)), "head_dim"),
        (str(config.get("norm_type", "low_precision_layernorm")).lower()
         not in _MPT_LAYERNORMS, f"norm_type {config.get('norm_type')}"),
    ]
    return [why for gap, why in checks if gap]


# ---------------------------------------------------------------- bert / roberta


def _bert_like(c: _Cfg) -> Architecture:
    mt = c.model_type
    h = c.int("hidden_size")
    layers = c.int("num_hidden_layers")
    nh = c.int("num_attention_heads")
    inter = c.int("intermediate_size")
    vocab = c.int("vocab_size")
    npos = c.int("max_position_embeddings")
    types = c.opt_int("type_vocab_size", 2)
    tie = bool(c.get("tie_word_embeddings", True))
    linears = (_lin("query", h, h, True), _lin("key", h, h, True), _lin("value", h, h, True),
               _lin("dense", h, h, True),            # attention.output.dense
               _lin("dense", h, inter, True),        # intermediate.dense
               _lin("dense", inter, h, True))        # output.dense
    stack = Stack(role="encoder", num_layers=layers, hidden_size=h, num_heads=nh, num_kv_heads=nh,
                  head_dim=h // nh if nh else 0, intermediate_size=inter, mlp="gelu",
                  norm="layernorm",
                  linears=linears, params_per_layer=_lin_params(linears) + 2 * _ln(h))
    num_labels = c.num_labels(2)
    # masked-lm: transform dense + LayerNorm + output bias (decoder weight tied to word embeddings)
    mlm = h * h + h + _ln(h) + vocab + (0 if tie else vocab * h)
    # seq-classification: bert = pooler dense + classifier; roberta = classifier dense +
    # out_proj (no pooler). Same count.
    cls = h * h + h + h * num_labels + num_labels
    # roberta's positions start at pad_token_id + 1
    max_positions = npos - c.opt_int("pad_token_id", 1) - 1 if mt == "roberta" else npos
    return Architecture(
        name=c.name, model_type=mt, kind="encoder", stacks=(stack,),
        embedding_params=(vocab + npos + types) * h + _ln(h), other_params=0,
        head_params={"masked-lm": mlm, "seq-classification": cls}, default_task="masked-lm",
        vocab_size=vocab, max_positions=max_positions, tied_embeddings=tie,
        hidden_dropout=c.float("hidden_dropout_prob"),
        attention_dropout=c.float("attention_probs_dropout_prob"), num_labels=num_labels)


# ---------------------------------------------------------------- t5


def _t5(c: _Cfg) -> Architecture:
    d = c.int("d_model")
    dff = c.int("d_ff")
    dkv = c.int("d_kv")
    nh = c.int("num_heads")
    enc_layers = c.int("num_layers")
    dec_layers = c.opt_int("num_decoder_layers", enc_layers)
    vocab = c.int("vocab_size")
    buckets = c.opt_int("relative_attention_num_buckets", 32)
    proj = str(c.get("feed_forward_proj", "relu"))
    gated = proj.startswith("gated-")
    act = proj.split("-")[-1]
    # transformers 5 always ties lm_head to the shared embedding; real T5 v1.1 / flan-t5
    # checkpoints set tie_word_embeddings=false and carry their own lm_head.
    tie = bool(c.get("tie_word_embeddings", True))
    inner = nh * dkv
    attn = [_lin("q", d, inner, False), _lin("k", d, inner, False), _lin("v", d, inner, False),
            _lin("o", inner, d, False)]
    ff = ([_lin("wi_0", d, dff, False), _lin("wi_1", d, dff, False)] if gated
          else [_lin("wi", d, dff, False)]) + [_lin("wo", dff, d, False)]
    enc_lin, dec_lin = tuple(attn + ff), tuple(attn + attn + ff)
    mlp = "gated" if gated else ("relu" if act == "relu" else "gelu")
    common = dict(hidden_size=d, num_heads=nh, num_kv_heads=nh, head_dim=dkv, intermediate_size=dff,
                  mlp=mlp, norm="rmsnorm")
    enc = Stack(role="encoder", num_layers=enc_layers, linears=enc_lin,
                params_per_layer=_lin_params(enc_lin) + 2 * d, **common)
    dec = Stack(role="decoder", num_layers=dec_layers, linears=dec_lin, cross_attention=True,
                params_per_layer=_lin_params(dec_lin) + 3 * d, **common)
    drop = c.float("dropout_rate")
    return Architecture(
        name=c.name, model_type="t5", kind="encoder-decoder", stacks=(enc, dec),
        embedding_params=vocab * d,
        # relative attention bias (first block of each stack) + the two final norms
        other_params=2 * buckets * nh + 2 * d,
        head_params={"seq2seq": 0 if tie else vocab * d}, default_task="seq2seq",
        # relative positions accept any length; n_positions is the length T5 was trained on,
        # the default sequence length (as the trace's model builder reads it too)
        vocab_size=vocab, max_positions=c.opt_int("n_positions", 0) or None, tied_embeddings=tie,
        hidden_dropout=drop, attention_dropout=drop)


# ---------------------------------------------------------------- vit


def _vit(c: _Cfg) -> Architecture:
    h = c.int("hidden_size")
    layers = c.int("num_hidden_layers")
    nh = c.int("num_attention_heads")
    inter = c.int("intermediate_size")
    image = c.opt_int("image_size", 224)
    patch = c.opt_int("patch_size", 16)
    chans = c.opt_int("num_channels", 3)
    qkv_bias = bool(c.get("qkv_bias", True))
    # google/vit-huge-patch14-224-in21k has no labels (a ViTModel); 1000 = ImageNet-1k fine-tune
    num_labels = c.num_labels(1000)
    # transformers 5 names (ViT's query/key/value/dense became q/k/v/o_proj and mlp.fc1/fc2),
    # so LoRA targets mean the same modules in the formula and in the built model
    linears = (_lin("q_proj", h, h, qkv_bias), _lin("k_proj", h, h, qkv_bias),
               _lin("v_proj", h, h, qkv_bias), _lin("o_proj", h, h, True),
               _lin("fc1", h, inter, True), _lin("fc2", inter, h, True))
    stack = Stack(role="encoder", num_layers=layers, hidden_size=h, num_heads=nh, num_kv_heads=nh,
                  head_dim=h // nh if nh else 0, intermediate_size=inter, mlp="gelu",
                  norm="layernorm",
                  linears=linears, params_per_layer=_lin_params(linears) + 2 * _ln(h),
                  sequence="patches")
    patches = (image // patch) ** 2 if patch else 0
    embed = h + (patches + 1) * h + chans * patch * patch * h + h   # cls, positions, conv
    return Architecture(
        name=c.name, model_type="vit", kind="vision", stacks=(stack,),
        embedding_params=embed, other_params=_ln(h),
        head_params={"image-classification": h * num_labels + num_labels},
        default_task="image-classification", max_positions=None,
        hidden_dropout=c.float("hidden_dropout_prob"),
        attention_dropout=c.float("attention_probs_dropout_prob"),
        image_size=image, patch_size=patch, num_channels=chans, num_labels=num_labels)


# ---------------------------------------------------------------- resnet


def _resnet(c: _Cfg) -> Architecture:
    chans = c.opt_int("num_channels", 3)
    emb = c.int("embedding_size")
    sizes, depths = c.int_list("hidden_sizes"), c.int_list("depths")
    if len(sizes) != len(depths):
        raise ModelConfigError(f"{c.name}: hidden_sizes and depths must have the same length")
    layer_type = str(c.get("layer_type", "bottleneck"))
    if layer_type not in ("bottleneck", "basic"):
        raise ModelConfigError(f"{c.name}: unsupported resnet layer_type {layer_type!r}")
    first_down = bool(c.get("downsample_in_first_stage", False))
    down_in_bottleneck = bool(c.get("downsample_in_bottleneck", False))
    image = c.opt_int("image_size", 224)
    num_labels = c.num_labels(1000)

    def conv_bn(i: int, o: int, k: int) -> int:   # conv without bias + BatchNorm weight/bias
        return i * o * k * k + 2 * o

    # Saved-for-backward tensors, per sample, as autograd keeps them in training mode (ReLU not
    # in place). Each conv saves its input (= the previous ReLU/max-pool output, counted once),
    # each BatchNorm saves its input (the conv output), each ReLU its output.
    fmaps: list[tuple[int, int]] = [(chans, 1),            # the image (saved by the stem conv)
                                    (emb, 2), (emb, 2),    # stem conv out, ReLU out
                                    (emb, 4), (emb, 4)]    # max-pool indices (int64), max-pool out
    params = 0
    in_ch, r = emb, 4
    for i, (out, depth) in enumerate(zip(sizes, depths)):
        for j in range(depth):
            s = (2 if (i > 0 or first_down) else 1) if j == 0 else 1
            if in_ch != out or s != 1:                      # shortcut conv + BN
                params += conv_bn(in_ch, out, 1)
                fmaps.append((out, r * s))
            if layer_type == "bottleneck":
                red = out // 4
                params += conv_bn(in_ch, red, 1) + conv_bn(red, red, 3) + conv_bn(red, out, 1)
                r1 = r * s if down_in_bottleneck else r
                fmaps += [(red, r1), (red, r1), (red, r * s), (red, r * s), (out, r * s)]
            else:
                params += conv_bn(in_ch, out, 3) + conv_bn(out, out, 3)
                fmaps += [(out, r * s), (out, r * s), (out, r * s)]
            fmaps.append((out, r * s))                       # ReLU after the residual add
            in_ch, r = out, r * s
    fmaps.append((in_ch, image))   # pooled features saved by the classifier: 1x1 at image_size
    return Architecture(
        name=c.name, model_type="resnet", kind="cnn", stacks=(),
        embedding_params=conv_bn(chans, emb, 7), other_params=params,
        head_params={"image-classification": in_ch * num_labels + num_labels},
        default_task="image-classification", max_positions=None,
        image_size=image, num_channels=chans, feature_maps=tuple(fmaps), num_labels=num_labels)


# ---------------------------------------------------------------- whisper


def _whisper(c: _Cfg) -> Architecture:
    d = c.int("d_model")
    enc_layers = c.int("encoder_layers")
    dec_layers = c.int("decoder_layers")
    enc_heads = c.int("encoder_attention_heads")
    dec_heads = c.int("decoder_attention_heads")
    enc_ffn = c.int("encoder_ffn_dim")
    dec_ffn = c.int("decoder_ffn_dim")
    vocab = c.int("vocab_size")
    mels = c.int("num_mel_bins")
    src = c.int("max_source_positions")
    tgt = c.int("max_target_positions")
    tie = bool(c.get("tie_word_embeddings", True))

    def attn() -> list[Linear]:
        return [_lin("q_proj", d, d, True), _lin("k_proj", d, d, False), _lin("v_proj", d, d, True),
                _lin("out_proj", d, d, True)]

    enc_lin = tuple(attn() + [_lin("fc1", d, enc_ffn, True), _lin("fc2", enc_ffn, d, True)])
    dec_lin = tuple(attn() + attn()
                    + [_lin("fc1", d, dec_ffn, True), _lin("fc2", dec_ffn, d, True)])
    enc = Stack(role="encoder", num_layers=enc_layers, hidden_size=d, num_heads=enc_heads,
                num_kv_heads=enc_heads, head_dim=d // enc_heads if enc_heads else 0,
                intermediate_size=enc_ffn,
                mlp="gelu", norm="layernorm", linears=enc_lin,
                params_per_layer=_lin_params(enc_lin) + 2 * _ln(d), sequence="audio")
    dec = Stack(role="decoder", num_layers=dec_layers, hidden_size=d, num_heads=dec_heads,
                num_kv_heads=dec_heads, head_dim=d // dec_heads if dec_heads else 0,
                intermediate_size=dec_ffn,
                mlp="gelu", norm="layernorm", linears=dec_lin, cross_attention=True,
                params_per_layer=_lin_params(dec_lin) + 3 * _ln(d))
    frontend = (mels * d * 3 + d) + (d * d * 3 + d)          # two conv1d, kernel 3
    return Architecture(
        name=c.name, model_type="whisper", kind="encoder-decoder", stacks=(enc, dec),
        embedding_params=frontend + src * d + (vocab + tgt) * d,
        other_params=2 * _ln(d),
        head_params={"speech-seq2seq": 0 if tie else vocab * d}, default_task="speech-seq2seq",
        vocab_size=vocab, max_positions=tgt, tied_embeddings=tie,
        hidden_dropout=c.float("dropout"), attention_dropout=c.float("attention_dropout"),
        num_mel_bins=mels,
        # frames of log-mel input: the second conv has stride 2, so 2 x the encoder positions
        max_source_positions=2 * src)


_BUILDERS: dict[str, Callable[[_Cfg], Architecture]] = {
    **{mt: _llama_like for mt in _LLAMA_LIKE},
    "gpt2": _gpt2, "bert": _bert_like, "roberta": _bert_like, "t5": _t5, "vit": _vit,
    "resnet": _resnet, "whisper": _whisper, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek,
    "mpt": _mpt,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_BUILDERS))

# families whose transformers class builds fewer variants than their configs describe
_TRANSFORMERS_GAPS: dict[str, Callable[[dict], list[str]]] = {"mpt": mpt_transformers_gaps}


def transformers_gaps(config: dict) -> list[str]:
    """What transformers' class for this config's model_type would build differently from
    what the config describes (empty: the same model)."""
    gaps = _TRANSFORMERS_GAPS.get(str(config.get("model_type")))
    return gaps(config) if gaps else []


def architecture_from_config(config: dict, name: str, source: str = "") -> Architecture:
    """The Architecture of a Hugging Face config.json (as a dict).

    name is the catalog name or the path the config was read from (used in messages);
    source is where the config comes from (URL) for catalog models.
    """
    if not isinstance(config, dict):
        raise ModelConfigError(f"{name}: a config.json must hold a JSON object, "
                               f"got {type(config).__name__}")
    mt = config.get("model_type")
    if not mt:
        raise ModelConfigError(
            f"{name}: config has no 'model_type' key; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    text = language_model_config(config, name)
    if text is not None:
        inner, note = text
        arch = architecture_from_config(inner, name, source)
        object.__setattr__(arch, "notes", (*arch.notes, note))
        return arch
    builder = _BUILDERS.get(str(mt))
    if builder is None:
        return _from_built_model(config, name, source)
    _refuse_non_finite(config, name)
    arch = builder(_Cfg(config, name))
    problems = _problems(arch)
    if problems:
        raise ModelConfigError(f"{name}: invalid {mt} config (transformers would refuse it): "
                               + "; ".join(problems))
    stacks = tuple(replace(st, linears=_with_roles(st.linears)) for st in arch.stacks)
    object.__setattr__(arch, "stacks", stacks)
    object.__setattr__(arch, "source", source)
    object.__setattr__(arch, "extra", dict(config))
    return arch


# Vision-language configs: the language model's model_type when text_config leaves it out
# (transformers 5.24's defaults: Gemma3Config, LlavaConfig, ... text_config), and the
# families whose language model is one derive.py reads under another name (Qwen2-VL's and
# Qwen2.5-VL's text model is Qwen2's block: q/k/v biases, SwiGLU, RMSNorm; M-RoPE changes
# no shape)
_TEXT_MODEL_TYPE = {"gemma3": "gemma3_text", "llava": "llama", "llava_next": "llama",
                    "idefics3": "llama", "mistral3": "mistral", "paligemma": "gemma",
                    "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2"}
_TEXT_MODEL_ALIAS = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2"}
# transformers saves a sub-config without the values equal to its class defaults
# (PreTrainedConfig.to_diff_dict), so published text_configs leave them out (Gemma-3's its
# heads and vocabulary, LLaVA-1.5's a whole Llama-2-7B). The values are the classes'
# defaults in transformers 5.24 (models/gemma3|llama|mistral/configuration_*.py). Filled
# in with a note, never silently; keys a class derives (head_dim, kv heads) are not here.
_LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32,
                       max_position_embeddings=2048)
_TEXT_CONFIG_DEFAULTS = {
    "gemma3_text": dict(vocab_size=262208, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=256, query_pre_attn_scalar=256,
                        max_position_embeddings=131072),
    "llama": _LLAMA_DEFAULTS,
    "mistral": dict(_LLAMA_DEFAULTS, intermediate_size=14336, num_key_value_heads=8,
                    max_position_embeddings=131072),
}
# keys of the top-level Qwen2-VL config that are not its language model's
_VISION_KEYS = ("vision_config", "vision_start_token_id", "vision_end_token_id",
                "vision_token_id", "image_token_id", "video_token_id")


def language_model_config(config: dict, name: str) -> tuple[dict, str] | None:
    """(the language model's config, a note) of a vision-language config that keeps its
    text model in text_config (Gemma-3, LLaVA) or beside a vision_config (Qwen2-VL); None
    for any other config. Training text through the language model is what the engines
    model; the vision tower and projector are left out, and the note says so."""
    mt = str(config.get("model_type"))
    text = config.get("text_config")
    if mt in _BUILDERS or (not isinstance(text, dict) and not (
            mt in ("qwen2_vl", "qwen2_5_vl") and "hidden_size" in config)):
        return None
    if isinstance(text, dict):
        inner = dict(text)
        if "tie_word_embeddings" in config and "tie_word_embeddings" not in inner:
            inner["tie_word_embeddings"] = config["tie_word_embeddings"]
    else:
        inner = {k: v for k, v in config.items() if k not in _VISION_KEYS}
        inner["model_type"] = _TEXT_MODEL_TYPE[mt]
    rope = inner.get("rope_scaling")
    if isinstance(rope, dict) and "mrope" in (rope.get("type"), rope.get("rope_type")):
        # M-RoPE on text alone is 1-D rotary (its three position ids are equal), which the
        # text family's own class builds
        inner.pop("rope_scaling")
    inner_mt = inner.get("model_type") or _TEXT_MODEL_TYPE.get(mt)
    if not inner_mt:
        raise ModelConfigError(f"{name}: its text_config has no 'model_type' and {mt!r} is "
                               "not a vision-language family vramplan knows: add the language "
                               "model's model_type to text_config")
    inner["model_type"] = _TEXT_MODEL_ALIAS.get(inner_mt, inner_mt)
    vision = "vision tower and projector" if "vision_config" in config else "other towers"
    note = (f"{mt}: the language model ({inner['model_type']}, from "
            f"{'text_config' if isinstance(text, dict) else 'the config'}) is estimated for "
            f"text-only training; the {vision} are not counted (their weights, and image "
            "tokens, add to this)")
    filled = {k: v for k, v in _TEXT_CONFIG_DEFAULTS.get(inner["model_type"], {}).items()
              if inner.get(k) is None}
    if filled and isinstance(text, dict):
        inner.update(filled)
        note += ("; text_config leaves out what equals transformers' defaults, read as "
                 + ", ".join(f"{k}={v}" for k, v in filled.items()))
    return inner, note


# Reads the families without a builder here from the model transformers builds on the meta
# device (vramplan.training.meta_architecture). It is passed in (use_built_model_reader) by
# the package root, a layer above training, so that models/ never imports the torch side.
BuiltModelReader = Callable[[dict, str, str], Architecture]


def use_built_model_reader(reader: BuiltModelReader) -> None:
    """Set the reader of (config, name, source) for the model types derive.py has no builder
    for; vramplan/__init__.py sets one (in vramplan.hooks) that imports torch on first use."""
    hooks.built_model_reader = reader


def _from_built_model(config: dict, name: str, source: str) -> Architecture:
    """A family without a builder here: when torch and transformers are installed, the shapes
    are read from the model transformers builds on the meta device (the reader passed to
    use_built_model_reader), so that the catalog and the formula import no torch for the
    families this table knows."""
    mt = config["model_type"]
    if not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        raise ModelConfigError(
            f"{name}: the formula cannot read model_type {mt!r} without torch and "
            "transformers installed (it reads the shapes from the model transformers builds); "
            f"use --engine trace, or a model type it reads: {', '.join(SUPPORTED_MODEL_TYPES)}")
    _refuse_non_finite(config, name)
    reader = hooks.built_model_reader
    if reader is None:  # set by vramplan/__init__.py, which any import runs first
        raise ModelConfigError(f"{name}: no reader of built models was set for model_type "
                               f"{mt!r}; import vramplan (it passes one in) before "
                               "vramplan.models, or call use_built_model_reader")
    try:
        return reader(config, name, source)
    except ModelConfigError as error:
        raise ModelConfigError(f"{error}; the formula reads model types "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)} from their configs and "
                               "others from the model transformers builds") from None


_QUERY = {"q_proj", "q", "query", "c_attn", "qkv_proj"}   # starts an attention block
_KEY_VALUE = {"k_proj", "v_proj", "k", "v", "key", "value"}


def _with_roles(linears: tuple[Linear, ...]) -> tuple[Linear, ...]:
    """Tag each linear with what it reads (Linear.role), from the block's layer order:
    attention sets come first (the second one of a decoder block is cross-attention),
    their output projection follows, then the MLP, whose last linear is its output."""
    if all(ln.role for ln in linears):
        return linears  # set by the family's builder (DeepSeek)
    roles, attention_sets, in_attention = [], 0, False
    for ln in linears:
        cross = attention_sets > 1
        if ln.name in _QUERY:
            attention_sets += 1
            in_attention = True
            roles.append("cross_q" if attention_sets > 1 and ln.name != "c_attn" else "attn_in")
        elif in_attention and ln.name in _KEY_VALUE:
            roles.append("cross_kv" if cross else "attn_in")
        elif in_attention:
            roles.append("cross_out" if cross else "attn_out")
            in_attention = False
        elif ln.name == "gate" and ln.count == 1:
            roles.append("router")
        else:
            roles.append("mlp_in")
    last_mlp = max(i for i, role in enumerate(roles) if role == "mlp_in")
    roles[last_mlp] = "mlp_out"
    return tuple(replace(ln, role=role) for ln, role in zip(linears, roles))


def _refuse_non_finite(config: dict, name: str, where: str = "") -> None:
    """NaN and Infinity are not numbers a config can mean (JSON readers accept them)."""
    for key, value in config.items():
        path = f"{where}{key}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ModelConfigError(f"{name}: config key {path!r} is {value!r}: write a number")
        if isinstance(value, dict):
            _refuse_non_finite(value, name, f"{path}.")


def _problems(arch: Architecture) -> list[str]:
    """What makes a config unbuildable, each with what is allowed: the checks transformers'
    modules make when they are built (heads dividing the width, key/value groups, ...)."""
    problems = []
    for st in arch.stacks:
        role = st.role if len(arch.stacks) > 1 else "model"
        for field, value in (("layers", st.num_layers), ("hidden size", st.hidden_size),
                             ("attention heads", st.num_heads),
                             ("key/value heads", st.num_kv_heads), ("head size", st.head_dim),
                             ("intermediate size", st.intermediate_size)):
            if value < 1:
                problems.append(f"{role} {field} must be at least 1 (got {value})")
        if st.num_heads >= 1 and st.num_kv_heads >= 1 and st.num_heads % st.num_kv_heads:
            problems.append(f"{role} attention heads ({st.num_heads}) must be a multiple of "
                            f"the key/value heads ({st.num_kv_heads})")
        if st.experts_per_token > st.num_experts:
            problems.append(f"experts per token ({st.experts_per_token}) cannot exceed the "
                            f"experts ({st.num_experts})")
        if st.num_experts < 1:
            problems.append(f"experts must be at least 1 (got {st.num_experts})")
    if arch.model_type in _WIDTH_SPLIT_BY_HEADS:
        for st in arch.stacks:
            if st.num_heads >= 1 and st.hidden_size % st.num_heads:
                problems.append(f"hidden size {st.hidden_size} must be divisible by the "
                                f"{st.num_heads} attention heads")
    if arch.kind in ("decoder", "encoder", "encoder-decoder") and arch.vocab_size < 1:
        problems.append(f"vocab_size must be at least 1 (got {arch.vocab_size})")
    if arch.max_positions is not None and arch.max_positions < 1:
        problems.append(f"the maximum sequence length must be at least 1 (got "
                        f"{arch.max_positions})")
    if arch.kind in ("vision", "cnn"):
        if arch.image_size < 1 or arch.num_channels < 1:
            problems.append("image_size and num_channels must be at least 1")
        if arch.kind == "vision" and not 1 <= arch.patch_size <= arch.image_size:
            problems.append(f"patch_size must be from 1 to image_size {arch.image_size} "
                            f"(got {arch.patch_size})")
        if arch.kind == "cnn" and any(ch < 1 for ch, _ in arch.feature_maps):
            problems.append("every ResNet stage needs at least 4 channels (hidden_sizes) "
                            "and the stem embedding_size at least 1")
    if arch.kind == "encoder-decoder" and arch.stacks[0].sequence == "audio" and (
            arch.num_mel_bins < 1 or arch.max_source_positions < 1):
        problems.append("num_mel_bins and max_source_positions must be at least 1")
    if any(label < 0 for label in (arch.num_labels,)):
        problems.append("num_labels cannot be negative")
    return problems


# transformers splits the width into heads (head size = hidden // heads) and refuses a width
# that does not divide; Llama-like models may set head_dim instead, T5 sets d_kv.
_WIDTH_SPLIT_BY_HEADS = frozenset({"gpt2", "bert", "roberta", "vit", "whisper", "mpt"})
