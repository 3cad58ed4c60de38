"""The memory-bound bytes of a compiled block (planning/traffic.py): what Inductor's fused
kernels read and write, for a block that is not Llama-style too (GPT-2: learned positions,
LayerNorm, GELU MLP, dropout)."""

import pytest

from vramplan.engines.precision import dtypes_for
from vramplan.job import Job
from vramplan.models import load_architecture
from vramplan.planning.traffic import step_traffic

B, SEQ = 2, 512


def _forward(job: Job) -> dict[str, float]:
    t = step_traffic(job, load_architecture(job.model))
    return {op: v for (op, phase), v in t.by_op_phase.items() if phase == "forward"}


def test_a_compiled_gpt2_block_streams_its_own_ops():
    arch = load_architecture("gpt2")
    (stack,) = arch.stacks
    layers, h, a = stack.num_layers, stack.hidden_size, stack.num_heads
    assert not arch.traits.rotary and arch.attention_dropout > 0 and arch.hidden_dropout > 0
    sdpa = Job(model="gpt2", batch_size=B, seq_len=SEQ, compile=True)
    dt = dtypes_for(sdpa)
    c, r, tokens = dt.compute, dt.residual, B * SEQ
    ops = _forward(sdpa)
    assert "rotary" not in ops  # learned positions: nothing to rotate
    # flash attention: read q, k, v and write o; no score matrix in memory
    assert ops["attention io"] == layers * c * 4 * tokens * h
    assert "softmax" not in ops
    # two residual adds, each with its dropout fused in: read 2, write 1, plus the mask byte
    assert ops["residual"] == layers * 2 * (3 * r + 1) * tokens * h
    assert ops["activation"] == layers * 2 * c * tokens * stack.intermediate_size

    eager = _forward(sdpa.with_changes(attention="eager"))
    # one fused kernel over the scores: read them, write the probabilities and dropout's mask
    assert eager["softmax"] == layers * B * a * SEQ * SEQ * (2 * c + 1)
    assert eager["attention io"] == layers * c * 5 * tokens * h


def test_a_compiled_llama_block_keeps_its_rotary_pass():
    job = Job(model="llama-3.2-1b", batch_size=1, seq_len=SEQ, compile=True)
    (stack,) = load_architecture(job.model).stacks
    c = dtypes_for(job).compute
    q, kv = SEQ * stack.num_heads * stack.head_dim, SEQ * stack.num_kv_heads * stack.head_dim
    assert _forward(job)["rotary"] == stack.num_layers * 2 * c * (q + kv)


def test_compiled_lora_streams_its_adapters_with_scale_and_add_fused():
    peft = {"method": "lora", "rank": 16, "dropout": 0.0, "target_modules": ("q_proj",)}
    job = Job(model="llama-3.2-1b", batch_size=1, seq_len=SEQ, compile=True, peft=peft)
    (stack,) = load_architecture(job.model).stacks
    c, h = dtypes_for(job).compute, stack.hidden_size
    q_out = stack.num_heads * stack.head_dim
    # x @ A reads x (c h) and writes x A (c r); @ B reads it and writes q's size; one fused
    # kernel reads that and the base output and writes the sum (3 passes): c (h + 2r + 4 q)
    per_token = c * (h + 2 * 16 + 4 * q_out)
    assert _forward(job)["lora"] == stack.num_layers * SEQ * per_token


def _lora_bytes(job: Job) -> tuple[float, float]:
    t = step_traffic(job, load_architecture(job.model))
    return t.by_op_phase["lora", "forward"], t.by_op_phase["lora", "backward"]


def test_eager_lora_counts_peft_casts_to_fp32_adapters():
    """peft's eager LoRA Linear (benchmarks/traffic_vs_dispatch.py counts it from a dispatched
    step): bf16 autocast with fp32 adapters casts x to fp32 and autocast casts it back for
    x @ A; in the model's dtype nothing is cast; fp32 adapters without autocast add in fp32
    and cast the sum back."""
    peft = {"rank": 16, "dropout": 0.0, "target_modules": ("q_proj",)}
    job = Job(model="llama-3.2-1b", batch_size=1, seq_len=SEQ, peft=peft)
    (stack,) = load_architecture(job.model).stacks
    c, h, r, n = 2, stack.hidden_size, 16, stack.num_layers * SEQ
    q = stack.num_heads * stack.head_dim
    # forward: A reads x (c h) and writes x A, B reads it (2 c r), B writes q, the scale reads
    # and writes it, the add reads both and writes the sum (6 c q); the two casts r and w h
    casts = 2 * (c + 4) * h
    fwd, bwd = _lora_bytes(job)
    assert fwd == n * (c * h + 2 * c * r + 6 * c * q + casts)
    # backward: the scale's gradient (r, w) and B's two matmuls reading it (4 c q); x A's
    # gradient written and read (2 c r each way); A's input gradient written and its input
    # read, the add into x's gradient (2 c h + 3 c h); each cast once more
    assert bwd == n * (4 * c * q + 4 * c * r + 5 * c * h + casts)

    model_dtype = job.with_changes(peft={**peft, "adapter_dtype": "model"})
    assert _lora_bytes(model_dtype) == (n * (c * h + 2 * c * r + 6 * c * q),
                                        n * (4 * c * q + 4 * c * r + 5 * c * h))
    # no autocast: A and B run in fp32; the add (r 2, r 4, w 4) and the sum's cast back to
    # 16-bit (r 4, w 2); backward casts the sum's gradient to fp32 and the base's back
    pure = job.with_changes(precision="bf16-pure", peft={**peft, "adapter_dtype": "fp32"})
    a = 4
    fwd, bwd = _lora_bytes(pure)
    assert fwd == n * ((c + a) * h + a * h + 2 * a * r + (a + 2 * a + c + a + a) * q
                       + (a + c) * q)
    assert bwd == n * (4 * a * q + 4 * a * r + (2 * a + 3 * c) * h + (c + a) * h
                       + 2 * (a + c) * q)


def test_float8_linears_cast_their_inputs_gradients_and_weights():
    """torchao Float8Linear's dynamic casts, per block linear (traffic._float8_casts): the
    16-bit input and the fp32 weight in forward; the output gradient twice, the weight and
    the input again in backward. Eager, a cast of a c-byte tensor moves 4c + 25 bytes per
    element (abs, max, upcast, scale, clamp, cast); compiled, c + 1 for an activation or a
    gradient (its amax fused into the producer) and 2c + 1 for a weight (read for its amax,
    then cast)."""
    arch = load_architecture("gpt2")
    (stack,) = arch.stacks
    tokens, layers = B * SEQ, stack.num_layers
    n_in = sum(tokens * ln.in_features for ln in stack.linears)
    n_out = sum(tokens * ln.out_features for ln in stack.linears)
    weights = sum(ln.in_features * ln.out_features for ln in stack.linears)
    for compile_, act, weight in ((False, 4 * 2 + 25, 4 * 4 + 25), (True, 2 + 1, 2 * 4 + 1)):
        job = Job(model="gpt2", batch_size=B, seq_len=SEQ, precision="fp8", compile=compile_)
        t = step_traffic(job, arch).by_op_phase
        assert t["fp8 input cast", "forward"] == layers * n_in * act
        assert t["fp8 weight cast", "forward"] == layers * weights * weight
        assert t["fp8 grad cast", "backward"] == layers * 2 * n_out * act
        assert t["fp8 input recast", "backward"] == layers * n_in * act
        assert t["fp8 weight cast", "backward"] == layers * weights * weight
        assert ("fp8 input cast", "recompute") not in t  # no checkpointing, no recompute
    bf16 = step_traffic(Job(model="gpt2", batch_size=B, seq_len=SEQ), arch).by_op_phase
    assert not any(op.startswith("fp8") for op, _ in bf16)
    # rowwise_with_gw_hp's weight gradient reads the 16-bit input and output gradient
    gw_hp = step_traffic(Job(model="gpt2", batch_size=B, seq_len=SEQ, precision="fp8",
                             compile=True, fp8={"recipe": "rowwise_with_gw_hp"}),
                         arch).by_op_phase
    assert gw_hp["fp8 grad cast", "backward"] == layers * n_out * (2 + 1)
    assert ("fp8 input recast", "backward") not in gw_hp
    assert gw_hp["fp8 weight cast", "backward"] == layers * weights * (2 * 4 + 1)


def test_compiled_float8_casts_a_shared_input_once():
    """Compiled, q, k and v (and gate and up) read one cast of their input; eager, each
    Float8Linear casts it again."""
    arch = load_architecture("llama-3.2-1b")
    (stack,) = arch.stacks
    tokens, layers, h = B * SEQ, stack.num_layers, stack.hidden_size
    by = {ln.name: ln for ln in stack.linears}
    compiled = Job(model="llama-3.2-1b", batch_size=B, seq_len=SEQ, precision="fp8",
                   compile=True)
    t = step_traffic(compiled, arch).by_op_phase
    # one cast of the normed hidden state for each of attention and MLP, plus o's and down's
    distinct = 2 * h + by["o_proj"].in_features + by["down_proj"].in_features
    assert t["fp8 input cast", "forward"] == layers * tokens * distinct * (2 + 1)
    eager = step_traffic(compiled.with_changes(compile=False), arch).by_op_phase
    every = sum(ln.in_features for ln in stack.linears)
    assert every > distinct
    assert eager["fp8 input cast", "forward"] == layers * tokens * every * (4 * 2 + 25)


def test_float8_all_gather_casts_each_ranks_shard_of_the_weights():
    """fp8.fsdp_float8_all_gather: each rank casts its shard before FSDP gathers it."""
    from vramplan.job import Parallel

    arch = load_architecture("llama-3.2-1b")
    job = Job(model="llama-3.2-1b", batch_size=B, seq_len=SEQ, precision="fp8", compile=True,
              parallel=Parallel(strategy="fsdp", num_gpus=8))
    whole = step_traffic(job, arch).by_op_phase["fp8 weight cast", "forward"]
    gathered = job.with_changes(fp8={"fsdp_float8_all_gather": True})
    assert step_traffic(gathered, arch).by_op_phase["fp8 weight cast", "forward"] == (
        pytest.approx(whole / 8))
