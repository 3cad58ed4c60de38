"""What both engines must know about model families beyond their shapes, in one place.

The formula reads these to model a family's tensors; the trace's model builder reads them to
pick the same defaults and to say what it emulates. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.errors import JobError

# a learned position table: a longer sequence indexes past its end
LEARNED_POSITIONS = frozenset({"gpt2", "bert", "roberta", "whisper", "opt", "gpt_neo"})
# a position limit longer sequences cannot pass: learned tables, and MPT, whose ALiBi bias
# llm-foundry and transformers both size to max_seq_len (llm-foundry refuses longer inputs)
POSITION_LIMIT = LEARNED_POSITIONS | {"mpt"}
# self-attention adds a trained position bias, which sdpa receives as a mask needing a grad
TRAINED_ATTENTION_BIAS = frozenset({"t5"})
# the attention hands sdpa a contiguous [b, heads, s, d] query (seen in traces)
SDPA_QUERY_CONTIGUOUS = frozenset({"whisper", "phi3"})
# transformers runs attention eagerly whatever is asked (it changes the scores first)
EAGER_ONLY = frozenset({"gemma2"})
# transformers' class has eager attention only, while the family's own trainer runs fused
# kernels (llm-foundry's MPT: FlashAttention / triton): the formula models the job's
# attention, the trace (which builds transformers' class) runs eager
EAGER_IN_TRANSFORMERS = frozenset({"mpt"})

# LoRA targets peft puts on a MoE's stacked expert parameters and its router instead of on
# nn.Linear modules of that name (peft 0.21.2 utils/transformers_weight_conversion.py,
# _MOE_TARGET_MODULE_MAPPING["qwen2_moe"], the pattern transformers 5 gives DeepSeek;
# "all-linear" includes them). The formula does not model those adapters.
PEFT_EXPERT_TARGETS = {mt: frozenset({"gate", "gate_proj", "up_proj", "down_proj", "all-linear"})
                       for mt in ("deepseek_v2", "deepseek_v3")}

# transformers 5 keeps these families' routed experts as stacked 3-D parameters, not
# nn.Linear: bitsandbytes (and the trace's stand-in) quantise nn.Linear only, so QLoRA
# leaves them 16-bit. (Mixtral and Qwen3-MoE keep theirs the same way; the formula still
# counts those in 4-bit.)
STACKED_EXPERTS = frozenset({"deepseek_v2", "deepseek_v3"})

# positions that are not rotary: learned tables (ViT's too) and T5's relative bias
NO_ROTARY = LEARNED_POSITIONS | {"vit", "t5"}
# the activation transformers' config classes default to, for configs that leave it out
DEFAULT_ACTIVATION = {"gpt2": "gelu_new", "t5": "relu", "gemma2": "gelu_pytorch_tanh",
                      "gemma3_text": "gelu_pytorch_tanh"}
# eager attention computes the softmax in fp32 (softmax(..., dtype=torch.float32), or MPT's
# softmax(scores.float()); transformers 5.24 modeling_*.py: ViT's and DeepSeek's too)
UPCAST_SOFTMAX = frozenset({"llama", "mistral", "mixtral", "qwen2", "gemma2", "phi3", "qwen3",
                            "qwen3_moe", "olmo2", "gemma3_text", "vit", "mpt", "deepseek_v2",
                            "deepseek_v3"})
# a norm after the attention and one after the MLP, besides the two before them
# (Gemma2DecoderLayer, Gemma3DecoderLayer: post_attention_layernorm, post_feedforward_layernorm)
POST_NORMS = frozenset({"gemma2", "gemma3_text"})
# T5's RMSNorm scales its input by the weight after the fp32 variance (T5LayerNorm)
NORM_SCALES_INPUT = frozenset({"t5"})

DEFAULT_TEXT_LEN = 2048


@dataclass(frozen=True)
class Traits:
    """What a family does beyond its shapes, typed: the engines and the performance model
    read these (Architecture.traits), never the model_type."""

    activation: str = "gelu"            # the MLP's activation, as transformers names it
    rotary: bool = True                 # the blocks rotate q and k
    post_norms: bool = False            # norms after the attention and the MLP too
    upcast_softmax: bool = False        # eager softmax in fp32
    attention_softcap: float = 0.0      # tanh soft-cap of the attention scores (0: none)
    final_logit_softcap: float = 0.0    # tanh soft-cap of the logits (0: none)
    norm_scales_input: bool = False     # T5's norm
    trained_attention_bias: bool = False  # a trained position bias sdpa gets as a mask
    sdpa_query_contiguous: bool = False   # sdpa sees a contiguous query
    eager_attention_only: bool = False    # transformers runs eager attention whatever is asked
    eager_in_transformers: bool = False   # eager in transformers, fused in its own trainer
    stacked_experts: bool = False         # routed experts as stacked 3-D parameters
    peft_expert_targets: frozenset[str] = frozenset()  # LoRA targets peft puts on experts

    @property
    def norms_added(self) -> int:
        """Norms a block has beyond the one before each attention and the MLP."""
        return 2 if self.post_norms else 0


def family_traits(model_type: str, config: dict, positions: str = "") -> Traits:
    """The traits of `model_type`, from its config where the family lets it choose
    (positions: Architecture.positions; the activation; soft-caps), else by family."""
    activation = (config.get("hidden_act") or config.get("activation_function")
                  or config.get("hidden_activation") or config.get("feed_forward_proj")
                  or DEFAULT_ACTIVATION.get(model_type, "gelu"))
    return Traits(
        activation=str(activation).removeprefix("gated-"),
        rotary=positions == "rotary" if positions else model_type not in NO_ROTARY,
        post_norms=model_type in POST_NORMS,
        upcast_softmax=model_type in UPCAST_SOFTMAX,
        attention_softcap=_cap(config.get("attn_logit_softcapping")),
        final_logit_softcap=_cap(config.get("final_logit_softcapping")),
        norm_scales_input=model_type in NORM_SCALES_INPUT,
        trained_attention_bias=model_type in TRAINED_ATTENTION_BIAS,
        sdpa_query_contiguous=model_type in SDPA_QUERY_CONTIGUOUS,
        eager_attention_only=model_type in EAGER_ONLY,
        eager_in_transformers=model_type in EAGER_IN_TRANSFORMERS,
        stacked_experts=model_type in STACKED_EXPERTS,
        peft_expert_targets=PEFT_EXPERT_TARGETS.get(model_type, frozenset()))


def _cap(value) -> float:
    """A soft-cap from the config: its value, 0 when unset (null)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return 1.0 if value else 0.0


def text_len(requested: int | None, limit: int | None, model_type: str, name: str,
             field: str, notes: list[str]) -> int:
    """The job's text length: unset means min(2048, the model's length). Longer than a
    learned position table is an error; longer than a rotary model's training length is
    allowed with a warning."""
    if requested is None:
        chosen = min(DEFAULT_TEXT_LEN, limit) if limit else DEFAULT_TEXT_LEN
        notes.append(f"{field} not given: using {chosen}")
        return chosen
    if limit and requested > limit:
        if model_type in POSITION_LIMIT:
            kind = "learned " if model_type in LEARNED_POSITIONS else ""
            raise JobError(f"{field}={requested} is longer than {name}'s {limit} {kind}"
                           f"positions: use {field} <= {limit}")
        notes.append(f"warning: {field}={requested} exceeds the {limit} positions {name} "
                     "was trained on; it may need position scaling to train well")
    return requested


def prequantized(config: dict, name: str, peft_method: str | None,
                 double_quant: bool) -> str | None:
    """A config with a quantization_config ships pre-quantised weights. bitsandbytes 4-bit
    weights trained with LoRA adapters are a QLoRA job, which both engines model (the
    note says so); anything else is refused in one line, never estimated as 16-bit."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise JobError(f"{name}: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "bitsandbytes" and qc.get("load_in_4bit"):
        kind = str(qc.get("bnb_4bit_quant_type", "fp4"))
        if peft_method != "qlora" or kind != "nf4":
            raise JobError(
                f"{name}: its quantization_config holds bitsandbytes 4-bit ({kind}) weights, "
                "which train only under adapters: use --peft qlora"
                + ("" if kind == "nf4" else " (the engines model the NF4 layout)"))
        stored = bool(qc.get("bnb_4bit_use_double_quant", False))
        return ("pre-quantised bitsandbytes NF4 weights (quantization_config): estimated as "
                "the QLoRA job they load as"
                + ("" if stored == double_quant else
                   f"; the checkpoint's double quantisation is {str(stored).lower()}, the "
                   f"job's {str(double_quant).lower()} (--set peft.double_quant={stored})"))
    bits = qc.get("bits") or (8 if qc.get("load_in_8bit") else None)
    what = f"{method or 'unknown'}" + (f" {bits}-bit" if bits else "")
    raise JobError(
        f"{name}: its quantization_config holds pre-quantised {what} weights, whose kernels "
        "and layout vramplan does not model: estimate the unquantised model's config with "
        "--peft qlora for the nearest figure (bitsandbytes NF4, about 0.56 bytes per weight; "
        "GPTQ/AWQ 4-bit with groups of 128 store about 0.52)")
