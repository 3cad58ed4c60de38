"""Activations: the tensors one transformer block saves for its backward pass.

Each block is described as a list of saved tensors (name, bytes), so the total can be
explained and compared tensor by tensor with a trace. The model follows what PyTorch's
autograd keeps for the Hugging Face implementations:
  * a linear saves its input only when its weight is trained (or a LoRA adapter reads it);
    under autocast each linear casts an fp32 input separately, so a norm output read by
    q, k and v is saved three times in 16-bit;
  * RMSNorm (Llama) saves its input and the fp32 normalised tensor; LayerNorm its input;
  * sdpa (flash / memory-efficient) saves q, k, v, the output and an fp32 logsumexp;
    eager attention adds the fp32 softmax of the b*a*s*s scores and its 16-bit copy;
  * dropout with p > 0 saves a 1-byte mask;
  * the activation function saves its input (relu: its output).
Per-layer totals reduce to Korthikanti et al. (2022), s*b*h*(34 + 5*a*s/h) bytes for GPT-3
in 16-bit, when the same assumptions are made.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.engines.precision import Dtypes
from vramplan.models.arch import Stack
from vramplan.models.families import Traits

# Tensors an activation function saves besides its own output (which the next linear saves).
# gelu_new is transformers' tanh formula written out in Python: it keeps x, x**3 terms,
# tanh(.), 0.5*x and 1 + tanh(.) alive (transformers/activations.py NewGELUActivation);
# four of them are distinct storages besides its output (seen on a traced GPT-2 block).
ACTIVATION_SAVES = {
    "gelu": 1, "gelu_pytorch_tanh": 1, "gelu_fast": 1, "silu": 1, "swish": 1,
    "relu": 0, "quick_gelu": 2, "gelu_new": 4, "gelu_10": 1,
}


@dataclass(frozen=True)
class BlockShape:
    """What one block sees: batch b, its sequence s, and (for cross-attention) encoder s."""

    batch: int
    seq: int
    encoder_seq: int = 0


@dataclass(frozen=True)
class Adapters:
    """Which linears of a block carry LoRA adapters, and whether base weights train."""

    targets: frozenset[str] = frozenset()
    rank: int = 0
    dropout: float = 0.0
    base_trainable: bool = True
    # fp32 adapters in a 16-bit model without autocast: peft casts each adapter's input to
    # fp32 (lora_A saves that copy) and lora_A's output is fp32; 0 when it does not happen
    upcast_bytes: int = 0


def _activation_saved_bytes(name: str, dt: Dtypes) -> int:
    """Bytes per element an activation function keeps besides its output."""
    if name == "gelu_new" and dt.autocast:
        # CUDA autocast runs pow in fp32: pow keeps its fp32 copy of x, and tanh(.) and
        # 1 + tanh(.) are fp32, while 0.5 * x stays 16-bit (checked against an H200 run)
        return 3 * 4 + dt.compute
    return ACTIVATION_SAVES.get(name, 1) * dt.compute


# Saved tensors as wide as the residual stream (names of block_saved_tensors and
# compiled_block_saved_tensors, with what follows them: "attn in cast x3"): the norms' inputs
# and outputs, the inputs of the linears they feed, the residual dropouts' masks. Tensor
# parallelism without sequence parallelism keeps these whole on every rank; the rest is
# split over the heads or the MLP width.
HIDDEN_WIDE = ("attn norm", "attn in", "attn resid dropout", "cross norm", "cross q in",
               "mlp norm", "mlp in", "mlp resid dropout", "extra norm", "block input",
               "residual rebuild")


def hidden_wide_bytes(saved: list[tuple[str, int]]) -> float:
    """Bytes of the residual-stream-wide tensors among `saved` (HIDDEN_WIDE)."""
    return sum(b for name, b in saved
               if any(name == w or name.startswith(w + " ") for w in HIDDEN_WIDE))


def block_saved_tensors(stack: Stack, shape: BlockShape, dt: Dtypes, *, attention: str,
                        hidden_dropout: float, attention_dropout: float, adapters: Adapters,
                        traits: Traits = Traits(),
                        norms_per_block: int = 2) -> list[tuple[str, int]]:
    """(name, bytes) of every tensor one block keeps for backward, per GPU (no parallelism).

    What the family does beyond its shapes comes from `traits` (Architecture.traits):
    rotary: q and k are rotated (new tensors); without it, a fused q/k/v projection's q,
    k and v are all views of its output.
    sdpa_query_contiguous: the model hands sdpa a q contiguous in [b, heads, s, d] order
    (Whisper's .contiguous(), Phi-3's partial-rotary cat). sdpa's output follows q's layout,
    so merging its heads for the out projection copies it; otherwise q is a transposed view
    of the projection's output, and the merge is a view.
    trained_attention_bias: self-attention adds a trained position bias (T5); under sdpa each
    layer passes sdpa its own contiguous [1, heads, s, s] copy of it, which the kernel keeps.
    The bias comes from an embedding, so it has the weights' dtype (fp32 under autocast).
    """
    activation = traits.activation
    upcast_softmax, score_softcap = traits.upcast_softmax, bool(traits.attention_softcap)
    norm_scales_input, trained_bias = traits.norm_scales_input, traits.trained_attention_bias
    rotary, sdpa_query_contiguous = traits.rotary, traits.sdpa_query_contiguous
    b, s = shape.batch, shape.seq
    h, a, d, f = stack.hidden_size, stack.num_heads, stack.head_dim, stack.intermediate_size
    n_h, n_q = b * s * h, b * s * a * d
    c = dt.compute
    saved: list[tuple[str, int]] = []

    def linear_inputs(tensor: str, elements: int, consumers: list[str], fp32_input: bool,
                      already_saved: bool = False):
        """Inputs saved for the linears in `consumers` that read one tensor (already_saved:
        the tensor itself is counted elsewhere; only casts and LoRA copies of it are new)."""
        trained = [n for n in consumers if adapters.base_trainable]
        lora = [n for n in consumers if n in adapters.targets]
        if trained:
            if dt.autocast and (fp32_input or dt.linear_saved == 1):
                # each linear casts the fp32 (or fp8) input on its own
                saved.append((f"{tensor} cast x{len(trained)}",
                              len(trained) * dt.linear_saved * elements))
            elif tensor != "encoder out" and not already_saved:
                # (the one encoder output that serves every layer is counted once, elsewhere)
                saved.append((tensor, c * elements))
        if lora:
            a = adapters.upcast_bytes or c  # bytes of what lora_A reads and writes
            if adapters.dropout > 0:  # each adapter drops out its own copy
                saved.append((f"{tensor} lora dropout x{len(lora)}",
                              len(lora) * (a + 1) * elements))
            else:
                if not trained and not already_saved:
                    saved.append((tensor, c * elements))
                if adapters.upcast_bytes:
                    saved.append((f"{tensor} lora fp32 copy x{len(lora)}",
                                  len(lora) * a * elements))
            rank_elems = elements // max(1, _width(tensor, stack)) * adapters.rank
            saved.append((f"{tensor} lora A out x{len(lora)}", len(lora) * a * rank_elems))

    def norm(name: str, elements: int | None = None):
        n_h = b * s * h if elements is None else elements
        if stack.norm == "rmsnorm":
            # the fp32 input (or an fp32 copy of a 16-bit one), then the normalised tensor
            # the weight multiplies: fp32, or 16-bit in a 16-bit model, and not saved at all
            # when the weight is frozen (PEFT)
            second = (4 if dt.residual == 4 else 2) if adapters.base_trainable else 0
            # T5's norm scales the 16-bit input itself (not its fp32 copy), keeping it too
            third = dt.residual if norm_scales_input and dt.residual != 4 else 0
            saved.append((name, (4 + second + third) * n_h))
        else:
            saved.append((name, (4 if dt.autocast else dt.residual) * n_h))

    def dropout_mask(name: str, elements: int, p: float):
        if p > 0:
            saved.append((name, elements))

    fp32_norm_out = dt.autocast and dt.residual == 4

    # --- self-attention ---------------------------------------------------------------
    norm("attn norm")
    linear_inputs("attn in", n_h, linear_names(stack, "attn_in"), fp32_norm_out)
    if stack.latent_attention is not None:
        mla = stack.latent_attention
        for tensor, rank, reader in (("q latent", mla.q_lora_rank, "q_b_proj"),
                                     ("kv latent", mla.kv_lora_rank, "kv_b_proj")):
            if rank:
                # RMSNorm over the 16-bit latent: its fp32 copy, and the normalised 16-bit
                # tensor its weight multiplies (not saved when the weight is frozen); the
                # product is fp32 under autocast (an fp32 weight), cast by the b projection
                trained = c if adapters.base_trainable else 0
                saved.append((f"{tensor} norm", (4 + trained) * b * s * rank))
                linear_inputs(tensor, b * s * rank, [reader], fp32_norm_out)
        merged_is_view = _latent_attention_core(saved, stack, shape, c, attention,
                                                attention_dropout)
        linear_inputs("attn out", b * s * a * mla.v_head_dim, linear_names(stack, "attn_out"),
                      False, merged_is_view)
    else:
        merged_is_view = _self_attention_core(
            saved, stack, shape, dt, attention=attention, attention_dropout=attention_dropout,
            upcast_softmax=upcast_softmax, score_softcap=score_softcap,
            trained_bias=trained_bias, rotary=rotary,
            sdpa_query_contiguous=sdpa_query_contiguous, norm=norm)
        linear_inputs("attn out", n_q, linear_names(stack, "attn_out"), False, merged_is_view)
    dropout_mask("attn resid dropout", n_h, hidden_dropout)

    # --- cross-attention (decoder of encoder-decoder) ------------------------------------
    if stack.cross_attention:
        n_enc = b * shape.encoder_seq * h
        norm("cross norm")
        linear_inputs("cross q in", n_h, linear_names(stack, "cross_q"), fp32_norm_out)
        linear_inputs("encoder out", n_enc, linear_names(stack, "cross_kv"), dt.autocast)
        saved.extend(_attention_core(b, s, shape.encoder_seq, a, a, d, c, attention,
                                     attention_dropout, upcast_softmax or dt.autocast, "cross"))
        linear_inputs("cross out", n_q, linear_names(stack, "cross_out"), False, merged_is_view)
        dropout_mask("cross resid dropout", n_h, hidden_dropout)

    # --- MLP ------------------------------------------------------------------------------
    if stack.router:
        norm("mlp norm")
        _deepseek_moe(saved, stack, shape, dt, adapters, activation, linear_inputs,
                      fp32_norm_out)
        for i in range(norms_per_block - 2):
            norm(f"extra norm {i + 1}")
        return saved
    routed = stack.experts_per_token if stack.num_experts > 1 else 1
    n_f = b * s * f * routed
    norm("mlp norm")
    if stack.num_experts > 1:
        saved.append(("router logits fp32", 2 * 4 * b * s * stack.num_experts))
        saved.append(("expert inputs gathered", c * b * s * routed * h))
        saved.append(("expert outputs", c * b * s * routed * h))
    linear_inputs("mlp in", n_h * (routed if stack.num_experts > 1 else 1),
                  linear_names(stack, "mlp_in"), fp32_norm_out and stack.num_experts == 1)
    if stack.mlp == "gated":
        # gate out (act input), act out, up out: each saved by the elementwise product
        saved.append(("gate/up/act", (2 * c + _activation_saved_bytes(activation, dt)) * n_f))
    else:
        inner_dropout = hidden_dropout if stack.mlp == "relu" else 0.0
        act_bytes = _activation_saved_bytes(activation, dt)
        if inner_dropout and not act_bytes:
            act_bytes = c  # relu keeps its output, and the dropout after it makes a new one
        saved.append(("mlp act input", act_bytes * n_f))
    dropout_mask("mlp inner dropout", n_f, hidden_dropout if stack.mlp == "relu" else 0.0)
    linear_inputs("mlp mid", n_f, linear_names(stack, "mlp_out"), False)
    dropout_mask("mlp resid dropout", n_h, hidden_dropout)
    for i in range(norms_per_block - 2 - int(stack.cross_attention)):
        norm(f"extra norm {i + 1}")  # Gemma-2's post-attention / post-MLP norms
    return saved


def _self_attention_core(saved: list[tuple[str, int]], stack: Stack, shape: BlockShape,
                         dt: Dtypes, *, attention: str, attention_dropout: float,
                         upcast_softmax: bool, score_softcap: bool, trained_bias: bool,
                         rotary: bool, sdpa_query_contiguous: bool, norm) -> bool:
    """Multi-head (or grouped-query) attention between the q/k/v projections and the output
    projection; returns whether the head merge feeding the output projection is a view."""
    b, s, c = shape.batch, shape.seq, dt.compute
    a, k, d = stack.num_heads, stack.num_kv_heads, stack.head_dim
    n_q, n_kv = b * s * a * d, b * s * k * d
    if stack.qk_norm:
        # RMSNorm on the queries and keys (Qwen3, OLMo-2, Gemma-3) saves what a block norm
        # saves, over the q and k projections' outputs
        norm("q norm", n_q)
        norm("k norm", n_kv)
    saved.extend(_attention_core(b, s, s, a, k, d, c, attention, attention_dropout,
                                 upcast_softmax or dt.autocast, "self", score_softcap))
    if trained_bias and attention == "sdpa":
        saved.append(("position bias copy", dt.residual * a * s * s))
    if len(linear_names(stack, "attn_in")) == 1 and rotary:
        # one fused q/k/v projection: q and k are rotated copies, and v is a view that keeps
        # the whole output alive
        saved.append(("fused qkv output", c * (n_q + n_kv)))
    # eager attention's head merge makes a copy; sdpa's is a view unless q was contiguous
    return attention == "sdpa" and not sdpa_query_contiguous


def _latent_attention_core(saved: list[tuple[str, int]], stack: Stack, shape: BlockShape,
                           c: int, attention: str, dropout: float) -> bool:
    """Multi-head latent attention (transformers' DeepseekV2/V3Attention) from the latents'
    b projections to the output projection; returns whether the head merge is a view.

    The query is a new tensor (the cat of its nope and rotated parts, cast to 16-bit under
    autocast), the key a new [b, heads, s, nope + rope] tensor (expand_kv's new_empty); the
    value is a split view of kv_b_proj's output."""
    mla = stack.latent_attention
    b, s, a = shape.batch, shape.seq, stack.num_heads
    dq, dv = mla.qk_head_dim, mla.v_head_dim
    qk = c * 2 * b * s * a * dq
    if attention == "sdpa":
        # sdpa keeps the value as given, so kv_b_proj's whole output stays; with q/k and v
        # head sizes equal, flash attention returns the output in q's contiguous
        # [b, heads, s, d] layout and merging the heads copies it; with them unequal
        # (DeepSeek: 192 vs 128) flash cannot run and CUDA's memory-efficient kernel writes
        # [b, s, heads, d], so the merge is a view
        kv_out = c * b * s * a * (mla.qk_nope_head_dim + dv)
        saved.extend([("mla q, k", qk), ("kv_b_proj output (v is a view)", kv_out),
                      ("sdpa out", c * b * s * a * dv), ("logsumexp", 4 * b * a * s)])
        return dq != dv
    scores = b * a * s * s
    # eager: softmax in fp32 and its 16-bit copy for p @ v. matmul folds v's batch and head
    # dimensions into one: a view of kv_b_proj's output (kept whole) when the batch is 1,
    # else a contiguous copy of v
    value = (("kv_b_proj output (v is a view)", c * b * s * a * (mla.qk_nope_head_dim + dv))
             if b == 1 else ("v contiguous copy", c * b * s * a * dv))
    saved.extend([("mla q, k", qk), ("softmax fp32", 4 * scores), value])
    if dropout > 0:
        saved.append(("attn dropout", (1 + c) * scores))
    elif c != 4:
        saved.append(("probs 16-bit", c * scores))
    return False


def _deepseek_moe(saved: list[tuple[str, int]], stack: Stack, shape: BlockShape, dt: Dtypes,
                  adapters: Adapters, activation: str, linear_inputs,
                  fp32_norm_out: bool) -> None:
    """DeepSeek's MoE block as transformers 5 runs it (DeepseekV2Moe / DeepseekV3MoE with
    the grouped_mm experts of integrations/moe.py): the router, the routed experts on the
    tokens sorted by expert, and the shared experts (one gated MLP)."""
    b, s, c, h = shape.batch, shape.seq, dt.compute, stack.hidden_size
    tokens, k, f = b * s, stack.experts_per_token, stack.intermediate_size
    routed = tokens * k
    trained = adapters.base_trainable
    # the router reads hidden.float(): under autocast its linear casts that to 16-bit (one
    # more cast of the norm output, beside the shared experts'); without autocast a 16-bit
    # model keeps the fp32 copy. A frozen router saves no input.
    readers = ["gate", *linear_names(stack, "shared_in")]
    linear_inputs("mlp in", tokens * h, readers, fp32_norm_out)
    if trained and not dt.autocast and c != 4:
        saved.append(("router fp32 input", 4 * tokens * h))
    # router logits are 16-bit under autocast, else fp32
    logit = c if dt.autocast else 4
    if stack.router == "sigmoid":
        # V3: sigmoid scores; gather of the top-k by index (int64); the top-k weights and
        # their fp32 sum (norm_topk_prob), kept by the in-place division
        saved.append(("router sigmoid scores", logit * tokens * stack.num_experts))
        saved.append(("router top-k indices and weights", (8 + logit) * routed + 4 * tokens))
        weight = logit
    else:
        # V2: softmax in fp32; top-k keeps its indices
        saved.append(("router softmax fp32", 4 * tokens * stack.num_experts))
        saved.append(("router top-k indices", 8 * routed))
        weight = 4
    # the sort by expert (perm), the token index perm // k, the inverse permutation (int64),
    # the int32 offsets, and each routed copy's weight
    saved.append(("expert permutations", 3 * 8 * routed + 4 * stack.num_experts
                  + weight * routed))
    if trained:
        saved.append(("expert inputs gathered", c * routed * h))
    # gate_up output (gate and up are views), the activation's output; the product is the
    # down projection's input (saved when the experts train)
    saved.append(("expert gate/up/act", (2 * c + _activation_saved_bytes(activation, dt))
                  * routed * f))
    if trained:
        saved.append(("expert product", c * routed * f))
    saved.append(("expert outputs", c * routed * h))  # multiplied by the routing weights
    # shared experts: a gated MLP every token runs
    shared = tokens * stack.shared_intermediate_size
    saved.append(("shared gate/up/act", (2 * c + _activation_saved_bytes(activation, dt))
                  * shared))
    linear_inputs("shared mid", shared, linear_names(stack, "shared_out"), False)


def _attention_core(b: int, s_q: int, s_k: int, a: int, k: int, d: int, c: int, attention: str,
                    dropout: float, fp32_softmax: bool, tag: str,
                    softcap: bool = False) -> list[tuple[str, int]]:
    n_q, n_kv = b * s_q * a * d, b * s_k * k * d
    if attention == "sdpa":
        # q, k, v, output, fp32 logsumexp [b, a, s] (flash/mem-efficient backward needs them)
        return [(f"{tag} q,k,v", c * (n_q + 2 * n_kv)), (f"{tag} sdpa out", c * n_q),
                (f"{tag} logsumexp", 4 * b * a * s_q)]
    scores = b * a * s_q * s_k
    # eager: k and v are repeated to every head (repeat_kv) before the matmuls
    out = [(f"{tag} q,k,v (kv repeated)", c * 3 * n_q)]
    out.append((f"{tag} softmax", (4 if fp32_softmax else c) * scores))
    if dropout > 0:
        # the dropout keeps its 1-byte mask, and the matmul with v its output; the 16-bit
        # probabilities it read are not kept
        out.append((f"{tag} attn dropout", (1 + c) * scores))
    elif fp32_softmax and c != 4:
        out.append((f"{tag} probs 16-bit", c * scores))
    if softcap:  # Gemma-2: cap * tanh(scores / cap) keeps the tanh output
        out.append((f"{tag} softcap tanh", c * scores))
    return out


def _value_head_size(stack: Stack) -> int:
    """The attention output's head size (multi-head latent attention: v_head_dim)."""
    mla = stack.latent_attention
    return mla.v_head_dim if mla else stack.head_dim


def linear_names(stack: Stack, role: str) -> list[str]:
    """Names of the block's linears that play `role` (see Linear.role)."""
    return [ln.name for ln in stack.linears if ln.role == role]


def _width(tensor: str, stack: Stack) -> int:
    """Feature width of a named block tensor (to turn its element count into tokens)."""
    mla = stack.latent_attention
    if tensor == "mlp mid":
        return stack.intermediate_size
    if tensor == "shared mid":
        return stack.shared_intermediate_size
    if mla is not None and tensor in ("q latent", "kv latent", "attn out"):
        return {"q latent": mla.q_lora_rank, "kv latent": mla.kv_lora_rank,
                "attn out": stack.num_heads * mla.v_head_dim}[tensor]
    if tensor in ("attn out", "cross out"):
        return stack.num_heads * stack.head_dim
    return stack.hidden_size


def block_matmul_outputs(stack: Stack, shape: BlockShape, dt: Dtypes, *, attention: str,
                         adapters: Adapters) -> list[tuple[str, int]]:
    """What selective checkpointing keeps of one block (torchtitan's "op" policy): its
    input and the outputs of its matmuls and attention kernels; the rest is recomputed."""
    b, s, c = shape.batch, shape.seq, dt.compute
    a, d = stack.num_heads, _value_head_size(stack)
    routed = stack.experts_per_token if stack.num_experts > 1 else 1
    kept = [("block input", dt.residual * b * s * stack.hidden_size)]
    for ln in stack.linears:
        tokens = b * (shape.encoder_seq if ln.role == "cross_kv" else s)
        if ln.count > 1:
            tokens *= routed
        kept.append((f"{ln.name} out", c * tokens * ln.out_features))
        if ln.name in adapters.targets:  # lora_A and lora_B are matmuls too
            kept.append((f"{ln.name} lora out", c * tokens * (adapters.rank + ln.out_features)))
    attentions = [(s, "self")] + ([(shape.encoder_seq, "cross")] if stack.cross_attention else [])
    for s_k, tag in attentions:
        if attention == "sdpa":
            kept.append((f"{tag} sdpa out+lse", c * b * s * a * d + 4 * b * a * s))
        else:  # the two batched matmuls: q @ k^T and probs @ v
            kept.append((f"{tag} scores+out", c * b * a * s * s_k + c * b * s * a * d))
    return kept


def block_op_sac_outputs(stack: Stack, shape: BlockShape, dt: Dtypes, *, attention: str,
                         adapters: Adapters) -> list[tuple[str, int]]:
    """What torchtitan's op-level selective checkpointing keeps of one block
    (torchtitan b5bcd76c distributed/activation_checkpoint.py, SelectiveAC): its input, the
    attention kernels' outputs, and the outputs of the block's matmuls except every second
    one. Its counter advances on each aten.mm (a linear without bias), in the order the
    block runs them (a LoRA adapter's A and B right after their base linear), and an mm
    whose count is even is recomputed; a linear with a bias runs as aten.addmm, which is
    always saved and not counted. In a Llama block that keeps q, v, gate and down."""
    b, s, c = shape.batch, shape.seq, dt.compute
    a, d = stack.num_heads, _value_head_size(stack)
    routed = stack.experts_per_token if stack.num_experts > 1 else 1
    kept = [("block input", dt.residual * b * s * stack.hidden_size)]
    mm_count = 0

    def matmul(name: str, bias: bool, elements: int):
        nonlocal mm_count
        if not bias:
            mm_count += 1
            if mm_count % 2 == 0:
                return  # recomputed in backward
        kept.append((f"{name} out", c * elements))

    for ln in stack.linears:
        tokens = b * (shape.encoder_seq if ln.role == "cross_kv" else s)
        if ln.count > 1:
            tokens *= routed
        if ln.role == "router":
            continue  # force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]: not counted
        matmul(ln.name, ln.bias, tokens * ln.out_features)
        if ln.name in adapters.targets:
            matmul(f"{ln.name} lora_A", False, tokens * adapters.rank)
            matmul(f"{ln.name} lora_B", False, tokens * ln.out_features)
    attentions = [(s, "self")] + ([(shape.encoder_seq, "cross")] if stack.cross_attention else [])
    for s_k, tag in attentions:
        if attention == "sdpa":
            kept.append((f"{tag} sdpa out+lse", c * b * s * a * d + 4 * b * a * s))
        else:  # q @ k^T and probs @ v run as aten.bmm: saved, not counted
            kept.append((f"{tag} scores+out", c * b * a * s * s_k + c * b * s * a * d))
    return kept


def compiled_block_saved_tensors(stack: Stack, shape: BlockShape, dt: Dtypes,
                                 adapters: Adapters = Adapters(),
                                 fp32_adapters: bool = False,
                                 fp8_recipe: str | None = None) -> list[tuple[str, int]]:
    """What one compiled Llama-style block (RMSNorm, rotary sdpa attention, gated MLP)
    saves for backward: the min-cut partitioner's choice, read from the graphs torch 2.13
    builds (tests/engines/test_compile_formula.py checks it against the trace, which compiles the
    real model). Always: the block input, an fp32 rsqrt per token for each norm, q and k
    rotated and v, sdpa's output and log-sum-exp, one hidden-wide tensor to rebuild the
    residual sum from (the out projection's output, or the sum itself), and gate's and
    up's outputs (silu(gate) and the norms' fp32 tensors are recomputed). Then what the
    trained weights need: a norm's output once in the compute dtype for the linears that
    read it (eager autocast keeps one cast per linear), gate * up for down, and each LoRA
    adapter's A output; with LoRA dropout each adapter's dropped-out input and its 1-byte
    mask instead of the shared inputs. fp32_adapters (fp32 LoRA under autocast): peft
    casts the out projection's input for its adapter, a copy where the merged heads are
    otherwise a view of sdpa's output. Weight copies under autocast are as in eager mode
    (counted apart). fp8_recipe (torchao Float8Linear in the block): a weight gradient
    reads its input only through a float8 cast, which the partitioner recomputes in backward
    from the block input, the residual rebuild and gate's and up's outputs, fused with the
    norm or the product: the norms' outputs and gate * up are not kept (torch 2.13, torchao
    0.18; tests/engines/test_compile_formula.py against the trace of the real Float8Linear).
    The out projection is the exception: its input's float8 cast (transposed, 1 byte) is
    kept beside sdpa's output (a rowwise cast's per-column amax too, negligible).
    rowwise_with_gw_hp's weight gradients read the 16-bit inputs: the norms' outputs are
    still recomputed, gate * up is kept, the out projection reads sdpa's output."""
    b, s = shape.batch, shape.seq
    h, a, k, d, f = (stack.hidden_size, stack.num_heads, stack.num_kv_heads, stack.head_dim,
                     stack.intermediate_size)
    n_h, n_q, n_kv, c = b * s * h, b * s * a * d, b * s * k * d, dt.compute
    n_f = b * s * f

    # with LoRA dropout each adapter reads its own dropped-out copy of its input, which it
    # keeps with the 1-byte mask; without it the adapters read the shared input
    dropped = adapters.dropout > 0 and not adapters.base_trainable

    def trained(role: str) -> list[str]:
        names = linear_names(stack, role)
        if adapters.base_trainable:
            return names
        return [] if dropped else [n for n in names if n in adapters.targets]

    saved = [("block input", dt.residual * n_h), ("norm rsqrt x2", 2 * 4 * b * s),
             ("q, k (rotated), v", c * (n_q + 2 * n_kv)), ("sdpa out", c * n_q),
             ("logsumexp", 4 * b * a * s), ("residual rebuild", c * n_h),
             ("gate, up", 2 * c * n_f)]
    if trained("attn_in") and not fp8_recipe:
        saved.append(("attn norm out", c * n_h))
    if trained("mlp_in") and not fp8_recipe:
        saved.append(("mlp norm out", c * n_h))
    if trained("mlp_out") and fp8_recipe in (None, "rowwise_with_gw_hp"):
        saved.append(("gate * up", c * n_f))
    if trained("attn_out") and fp8_recipe in ("tensorwise", "rowwise"):
        saved.append(("out proj input float8 (weight gradient)", n_q))
    targets = set(linear_names(stack, "attn_out")) & adapters.targets
    if fp32_adapters and targets and not dropped:
        saved.append(("out proj adapter input cast", c * n_q))
    lora = [ln for ln in stack.linears if ln.name in adapters.targets]
    if lora:
        saved.append((f"lora A out x{len(lora)}", len(lora) * c * b * s * adapters.rank))
    if dropped:
        inputs = {"attn_in": n_h, "attn_out": n_q, "mlp_in": n_h, "mlp_out": n_f}
        saved.append((f"lora dropout out and mask x{len(lora)}",
                      sum((c + 1) * inputs[ln.role] for ln in lora)))
    return saved


def compiled_block_unsupported(stack: Stack, *, attention: str, adapters: Adapters,
                               dropout: float, norms_per_block: int, rotary: bool) -> str:
    """Why compiled_block_saved_tensors does not describe this block ('' if it does)."""
    reasons = [(stack.norm != "rmsnorm", f"{stack.norm}"),
               (stack.mlp != "gated", f"a {stack.mlp} MLP"),
               (stack.num_experts > 1, "mixture-of-experts"),
               (stack.qk_norm, "query/key norms"), (stack.cross_attention, "cross-attention"),
               (stack.latent_attention is not None, "multi-head latent attention"),
               (not rotary, "learned positions"), (norms_per_block != 2, "extra norms"),
               (len(linear_names(stack, "attn_in")) != 3 and stack.latent_attention is None,
                "a fused q/k/v projection"),
               (attention != "sdpa", f"{attention} attention"), (dropout > 0, "dropout"),
               (adapters.upcast_bytes > 0, "fp32 adapters on a 16-bit model without autocast")]
    return ", ".join(why for bad, why in reasons if bad)


def encoder_decoder_outside(stacks: tuple[Stack, ...], seqs: tuple[int, ...], batch: int,
                            dt: Dtypes, *, attention: str, checkpointing: str,
                            adapters: Adapters, final_norm_bytes: int,
                            relative_bias: bool, hidden_dropout: float) -> list[tuple[str, int]]:
    """(name, bytes) an encoder-decoder keeps outside its blocks besides the embeddings'
    dropout and the decoder's final norm (counted by the caller): the encoder's final norm
    and its output, which every cross-attention's k and v read; and T5's (relative_bias)
    extras, read off a traced T5 step (transformers 5 T5Stack, T5Attention, sdpa_attention):
      * a dropout after each stack's final norm (a 1-byte mask);
      * its norm also keeps the 16-bit tensor its weight scales (the block norms' rule);
      * the first block computes each stack's position buckets, an int64 s x s tensor the
        bias embedding keeps for its gradient (not with a frozen base, nor when checkpointing
        recomputes the first block);
      * under sdpa, each decoder self-attention builds its causal mask (bool s x s), which
        torch.where keeps to route the bias's gradient, and the cross-attentions share one
        [1, heads, s_dec, s_enc] zero bias that the memory-efficient kernel keeps.
    """
    if not stacks[-1].cross_attention:  # decoder-only (several stacks: dense, then MoE)
        return []
    saved: list[tuple[str, int]] = []
    encoder, decoder = stacks[0], stacks[-1]
    s_enc, s_dec = seqs[0], seqs[-1]
    n_enc = batch * s_enc * encoder.hidden_size
    third = dt.residual if relative_bias and dt.residual != 4 else 0
    saved.append(("encoder final norm", (final_norm_bytes + third) * n_enc))
    readers = linear_names(decoder, "cross_kv")
    if not dt.autocast and (adapters.base_trainable or set(readers) & adapters.targets):
        saved.append(("encoder output", dt.compute * n_enc))  # once, for every layer
    if not relative_bias:
        return saved
    n_dec = batch * s_dec * decoder.hidden_size
    saved.append(("decoder final norm 16-bit scale input", third * n_dec))
    if hidden_dropout > 0:
        saved.append(("final dropout masks", n_enc + n_dec))
    if adapters.base_trainable and checkpointing == "none":
        saved.append(("position buckets int64", 8 * (s_enc * s_enc + s_dec * s_dec)))
        if attention == "sdpa":
            saved.append(("decoder causal masks", decoder.num_layers * s_dec * s_dec))
    if attention == "sdpa":
        saved.append(("cross-attention zero bias", dt.compute * decoder.num_heads
                      * s_dec * s_enc))
    return saved
