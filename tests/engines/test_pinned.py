"""Exact answers for small jobs, worked out by hand, so that a one-line change to the
formula, the fit table or the report's categories fails a test (mutation testing found
each of these unpinned: benchmarks/results/mutation_testing.md)."""

import dataclasses

import pytest

from vramplan import Job
from vramplan.engines import activations as act
from vramplan.engines import formula
from vramplan.engines import step as step_desc
from vramplan.engines.formula import saved as formula_saved
from vramplan.hardware import get_gpu
from vramplan.models import architecture_from_config
from vramplan.models.families import Traits

MiB = 2**20
# A tiny Llama: hidden 64, 4 heads of 16 (2 key/value heads), MLP 128, 2 blocks, vocab 256
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=512, hidden_act="silu")
# batch 8 x 256 tokens: N = 2048 tokens; one fp32 [N, 64] tensor is 2048 * 64 * 4 = 524,288 B
JOB = Job(model="tiny", batch_size=8, seq_len=256, precision="fp32")
NH = 524_288


def test_a_llama_block_saves_these_tensors():
    arch = architecture_from_config(TINY, "tiny")
    stack = arch.stacks[0]
    saved = act.block_saved_tensors(
        stack, act.BlockShape(8, 256, None), step_desc.activation_dtypes(JOB), attention="sdpa",
        hidden_dropout=0.0, attention_dropout=0.0, adapters=formula_saved.adapters_of(JOB),
        traits=Traits(activation="silu", upcast_softmax=True, rotary=True), norms_per_block=2)
    assert dict(saved) == {
        "attn norm": 2 * NH,          # RMSNorm keeps its fp32 input and the normalised x
        "attn in": NH,                # q/k/v projections' input (norm output x weight)
        "self q,k,v": NH + 2 * NH // 2,  # q [N, 64] + k, v [N, 32] after rotary
        "self sdpa out": NH,          # flash output, also o_proj's input
        "self logsumexp": 8 * 4 * 256 * 4,  # b x heads x s fp32
        "mlp norm": 2 * NH, "mlp in": NH,
        "gate/up/act": 3 * 4 * NH // 2,   # gate, up, silu(gate): [N, 128] each
        "mlp mid": 2 * NH,            # silu(gate) * up, down_proj's input [N, 128]
    }


def test_activations_runtime_and_overhead_of_a_tiny_step():
    report = formula.estimate(JOB, model_config=TINY)
    block = 2 * NH + NH + 2 * NH + NH + 32_768 + 2 * NH + NH + 6 * NH + 2 * NH  # as above
    outside = 2 * NH + NH  # final RMSNorm (input + normalised) and the LM head's input
    assert report.peak_phase == "backward"
    assert report.categories["activations"] == 2 * block + outside == 19_464_192
    assert report.categories["inputs"] == 8 * 2048  # input ids (int64) saved by the embedding
    # logits, log-probabilities and their gradient, fp32 [N, 256]: 3 x 2 MiB; two cuBLAS
    # workspaces of 32 MiB (Hopper, the default GPU)
    assert report.categories["temporary"] == 3 * 2048 * 256 * 4 + 2 * 32 * MiB
    # the caching allocator's overhead without checkpointing: 6% of what the step allocates
    # on top of the model's state (activations + temporaries)
    transient = report.categories["activations"] + report.categories["temporary"]
    assert report.categories["allocator_overhead"] == int(0.06 * transient)
    # reserved = allocated + the allocator's overhead; the device adds the context on top
    allocated = sum(report.categories[c] for c in ("weights", "gradients", "optimizer_states",
                                                   "activations", "inputs", "temporary"))
    assert report.peak_reserved == allocated + int(0.06 * transient)
    assert report.device_total == allocated + int(0.06 * transient) + 1390 * MiB
    # outside the allocator: an H200's measured 1390 MiB
    assert report.categories["runtime_context"] == 1390 * MiB


def _base_total() -> int:
    return formula.estimate(JOB.with_changes(gpu="L4", runtime={"cuda_context_bytes": 0}),
                            model_config=TINY).device_total


def _needing(extra: int):
    """The tiny job on the L4, with a runtime context that makes it need usable + extra."""
    l4 = get_gpu("L4")
    base = formula.estimate(JOB.with_changes(gpu="L4", runtime={"cuda_context_bytes": 0}),
                            model_config=TINY)
    context = l4.usable_bytes - base.device_total + extra
    report = formula.estimate(JOB.with_changes(
        gpu="L4", runtime={"cuda_context_bytes": context}), model_config=TINY)
    return report.fits[0], l4


def test_fit_is_judged_against_usable_memory_with_the_safety_margin():
    from vramplan.engines.runtime import with_margin
    # 5% of the L4's usable memory stays free: the last byte that fits is usable x 0.95
    l4 = get_gpu("L4")
    keep_free = l4.usable_bytes - int(l4.usable_bytes * 0.95)
    fit, _ = _needing(-keep_free)
    assert fit.margin == 0.05 and fit.headroom_bytes == keep_free and fit.fits
    fit, _ = _needing(-keep_free + 1)
    assert not fit.fits
    # without a margin: exactly full fits, one byte more does not, though it is far below
    # the L4's nominal memory
    fit, l4 = _needing(0)
    (exact,) = with_margin([fit], 0.0)
    assert exact.headroom_bytes == 0 and exact.fits
    from vramplan.engines.runtime import fit_table
    exact_report = formula.estimate(JOB.with_changes(gpu="L4", runtime={
        "cuda_context_bytes": l4.usable_bytes - _base_total()}), model_config=TINY)
    (table_fit,) = fit_table(exact_report, exact_report.job.runtime, [l4], l4, margin=0.0)
    assert table_fit.required_bytes == l4.usable_bytes and table_fit.fits
    fit, l4 = _needing(1)
    (over,) = with_margin([fit], 0.0)
    assert over.required_bytes == l4.usable_bytes + 1 < l4.memory_bytes and not over.fits


@pytest.mark.torch
@pytest.mark.parametrize("checkpointing", ["full"])
def test_the_trace_counts_a_recomputed_block_as_activations(checkpointing):
    from vramplan.engines.trace import trace
    report = trace(JOB.with_changes(checkpointing=checkpointing), model_config=TINY)
    kept = 2 * NH + 3 * NH  # the two blocks' inputs + final norm and head input
    block = 2 * NH + NH + 2 * NH + NH + 32_768 + 2 * NH + NH + 6 * NH + 2 * NH
    # at the backward peak one block is being recomputed: most of its saved tensors are
    # alive, and they are activations (the step saved them for backward), not temporaries
    assert report.peak_phase == "backward"
    assert report.categories["activations"] > kept + block // 2


def test_fp8_is_torchaos_float8_linear():
    """torchao's Float8Linear saves the bf16 input (as a bf16 linear does) and the fp32
    weight itself: the same activations as bf16-mixed, and no autocast weight copies for
    the block linears (2 blocks x 36,864 weights x 2 bytes fewer temporaries)."""
    fp8 = formula.estimate(JOB.with_changes(precision="fp8", batch_size=8), model_config=TINY)
    bf16 = formula.estimate(JOB.with_changes(precision="bf16-mixed", batch_size=8),
                            model_config=TINY)
    # q 64x64, k and v 64x32, o 64x64, gate and up 64x128, down 128x64
    block_linears = 4096 + 2048 + 2048 + 4096 + 8192 + 8192 + 8192
    assert fp8.categories["activations"] == bf16.categories["activations"]
    assert bf16.categories["temporary"] - fp8.categories["temporary"] == 2 * block_linears * 2


def test_t5_tensors_outside_the_blocks_are_pinned():
    # bf16-pure, batch 1, 128 tokens each side, 128 wide, 4 heads, 2 decoder layers, sdpa:
    # every count below is b x s x h = 16,384 elements, or s x s = 16,384
    from vramplan.engines import activations as act
    from vramplan.engines.precision import Dtypes
    from vramplan.models.arch import Linear, Stack
    linears = (Linear("k", 128, 128, False, role="cross_kv"),
               Linear("v", 128, 128, False, role="cross_kv"))
    enc = Stack(role="encoder", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4,
                head_dim=32, intermediate_size=256, mlp="relu", norm="rmsnorm", linears=(),
                params_per_layer=0)
    dec = Stack(role="decoder", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=4,
                head_dim=32, intermediate_size=256, mlp="relu", norm="rmsnorm", linears=linears,
                params_per_layer=0, cross_attention=True)
    bf16 = Dtypes(weight=2, grad=2, compute=2, residual=2, autocast=False, linear_saved=2)
    saved = dict(act.encoder_decoder_outside(
        (enc, dec), (128, 128), 1, bf16, attention="sdpa", checkpointing="none",
        adapters=act.Adapters(), final_norm_bytes=6, relative_bias=True, hidden_dropout=0.1))
    n = 16_384
    assert saved == {
        "encoder final norm": (6 + 2) * n, "encoder output": 2 * n,
        "decoder final norm 16-bit scale input": 2 * n, "final dropout masks": 2 * n,
        "position buckets int64": 8 * 2 * n, "decoder causal masks": 2 * n,
        "cross-attention zero bias": 2 * 4 * n}
    # a decoder-only model of two stacks (DeepSeek's dense first layers, then MoE) has no
    # encoder: nothing outside its blocks but the final norm the caller counts
    plain = dataclasses.replace(dec, cross_attention=False)
    assert act.encoder_decoder_outside(
        (plain, plain), (128, 128), 1, bf16, attention="sdpa", checkpointing="none",
        adapters=act.Adapters(), final_norm_bytes=6, relative_bias=False,
        hidden_dropout=0.1) == []
