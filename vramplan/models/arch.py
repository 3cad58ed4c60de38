"""Architecture: the normalised shape of a model that the formula engine reads.

It is derived from a model's config (the Hugging Face config.json fields) and never from a
parameter count alone. Parameter counts here are exact: a test checks each catalog model
against the same config built by transformers on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from vramplan.models.families import Traits, family_traits

Kind = Literal["decoder", "encoder", "encoder-decoder", "vision", "cnn"]
Task = Literal[
    "causal-lm", "masked-lm", "seq-classification", "seq2seq", "image-classification",
    "speech-seq2seq",
]


@dataclass(frozen=True)
class Linear:
    """One linear layer inside a transformer block (per layer, per expert)."""

    name: str          # module name as peft target_modules matches it, e.g. "q_proj"
    in_features: int
    out_features: int
    bias: bool
    count: int = 1     # how many copies per block (MoE experts)
    # What the layer reads and writes, for the activation model: attn_in (q/k/v), attn_out,
    # cross_q, cross_kv, cross_out, mlp_in (up/gate/fc1), mlp_out (down/fc2), router;
    # multi-head latent attention adds attn_latent (q_b_proj, kv_b_proj: read a normed
    # latent), DeepSeek's shared experts shared_in / shared_out.
    role: str = ""


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through a low-rank latent
    (q_a_proj -> RMSNorm -> q_b_proj, or one q_proj when q_lora_rank is 0), keys and values
    from one normed latent (kv_a_proj_with_mqa -> RMSNorm -> kv_b_proj) plus a rotary key
    part shared by all heads."""

    q_lora_rank: int        # 0 = a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class Stack:
    """A stack of identical transformer blocks."""

    role: Literal["encoder", "decoder"]
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int           # == num_heads for MHA; fewer for GQA/MQA
    head_dim: int
    intermediate_size: int      # per expert for MoE
    mlp: Literal["gelu", "relu", "gated"]   # gated = SwiGLU/GeGLU (three matrices)
    norm: Literal["layernorm", "rmsnorm"]
    linears: tuple[Linear, ...]  # every linear of one block, including all experts
    params_per_layer: int       # exact parameter count of one block (norms, biases, router)
    num_experts: int = 1        # 1 = dense MLP
    experts_per_token: int = 1
    cross_attention: bool = False   # decoder block of an encoder-decoder
    # Which sequence feeds this stack: text tokens, audio frames (after the conv frontend)
    # or image patches (+ CLS token).
    sequence: Literal["text", "audio", "patches"] = "text"
    # RMSNorm on queries and keys before attention (Qwen3, OLMo-2, Gemma-3)
    qk_norm: bool = False
    # multi-head latent attention (head_dim is then the q/k head size, nope + rope)
    latent_attention: LatentAttention | None = None
    # DeepSeek MoE: the router's scores ("sigmoid" group-limited top-k, V3; "softmax"
    # greedy top-k, V2) and the shared experts' width (one gated MLP every token runs);
    # "" = the generic MoE model (Mixtral, Qwen3-MoE)
    router: str = ""
    shared_intermediate_size: int = 0


@dataclass(frozen=True)
class Architecture:
    name: str                   # catalog name, or the path it was read from
    model_type: str             # the HF model_type, e.g. "llama"
    kind: Kind
    stacks: tuple[Stack, ...]   # encoder first, then decoder (empty for "cnn")
    embedding_params: int       # token/position/type embeddings, patch or conv frontend
    other_params: int           # final norms and anything outside blocks, embeddings, heads
    head_params: dict[str, int]  # task -> parameters of that task's head (0 when tied)
    default_task: Task
    vocab_size: int = 0
    max_positions: int | None = None  # longest text sequence the model accepts
    tied_embeddings: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # vision
    image_size: int = 0
    patch_size: int = 0
    num_channels: int = 0
    # speech: log-mel bins and the longest input in frames (before the stride-2 conv)
    num_mel_bins: int = 0
    max_source_positions: int = 0
    # cnn: (channels, stride) of every tensor autograd saves for one sample at stride 1 =
    # the input resolution; activations per sample = sum(c * (image_size / stride) ** 2)
    feature_maps: tuple[tuple[int, int], ...] = ()
    # classes of the classification head (image-/seq-classification); 0 when there is none
    num_labels: int = 0
    source: str = ""            # where the config comes from (URL), for catalog models
    extra: dict = field(default_factory=dict)  # the raw config, for builders
    # "config": derived from the config's fields (derive.py); otherwise where the shapes were
    # read (a family derive.py does not know, read from the model transformers builds)
    shapes_from: str = "config"
    # How positions enter, where the family's config decides it (MPT): "alibi" (a per-head
    # linear bias on the attention scores, no parameters), "learned", "rotary" or "none";
    # "" = fixed by the family (families.LEARNED_POSITIONS)
    positions: str = ""
    # what the shapes leave out or assume (a vision-language config's towers), for reports
    notes: tuple[str, ...] = ()

    @cached_property
    def traits(self) -> Traits:
        """What the family does beyond its shapes (families.family_traits), read from the
        model_type and the config once."""
        return family_traits(self.model_type, self.extra, self.positions)

    def norms_per_block(self, stack: Stack) -> int:
        """Norms in one block of `stack`: before the attention(s) and the MLP, plus the
        family's post-norms."""
        return (3 if stack.cross_attention else 2) + self.traits.norms_added

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.head_params)

    @property
    def body_params(self) -> int:
        return (self.embedding_params + self.other_params
                + sum(s.params_per_layer * s.num_layers for s in self.stacks))

    def total_params(self, task: str | None = None) -> int:
        return self.body_params + self.head_params[task or self.default_task]
