"""FLOPs of one training step, matmul by matmul, from the Architecture's shapes (not 6 x N).

Every matmul of forward and backward is counted as 2 x m x n x k, the way
`torch.utils.flop_counter.FlopCounterMode` counts it (a test checks the two agree on real
steps of tiny models):

  * a linear does 1 matmul forward; backward computes its input's gradient only when the
    input requires one, and its weight's gradient only when the weight trains (a frozen
    PEFT base does neither in the first block, where nothing before it trains);
  * a LoRA adapter adds x @ A and (x A) @ B, and their gradients;
  * MoE experts see each token top-k times; the router is a linear; DeepSeek's shared
    experts see every token;
  * multi-head latent attention: its low-rank projections are linears, and q k^T uses the
    q/k head size (nope + rope), p v the value head size;
  * attention does q @ k^T and p @ v (and 4 matmuls backward). Flash and memory-efficient
    kernels skip the tiles above a causal mask's diagonal; eager attention computes them
    (`dense_attention=True` counts every tile, as FlopCounterMode does);
  * checkpointing: full recomputes each block's forward in backward; selective (keeps the
    outputs of matmuls and attention) recomputes no matmul; the chunked loss recomputes
    the head's forward;
  * the loss head runs over every scored position (causal LMs score every token).

Figures are for one micro-batch of one model replica, before tensor/context parallelism.
CNNs are not modelled (a ResNet's convolutions are not in its Architecture).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramplan.engines.param_memory import CLASSIFIER_TASKS
from vramplan.engines.step import Step, describe_step
from vramplan.errors import JobError
from vramplan.job import Job
from vramplan.models import Architecture, Stack, load_architecture
from vramplan.models.arch import Linear

# Flash attention's causal kernels compute whole 128 x 128 tiles on and below the diagonal
# (FlashAttention-2 forward: kBlockM = 128; flash_fwd_launch_template.h), so a causal mask
# saves (1 - tile / s) / 2 of the dense FLOPs.
CAUSAL_TILE = 128


def causal_tile_fraction(seq: int | float) -> float:
    """The share of a dense seq x seq score matrix a causal fused kernel computes: the
    tiles below the diagonal and the whole diagonal ones, (1 + tile / s) / 2."""
    return (1 + CAUSAL_TILE / seq) / 2 if seq > CAUSAL_TILE else 1.0
OP_CLASSES = ("linear", "lora", "attention", "head", "frontend")


@dataclass
class PhaseFlops:
    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


@dataclass
class StepFlops:
    """FLOPs of one micro-batch by op class, and the tokens it holds."""

    by_class: dict[str, PhaseFlops] = field(
        default_factory=lambda: {c: PhaseFlops() for c in OP_CLASSES})
    tokens: int = 0            # tokens (samples for vision) through the model per micro-batch
    samples: int = 0
    notes: tuple[str, ...] = ()

    def phase(self, name: str) -> float:
        return sum(getattr(p, name) for p in self.by_class.values())

    @property
    def total(self) -> float:
        """Executed FLOPs, recomputation included."""
        return sum(p.total for p in self.by_class.values())

    @property
    def model_flops(self) -> float:
        """Forward + backward without recomputation: the numerator of MFU."""
        return self.phase("forward") + self.phase("backward")


def check_timed(arch: Architecture) -> None:
    """Step time is modelled for transformers: refuse a CNN in one line."""
    if arch.kind == "cnn":
        raise JobError(f"{arch.name}: step time is not modelled for CNNs yet (their "
                       "convolutions are not in the architecture); use a transformer model")


def step_flops(job: Job, arch: Architecture | None = None, *, dense_attention: bool = False,
               step: Step | None = None) -> StepFlops:
    """FLOPs of one micro-batch of `job` (one replica, before TP/CP sharding).

    >>> flops = step_flops(Job(model="llama-3.2-1b", batch_size=4, seq_len=2048))
    >>> round(flops.model_flops / 1e12)  # about 6 x 1.24e9 params x 8192 tokens + attention
    """
    arch = arch or load_architecture(job.model)
    check_timed(arch)
    step = step or describe_step(job, arch)
    task, shapes = step.task, step.shapes
    out = StepFlops(samples=job.batch_size,
                    tokens=job.batch_size * shapes.tokens_per_sample)
    full_ft = job.peft is None
    adapters = _adapter_targets(job, arch)
    rank = job.peft.rank if job.peft else 0
    dora = (2 if job.peft.dropout > 0 else 1) if job.peft and job.peft.dora else 0
    attention = step.attention
    b = job.batch_size

    # the frontend (patch / audio convolutions) trains with the body in full fine-tuning
    _frontend(arch, b, shapes.stack_seq, full_ft, out.by_class["frontend"])
    # Does the hidden state entering the blocks require grad? With checkpointing, peft
    # makes the token embeddings' output require it (PeftModel.__init__ ->
    # _prepare_model_for_gradient_checkpointing -> enable_input_require_grads), as QLoRA
    # recipes do (prepare_model_for_kbit_training); otherwise the first block's frozen
    # linears compute no input gradient. A frozen patch or audio frontend passes none.
    # A trained copy of the token embedding (modules_to_save) makes it require grad too.
    saved = job.peft.modules_to_save if job.peft else ()
    grad_flows = full_ft or "embed_tokens" in saved or (
        job.checkpointing != "none" and arch.stacks[0].sequence == "text")
    encoder_grad = False
    for i, (stack, seq) in enumerate(zip(arch.stacks, shapes.stack_seq)):
        enc_seq = shapes.stack_seq[0] if stack.cross_attention else 0
        causal = stack.role == "decoder" and arch.kind != "vision"
        args = (stack, b * seq, b * enc_seq, b, seq, enc_seq)
        rest = (encoder_grad, full_ft, adapters, rank, attention, causal, dense_attention,
                dora)
        # the first block may see an input without grad; the others see its output
        first, grad_out = _block(*args, grad_flows, *rest)
        later, grad_later = _block(*args, grad_out, *rest)
        for cls in first:
            target = out.by_class[cls]
            for phases, n in ((first[cls], 1), (later[cls], stack.num_layers - 1)):
                target.forward += n * phases.forward
                target.backward += n * phases.backward
                if job.checkpointing == "full":
                    target.recompute += n * phases.forward
        grad_out = grad_later if stack.num_layers > 1 else grad_out
        if arch.kind == "encoder-decoder" and i == 0:
            # the decoder starts again from (hooked) token embeddings
            encoder_grad, grad_flows = grad_out, full_ft or job.checkpointing != "none"
        else:
            grad_flows = grad_out
        if job.checkpointing == "full":
            out.by_class["linear"].recompute -= stack.num_layers * _early_stop(
                stack, b * seq, adapters, post_norms=arch.traits.post_norms)
    _head(job, arch, task, shapes, full_ft, grad_flows, out.by_class["head"])
    return out


def _early_stop(stack: Stack, tokens: int, adapters: frozenset[str], post_norms: bool) -> float:
    """Matmul FLOPs full checkpointing does not recompute. Non-reentrant checkpoint stops
    recomputing once every saved tensor is back (torch.utils.checkpoint, early stop), so
    the block's last matmul, whose output nothing saves, is skipped, unless a norm reads
    it (Gemma-2's post-MLP norm). With LoRA on it, the base matmul runs (it comes first)
    and only lora_B, the last, is skipped; its FLOPs are small and left in."""
    # DeepSeek's MoE runs its shared experts after the routed ones (their output is saved
    # by the routing weights' product): the shared down projection comes last
    last_role = "shared_out" if stack.shared_intermediate_size else "mlp_out"
    last = [ln for ln in stack.linears if ln.role == last_role]
    if post_norms or not last or last[-1].name in adapters:
        return 0.0
    ln = last[-1]
    routed = stack.experts_per_token if ln.count > 1 else 1
    return 2 * tokens * routed * ln.in_features * ln.out_features


def _adapter_targets(job: Job, arch: Architecture) -> frozenset[str]:
    if job.peft is None:
        return frozenset()
    if "all-linear" in job.peft.target_modules:
        return frozenset(ln.name for s in arch.stacks for ln in s.linears)
    return frozenset(job.peft.target_modules)


def _linear(ln: Linear, tokens: int, in_grad: bool, trains: bool, lora_rank: int,
            into: dict[str, PhaseFlops], dora: int = 0) -> bool:
    """Add one linear's matmuls; return whether its output requires grad. dora: 1 for DoRA,
    2 for DoRA with lora_dropout (engines/formula/dora.py)."""
    mm = 2 * tokens * ln.in_features * ln.out_features
    base = into["linear"]
    base.forward += mm
    base.backward += mm * (int(in_grad) + int(trains))
    if lora_rank:
        a = 2 * tokens * ln.in_features * lora_rank   # x @ A
        b = 2 * tokens * lora_rank * ln.out_features  # (x A) @ B
        lora = into["lora"]
        lora.forward += a + b
        # A and B both train; B's input (x A) requires grad, A's input only if x does
        lora.backward += a + 2 * b + (a if in_grad else 0)
        if dora:
            # the delta as a matrix, lora_B(lora_A(eye(in))): forward only (detached)
            lora.forward += 2 * ln.in_features * lora_rank * (ln.in_features + ln.out_features)
        if dora == 2:  # F.linear(dropout(x), W) again, and its input gradient
            lora.forward += mm
            lora.backward += mm if in_grad else 0
    return in_grad or trains or bool(lora_rank)


def _block(stack: Stack, tokens: int, enc_tokens: int, b: int, seq: int, enc_seq: int,
           grad_in: bool, encoder_grad: bool, full_ft: bool, adapters: frozenset[str],
           rank: int, attention: str, causal: bool, dense_attention: bool, dora: int = 0):
    """FLOPs of one block by class (forward, backward), and whether its output needs grad."""
    into = {c: PhaseFlops() for c in ("linear", "lora", "attention")}
    routed = stack.experts_per_token if stack.num_experts > 1 else 1

    def run(role: str, n_tokens: int, in_grad: bool, names: tuple[str, ...] = ()) -> bool:
        out_grad = False
        for ln in stack.linears:
            if ln.role == role and (not names or ln.name in names):
                t = n_tokens * routed if ln.count > 1 else n_tokens
                out_grad |= _linear(ln, t, in_grad, full_ft,
                                    rank if ln.name in adapters else 0, into, dora)
        return out_grad

    # q/k and v head sizes (multi-head latent attention's differ: nope + rope, and v)
    mla = stack.latent_attention
    d_qk, d_v = (mla.qk_head_dim, mla.v_head_dim) if mla else (stack.head_dim, stack.head_dim)

    def core(s_q: int, s_k: int, needs_grad: bool, is_causal: bool) -> None:
        tile = 2 * b * stack.num_heads * s_q * s_k  # x head size = one s_q x s_k matmul
        fused_causal = is_causal and attention == "sdpa" and not dense_attention
        fraction = causal_tile_fraction(s_q) if fused_causal else 1.0
        into["attention"].forward += tile * (d_qk + d_v) * fraction  # q k^T and p v
        # backward: dp = do v^T and dv = p^T do (v's size), dq = ds k and dk = ds^T q (q/k's);
        # fused kernels also recompute q k^T, eager keeps p
        backward = (3 if attention == "sdpa" else 2) * d_qk + 2 * d_v
        into["attention"].backward += tile * backward * fraction if needs_grad else 0

    if mla:
        # two paths: q_a_proj -> q_b_proj (or one q_proj), kv_a_proj_with_mqa -> kv_b_proj
        # (its rotary key part comes from kv_a directly)
        q_grad = run("attn_in", tokens, grad_in, ("q_a_proj", "q_proj"))
        q_grad = run("attn_latent", tokens, q_grad, ("q_b_proj",)) or q_grad
        kv_grad = run("attn_in", tokens, grad_in, ("kv_a_proj_with_mqa",))
        kv_grad = run("attn_latent", tokens, kv_grad, ("kv_b_proj",)) or kv_grad
        qkv_grad = q_grad or kv_grad
    else:
        qkv_grad = run("attn_in", tokens, grad_in)
    core(seq, seq, qkv_grad, causal)
    h = run("attn_out", tokens, qkv_grad) or grad_in
    if stack.cross_attention:
        q_grad = run("cross_q", tokens, h)
        kv_grad = run("cross_kv", enc_tokens, encoder_grad)
        core(seq, enc_seq, q_grad or kv_grad, False)
        h = run("cross_out", tokens, q_grad or kv_grad) or h
    run("router", tokens, h)
    mid = run("mlp_in", tokens, h)
    out = run("mlp_out", tokens, mid) or h
    # DeepSeek's shared experts: a gated MLP over every token, beside the routed experts
    shared = run("shared_in", tokens, h)
    out = run("shared_out", tokens, shared) or out
    return into, out


def _frontend(arch: Architecture, b: int, stack_seq: tuple[int, ...], trains: bool,
              into: PhaseFlops) -> None:
    first = arch.stacks[0]
    if first.sequence == "patches":
        patches = stack_seq[0] - 1  # minus the CLS token
        conv = 2 * b * patches * arch.num_channels * arch.patch_size ** 2 * first.hidden_size
        into.forward += conv
        into.backward += conv if trains else 0  # weight grad only: pixels need none
    elif first.sequence == "audio":
        frames, d = arch.max_source_positions, first.hidden_size
        conv1 = 2 * b * frames * arch.num_mel_bins * 3 * d        # kernel 3, stride 1
        conv2 = 2 * b * (frames // 2) * d * 3 * d                 # kernel 3, stride 2
        into.forward += conv1 + conv2
        into.backward += (conv1 + 2 * conv2) if trains else 0


def _head(job: Job, arch: Architecture, task: str, shapes, full_ft: bool, grad_in: bool,
          into: PhaseFlops) -> None:
    b, h = job.batch_size, arch.stacks[-1].hidden_size
    positions = b * shapes.stack_seq[-1]
    # peft trains a new classifier beside the adapters, and an LM head in modules_to_save
    trains = full_ft or task in CLASSIFIER_TASKS or (
        job.peft is not None and "lm_head" in job.peft.modules_to_save)
    if task in ("causal-lm", "seq2seq", "speech-seq2seq"):
        scored = shapes.loss_tokens
        matmuls = [(scored, h, arch.vocab_size)]
    elif task == "masked-lm":
        matmuls = [(positions, h, h), (positions, h, arch.vocab_size)]  # transform + decoder
    elif task == "seq-classification":
        if arch.kind == "decoder":  # scores every position, then pools the last one
            matmuls = [(positions, h, arch.num_labels)]
        else:  # pooler / classifier dense on the first token, then the classifier
            matmuls = [(b, h, h), (b, h, arch.num_labels)]
    elif task == "image-classification":
        matmuls = [(b, h, arch.num_labels)]  # on the CLS token
    else:
        matmuls = []
    for m, k, n in matmuls:
        mm = 2 * m * k * n
        into.forward += mm
        into.backward += mm * (int(grad_in) + int(trains))
        if job.loss == "chunked":
            into.recompute += mm  # each chunk's logits are recomputed in backward
