"""DeepSeek-style models: multi-head latent attention (MLA) and DeepSeek's MoE (dense first
blocks, routed experts, a router, shared experts), in the catalog, the formula's activations
and the FLOP model. The formula is checked against the trace block by block (what one block
saves for backward) and at the peak; the FLOPs are checked in tests/planning/test_plan_flops.py."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import defaultdict

import pytest
from tiny_configs import DEEPSEEK_V3

from vramplan import Job
from vramplan.engines import activations as act
from vramplan.engines import formula
from vramplan.engines import step as step_desc
from vramplan.engines.formula import saved
from vramplan.errors import JobError
from vramplan.models import architecture_from_config, load_architecture
from vramplan.models.families import Traits

# --- catalog and shapes -----------------------------------------------------------------


def test_deepseek_v3_parameters_are_derived_exactly():
    """h 7168, 128 heads of q/k 128 + 64 and v 128, q latent 1536, kv latent 512.
    Attention: q_a 7168x1536 + q_b 1536x(128x192) + kv_a 7168x(512+64) + kv_b 512x(128x256)
    + o (128x128)x7168 = 187,105,280; norms 2 x 7168 + 1536 + 512 = 16,384.
    Dense block (3 of them): + SwiGLU 3 x 7168 x 18432 = 583,483,392.
    MoE block (58): + router 256 x 7168, 256 experts x 3 x 7168 x 2048, shared expert
    3 x 7168 x 2048 = 11,507,286,016. Embeddings and untied head 2 x 129280 x 7168, final
    norm 7168. transformers builds no multi-token-prediction layer."""
    arch = load_architecture("deepseek-ai/DeepSeek-V3")
    attention, norms = 187_105_280, 16_384
    dense = attention + norms + 3 * 7168 * 18432
    moe = attention + norms + 256 * 7168 + 256 * 3 * 7168 * 2048 + 3 * 7168 * 2048
    assert [(s.num_layers, s.params_per_layer) for s in arch.stacks] == [(3, dense), (58, moe)]
    assert arch.total_params() == 3 * dense + 58 * moe + 2 * 129280 * 7168 + 7168 \
        == 671_026_404_352
    mla = arch.stacks[1].latent_attention
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.v_head_dim) == \
        (1536, 512, 192, 128)
    sparse = arch.stacks[1]
    assert (sparse.num_experts, sparse.experts_per_token, sparse.intermediate_size,
            sparse.shared_intermediate_size, sparse.router) == (256, 8, 2048, 2048, "sigmoid")


def test_deepseek_v2_lite_has_one_q_projection():
    """q_lora_rank null: one q_proj 2048 x (16 x 192); 1 dense + 26 MoE blocks of 64 experts
    (top-6) and 2 shared experts (one SwiGLU of 2 x 1408)."""
    arch = load_architecture("deepseek-ai/DeepSeek-V2-Lite-Chat")
    assert arch.name == "deepseek-v2-lite" and arch.total_params() == 15_706_484_224
    names = [ln.name for ln in arch.stacks[0].linears[:4]]
    assert names == ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    assert arch.stacks[1].shared_intermediate_size == 2 * 1408
    assert arch.stacks[1].router == "softmax"


def test_all_moe_layers_make_one_stack():
    config = dict(DEEPSEEK_V3, first_k_dense_replace=0)
    arch = architecture_from_config(config, "tiny")
    assert len(arch.stacks) == 1 and arch.stacks[0].num_experts == 8


def test_lora_on_names_peft_moves_to_the_experts_is_refused():
    # peft 0.21 turns gate_proj/up_proj/down_proj/gate (and all-linear) into adapters on the
    # routed experts' stacked parameters and the router, not on the shared experts' linears
    job = Job(model="deepseek-v2-lite", batch_size=1, seq_len=512,
              peft={"target_modules": ["q_proj", "gate_proj", "up_proj"]})
    with pytest.raises(JobError, match=r"\['gate_proj', 'up_proj'\].*--engine trace"):
        formula.estimate(job)


def test_cli_estimates_deepseek_v3_on_h200s(run_cli):
    code, out, err = run_cli("estimate", "deepseek-ai/DeepSeek-V3", "--gpu", "h200", "-n", "256",
                             "--strategy", "fsdp", "-b", "1", "-s", "4096", "--checkpointing",
                             "full", "--json")
    assert code in (0, 1), err
    data = json.loads(out)
    assert data["model_name"] == "deepseek-v3" and data["params_total"] == 671_026_404_352
    # fp32 weights, gradients and two Adam states sharded over 256 GPUs: 16 bytes a parameter
    sharded = data["categories"]["weights"] + data["categories"]["gradients"] \
        + data["categories"]["optimizer_states"]
    assert sharded == pytest.approx(16 * 671_026_404_352 / 256, rel=1e-6)


# --- what one block saves, in the formula ------------------------------------------------

B, S = 2, 64
T = B * S   # tokens


def _formula_blocks(job: Job, config: dict) -> list[int]:
    arch = architecture_from_config(config, "tiny")
    dt = step_desc.activation_dtypes(job)
    return [sum(b for _, b in act.block_saved_tensors(
        st, act.BlockShape(job.batch_size, job.seq_len), dt, attention=job.attention,
        hidden_dropout=0.0, attention_dropout=0.0, adapters=saved.adapters_of(job),
        traits=Traits(activation="silu", upcast_softmax=True)))
        for st in arch.stacks]


def test_pinned_saved_bytes_of_a_tiny_deepseek_block():
    """bf16-mixed (fp32 weights and residual stream, 16-bit matmuls), eager attention,
    b 2 x s 64 = T 128 tokens, h 64, 4 heads of q/k 16 + 8 = 24 and v 16, q latent 48,
    kv latent 32, 8 experts (top-2) of 32, shared expert 32.
    Attention: input norm fp32 input + fp32 normalised 8 T h = 65,536; q_a and kv_a each
    cast its input 2 x 2 T h = 32,768; q latent norm (fp32 copy + 16-bit) 6 x T x 48 = 36,864
    and q_b's cast 2 x T x 48 = 12,288; kv latent 6 x T x 32 = 24,576 + 2 x T x 32 = 8,192;
    q and k 2 x 2 x T x 4 x 24 = 49,152; fp32 softmax 4 x 2 x 4 x 64 x 64 = 131,072, its
    16-bit copy 65,536; v made contiguous 2 x T x 4 x 16 = 16,384; merged heads for o_proj
    16,384. Sum 458,752.
    MoE: post-attention norm 65,536; router and shared gate/up casts 3 x 2 T h = 49,152;
    sigmoid scores 2 x T x 8 = 2,048; top-k indices (int64) and weights (16-bit) and their
    fp32 sum 10 x T x 2 + 4 T = 3,072; sort, token index, inverse permutation (int64),
    offsets (int32) and routing weights 24 x 256 + 4 x 8 + 2 x 256 = 6,688; gathered inputs
    2 x 256 x 64 = 32,768; gate_up out, activation out 6 x 256 x 32 = 49,152; product
    2 x 256 x 32 = 16,384; expert outputs 2 x 256 x 64 = 32,768; shared gate/up/act
    6 x T x 32 = 24,576 and product 2 x T x 32 = 8,192. Sum 290,336.
    Dense MLP (intermediate 128): norm 65,536, two casts 32,768, gate/up/act 6 T x 128 =
    98,304, product 32,768: 229,376."""
    job = Job(model="x", batch_size=B, seq_len=S, precision="bf16-mixed", attention="eager")
    dense, moe = _formula_blocks(job, DEEPSEEK_V3)
    assert (dense, moe) == (458_752 + 229_376, 458_752 + 290_336)


# --- against the trace --------------------------------------------------------------------

needs_torch = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
    reason="the trace needs torch and transformers")
_LAYER = re.compile(r"layers\.(\d+)\.")


def _traced_blocks(job: Job, config: dict) -> dict[int, int]:
    """Bytes each block saves for backward in the trace (step 2), by layer index (no
    weight copies among them: the jobs are bf16-pure or PEFT on a 16-bit base)."""
    from vramplan.engines.trace import STEPS, run_trace

    result = run_trace(job, model_config=config)
    start, end = result.step_range(STEPS)
    per_layer: dict[int, int] = defaultdict(int)
    for sign, record in result.events[start:end]:
        match = _LAYER.search(record.module + ".")
        if sign > 0 and match and record.category() == "activations":
            per_layer[int(match.group(1))] += record.nbytes
    return dict(per_layer)


# the trace also keeps each RMSNorm's fp32 rsqrt (4 bytes a token: 4 norms a block), which
# the formula leaves out (0.3% of a block here), and peft's 16-bit copies of the adapters
BLOCK_TOLERANCE = 0.01


@pytest.mark.parametrize("changes,config", [
    (dict(attention="eager", precision="bf16-pure"), DEEPSEEK_V3),
    # one sample: eager attention's p @ v reads v as a view of kv_b_proj's output
    (dict(attention="eager", precision="bf16-pure", batch_size=1), DEEPSEEK_V3),
    # q/k and v heads of one size: the CPU runs sdpa's flash kernel, as CUDA would
    (dict(attention="sdpa", precision="bf16-pure"), dict(DEEPSEEK_V3, v_head_dim=24)),
    (dict(attention="eager", peft={"rank": 4, "target_modules": [
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}), DEEPSEEK_V3),
    (dict(attention="sdpa", peft={"rank": 4, "target_modules": ["kv_b_proj", "o_proj"]}),
     dict(DEEPSEEK_V3, v_head_dim=24)),
], ids=["eager-bf16", "eager-bf16-one-sample", "sdpa-bf16", "eager-lora", "sdpa-lora"])
@needs_torch
def test_each_block_saves_what_the_trace_saves(changes, config):
    job = Job.model_validate(dict(dict(model="x", batch_size=B, seq_len=S), **changes))
    dense, moe = _formula_blocks(job, config)
    traced = _traced_blocks(job, config)
    if job.peft is not None:
        # under autocast the trace also keeps 16-bit copies of the fp32 adapters (A and B:
        # rank x (in + out)) and of the router's weight (fp32 in transformers,
        # _keep_in_fp32_modules_strict), weight-sized; the formula leaves them out
        arch = architecture_from_config(config, "tiny")
        copies = 2 * sum(job.peft.rank * (ln.in_features + ln.out_features)
                         for ln in arch.stacks[1].linears if ln.name in job.peft.target_modules)
        copies += 2 * 8 * config["hidden_size"]
        traced = {i: n - copies for i, n in traced.items()}
    # layer 0 (dense) sees embeddings without grad under PEFT: compare it in full fine-tuning
    if job.peft is None:
        assert dense == pytest.approx(traced[0], rel=BLOCK_TOLERANCE)
    assert moe == pytest.approx(traced[1], rel=BLOCK_TOLERANCE)
    assert moe == pytest.approx(traced[2], rel=BLOCK_TOLERANCE)


# A wider tiny DeepSeek-V3 (h 256, 3 blocks: 1 dense, 2 MoE), so that the trace's 512-byte
# rounding of small tensors stays below 0.1%
WIDER = dict(DEEPSEEK_V3, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
             q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32, vocab_size=512, max_position_embeddings=2048)


@pytest.mark.parametrize("changes,config", [
    (dict(attention="eager"), WIDER),
    (dict(attention="sdpa"), dict(WIDER, v_head_dim=48)),
    (dict(attention="sdpa", precision="bf16-pure"), dict(WIDER, v_head_dim=48)),
], ids=["eager", "sdpa", "sdpa-bf16-pure"])
@needs_torch
def test_peak_follows_the_trace_in_full_fine_tuning(tmp_path, changes, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    job = Job.model_validate(dict(model=str(path), batch_size=2, seq_len=256,
                                  runtime={"cublas_workspaces": 0}, **changes))
    from vramplan.engines.trace import trace

    predicted, traced = formula.estimate(job), trace(job)
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=0.01)


def test_stacked_experts_are_one_grouped_matmul_for_the_performance_model():
    """transformers 5 runs DeepSeek's routed experts as two grouped matmuls, not a module
    per expert: a MoE block calls q_a, q_b, kv_a, kv_b, o, the router, the experts' three
    projections (one call each), the shared expert's three linears (12), two norms, the
    block, its attention and MLP containers and the activation (+1 +3): 18 modules."""
    from vramplan.planning.traffic import block_modules

    arch = load_architecture("deepseek-v3")
    job = Job(model="deepseek-v3", batch_size=1, seq_len=1024)
    assert block_modules(job, arch, arch.stacks[1]) == 18


def test_compiled_deepseek_is_left_to_the_trace():
    job = Job(model="deepseek-v2-lite", batch_size=1, seq_len=512, compile=True)
    with pytest.raises(JobError, match="multi-head latent attention.*--engine trace"):
        formula.estimate(job)
