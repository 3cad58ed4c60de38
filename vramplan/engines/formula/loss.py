"""Loss buffers: logits and cross-entropy memory in forward and at the start of backward,
for transformers' losses, vramplan's chunked loss, torchtune's, Liger's and the compiled one."""

from __future__ import annotations

import math

from vramplan.engines.param_memory import hidden_size
from vramplan.engines.precision import Dtypes
from vramplan.engines.step import Shapes
from vramplan.job import CHUNKED_LOSS_CHUNKS, Job
from vramplan.models import Architecture


def loss_buffers(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes, task: str):
    """(forward, backward-start) bytes of logits and cross-entropy buffers."""
    return _loss_memory(job, arch, shapes, dt, task)[:2]


def kept_until_backward(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes,
                        task: str) -> float:
    """Bytes of one micro-batch's logits and loss tensors that stay until its backward:
    what a GPipe last stage keeps for each further micro-batch in flight (its output, the
    logits, and the loss's saved tensors: the forward's buffers less the copies that die
    in the forward)."""
    return _loss_memory(job, arch, shapes, dt, task)[2]


def _loss_memory(job: Job, arch: Architecture, shapes: Shapes, dt: Dtypes, task: str):
    """(forward, backward-start, kept until backward) bytes of the logits and the loss."""
    t = shapes.loss_tokens / job.parallel.context_parallel
    vocab = arch.vocab_size / job.parallel.tensor_parallel
    if not t or not vocab:
        return 0.0, 0.0, 0.0
    c, h = dt.compute, hidden_size(arch)
    if job.loss == "chunked:liger":
        return liger_loss_buffers(job, t, vocab, h, dt)
    if job.loss.startswith("chunked:torchtune"):
        return torchtune_loss_buffers(job, t, vocab, h, dt)
    if job.loss == "chunked":
        # training.losses.chunked_causal_lm_loss: each sequence chunk checkpointed, so forward keeps
        # no logits; backward recomputes one chunk's bf16 logits, their fp32 copy and
        # log_softmax, then the nll and log_softmax gradients, beside the hidden states' grad
        tc = t / CHUNKED_LOSS_CHUNKS
        return max(c + 4, 8) * tc * vocab, (c + 12) * tc * vocab + c * t * h, 0.0
    tv = t * vocab
    transient = 0.0  # forward copies that die before backward
    if job.compiles_loss:
        # the compiled loss (training/compiled.py compile_loss) fuses the upcast, log_softmax
        # and nll into reductions: forward keeps the logits and two fp32 values per token
        # (max, log-sum-exp); its backward writes the logits' gradient in their dtype
        # while the saved logits are still alive
        forward, backward = c * tv + 8 * t, 2 * c * tv + 8 * t
    elif task == "causal-lm" or not dt.autocast:
        # transformers' causal-LM loss upcasts the logits to fp32 first; other heads without
        # autocast stay in the logits' dtype. Forward: logits (kept by the output), the
        # upcast copy, the log_softmax output (saved); backward: that output plus the dense
        # nll and log_softmax gradients. The logits are dropped with the outputs (HF Trainer).
        loss = 4 if task == "causal-lm" else c
        transient = loss * tv if loss != c else 0
        forward = c * tv + loss * tv + transient
        backward = 3 * loss * tv
    else:
        # cross_entropy on 16-bit logits under CUDA autocast: log_softmax stays 16-bit and
        # only nll_loss's input is upcast, and both are saved; backward adds the fp32 nll
        # gradient (measured on an H200: benchmarks/results/gpu_runtime_probe.json)
        forward = 2 * c * tv + 4 * tv
        backward = (c + 8) * tv
    if arch.traits.final_logit_softcap:  # Gemma-2 keeps tanh(logits / cap)
        forward, backward = forward + c * tv, backward + c * tv
    return forward, backward, forward - transient


# torchtune's chunked losses split the scored tokens into 8 (num_output_chunks = 8)
TORCHTUNE_LOSS_CHUNKS = 8


def torchtune_loss_buffers(job: Job, t: float, vocab: float, h: int, dt: Dtypes):
    """(forward, backward-start, kept until backward) bytes of torchtune's chunked losses,
    eager (uncompiled).

    Per chunk both run logits.float() and cross_entropy, whose log_softmax saves its fp32
    output: every chunk's stays until backward (4 bytes x tokens x vocab in all), and the
    last chunk's 16-bit logits and fp32 copy are alive beside them. CEWithChunkedOutputLoss
    also holds all 16-bit logit chunks the model returned until the loss ends. Backward
    starts with one chunk's nll and log_softmax fp32 gradients (the 16-bit one comes after
    the nll gradient is freed).
    A trained output head's gradient is summed over the chunks out of place: when the
    second chunk's arrives, the running sum, that gradient and their sum are three
    head-sized buffers, while 6 of the 8 chunks' log_softmax outputs are still saved
    (seen in the trace of Llama-2-7B and Llama-3.2-1B)."""
    c, tc = dt.compute, t / TORCHTUNE_LOSS_CHUNKS
    if job.compiles_loss:
        # each chunk's compiled cross-entropy saves its 16-bit logits (not an fp32
        # log_softmax) and two fp32 values per token; backward starts with one chunk's
        # gradient beside them
        forward, backward = c * t * vocab + 8 * t, c * t * vocab + c * tc * vocab
        if job.peft is None:
            remaining = c * (TORCHTUNE_LOSS_CHUNKS - 2) * tc * vocab
            backward = max(backward, remaining + 3 * vocab * h * dt.grad)
        return forward, backward, forward
    # the last chunk's 16-bit logits and fp32 copy die in the forward (the -output loss
    # keeps every chunk's logits)
    transient = (c + 4) * tc * vocab
    forward = 4 * t * vocab + transient
    if job.loss == "chunked:torchtune-output":
        transient = 4 * tc * vocab
        forward = (c + 4) * t * vocab + transient
    backward = 4 * t * vocab + 8 * tc * vocab
    if job.peft is None:
        remaining = 4 * (TORCHTUNE_LOSS_CHUNKS - 2) * tc * vocab
        backward = max(backward, remaining + 3 * vocab * h * dt.grad)
    return forward, backward, forward - transient


def liger_loss_buffers(job: Job, t: float, vocab: float, h: int, dt: Dtypes):
    """(forward, backward-start, kept until backward) bytes of Liger-Kernel's fused linear
    cross-entropy (ops/fused_linear_cross_entropy.py at ead96b6,
    fused_linear_cross_entropy_forward): the tokens go through the head in chunks of
    next_pow2(ceil(t / ceil(V / h))) rows; each chunk's 16-bit logits become their gradient
    in place, and the input's and the head's gradients are computed in forward, into
    buffers kept for backward: grad_input (t x h, the hidden states' dtype: fp32 under
    autocast) and, when the head trains, grad_weight (V x h, the head's dtype; on Ampere and
    later addmm accumulates it in place). Backward only scales them. No logits stay."""
    c = dt.compute
    inc = math.ceil(vocab / h)
    chunk = min(2 ** math.ceil(math.log2(max(1.0, math.ceil(t / inc)))), t)
    kept = t * h * dt.residual + (vocab * h * dt.weight if job.peft is None else 0.0)
    # one chunk's logits, its grad_input rows before they are copied in, the fp32 losses
    forward = kept + chunk * vocab * c + chunk * h * c + 4 * t
    return forward, kept, kept
