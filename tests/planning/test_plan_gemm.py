"""The GEMM shape model (planning/gemm.py) and the per-architecture factors it scales."""

import math
from pathlib import Path

import pytest

from vramplan.hardware import get_gpu
from vramplan.job import Job, Parallel, Peft
from vramplan.models import load_architecture
from vramplan.planning import gemm, performance
from vramplan.planning.efficiency import (
    factors_for,
    fp8_ratio,
    fp32_ratio,
    gemm_model,
    shipped_factors,
    sm_count,
)
from vramplan.planning.performance import predict

MODEL = gemm.GemmModel(k0=256.0, overhead_us=0.0)


def test_one_full_wave_runs_at_the_reference_rate_scaled_by_the_reduction_ramp():
    # 132 tiles of 128 x 256 fill 132 SMs exactly once
    m, n, k = 128 * 132, 256, 4096
    ramp = (k / (k + 256)) / (gemm.REFERENCE[2] / (gemm.REFERENCE[2] + 256))
    assert ramp == pytest.approx(1.0)
    t = gemm.gemm_seconds(m, n, k, 1e12, MODEL, 132)
    assert t == pytest.approx(2 * m * n * k / 1e12)


def test_a_partly_filled_wave_costs_a_whole_one():
    # 133 tiles of 128 x 256 on 132 SMs: two waves for 133 tiles (133 / 264 filled); 128 x 128
    # tiles give 266 tiles in three waves at 0.9 of the rate: 0.9 * 266 / 396, the better one
    # (K of one 128-deep chain: too short to split)
    m, n, k = 128 * 133, 256, gemm.SPLIT_MIN_K
    ramp = (k / (k + 256)) / (gemm.REFERENCE[2] / (gemm.REFERENCE[2] + 256))
    t = gemm.gemm_seconds(m, n, k, 1e12, MODEL, 132)
    assert 0.9 * 266 / 396 > 133 / 264
    assert t == pytest.approx(2 * m * n * k / 1e12 / (0.9 * 266 / 396 * ramp))


def test_few_tiles_with_a_long_reduction_split_k():
    # 256 x 512 x 4096: 8 tiles of 128 x 128 fill 8 of 132 SMs. Split into 16 parts of 256:
    # 128 tiles at 0.9 of the rate, each part's ramp 256 / (256 + k0), and one more launch
    # adds the parts (12 parts: 0.9 * 96 / 132 x 341 / 597; 8: 0.9 * 64 / 132 x 512 / 768)
    model = gemm.GemmModel(k0=256.0, overhead_us=3.0)
    m, n, k = 256, 512, 4096
    ref = gemm.REFERENCE[2] / (gemm.REFERENCE[2] + 256)
    split = 0.9 * 128 / 132 * (256 / 512) / ref
    assert split > 0.9 * 96 / 132 * (k / 12) / (k / 12 + 256) / ref
    assert split > 0.9 * 64 / 132 * (512 / 768) / ref > 0.9 * 8 / 132
    t = gemm.gemm_seconds(m, n, k, 1e12, model, 132)
    assert t == pytest.approx(2 * m * n * k / (1e12 * split) + 2 * 3e-6)


def test_short_reductions_and_the_fixed_cost_per_gemm():
    model = gemm.GemmModel(k0=256.0, overhead_us=3.0)
    m, n, k = 128 * 132, 256, 256
    ref = gemm.REFERENCE[2] / (gemm.REFERENCE[2] + 256)
    expected = 2 * m * n * k / (1e12 * (256 / 512) / ref) + 3e-6
    assert gemm.gemm_seconds(m, n, k, 1e12, model, 132) == pytest.approx(expected)
    assert gemm.gemm_seconds(0, n, k, 1e12, model, 132) == 0.0


def test_k0_grows_with_the_peak_per_sm_over_the_reference_gpus_bf16():
    # the same fixed time per tile is twice the steps of K on an SM twice as fast: the B200's
    # bf16 (2250 TFLOP/s over 148 SMs) against the H100's (989.4 over 132)
    base = gemm_model()
    h100, b200 = get_gpu("H100-SXM"), get_gpu("B200")
    per_sm = {g.name: g.tflops["bf16"] * 1e12 / sm_count(g) for g in (h100, b200)}
    assert gemm_model(per_sm["H100-SXM"]).k0 == pytest.approx(base.k0)
    assert gemm_model(per_sm["B200"]).k0 == pytest.approx(
        base.k0 * (b200.tflops["bf16"] / 148) / (h100.tflops["bf16"] / 132))
    fp8 = gemm_model(b200.tflops["fp8"] * 1e12 / 148)
    assert fp8.k0 == pytest.approx(2 * gemm_model(per_sm["B200"]).k0)
    assert gemm_model(per_sm["B200"]).overhead_us == base.overhead_us
    a100 = get_gpu("A100-80GB")  # 312 TFLOP/s over 108 SMs: slower SMs keep the H100's k0
    assert gemm_model(a100.tflops["bf16"] * 1e12 / sm_count(a100)).k0 == base.k0


def test_batch_one_lora_on_a_4090_and_tp8_on_405b_do_not_share_a_factor():
    model, rtx, h100 = gemm_model(), get_gpu("RTX-4090"), get_gpu("H100-SXM")
    lora = Job(model="llama-3.2-1b", batch_size=1, seq_len=512, peft={"method": "lora"})
    tp8 = Job(model="llama-3.1-405b", batch_size=1, seq_len=8192,
              parallel={"num_gpus": 8, "tensor_parallel": 8})
    small = gemm.shape_efficiency(lora, load_architecture(lora.model), model,
                                  sm_count(rtx), 165e12)
    large = gemm.shape_efficiency(tp8, load_architecture(tp8.model), model,
                                  sm_count(h100), 800e12)
    assert 0 < small < 0.8 < large <= 1.0


def test_tensor_parallelism_splits_column_and_row_parallel_layers():
    job = Job(model="llama-3.2-1b", seq_len=1024, parallel={"num_gpus": 2, "tensor_parallel": 2})
    arch = load_architecture(job.model)
    by_dims = {(n, k) for _, n, k, _ in gemm.shapes(job, arch)}
    h = arch.stacks[0].hidden_size
    ffn = arch.stacks[0].intermediate_size
    assert (ffn // 2, h) in by_dims      # up / gate: N split
    assert (h, ffn // 2) in by_dims      # down: K split


def test_measured_and_borrowed_ceilings_are_said():
    hopper = factors_for(get_gpu("H100-SXM"), calibrated=False)
    ada = factors_for(get_gpu("L40"), calibrated=False)
    assert "measured" in hopper.source
    assert "Ampere's borrowed" in ada.source
    ampere = shipped_factors("ampere")
    assert ada.matmul == ampere.matmul
    assert fp8_ratio(get_gpu("H100-SXM")) == pytest.approx(0.734 / 0.801)
    assert fp8_ratio(get_gpu("A100-80GB")) == 1.0


def _toml() -> dict:
    import tomllib

    return tomllib.loads((Path(gemm.__file__).parent / "efficiency.toml").read_text())


def test_a_gpu_with_its_own_measured_ceiling_uses_it_for_matmuls_and_attention():
    """The L4 (72 W) reaches far less of its datasheet peak than the A100 its architecture
    would borrow from; its own ceiling sets the matmul rate and scales the attention rate."""
    data = _toml()
    shares, ampere = data["training"], data["architectures"]["ampere"]
    l4 = factors_for(get_gpu("L4"), calibrated=False)
    ceiling = data["gpu_ceilings"]["L4"]
    assert l4.matmul == pytest.approx(ceiling * shares["matmul_share"])
    assert l4.attention == pytest.approx(
        ampere["flash"] * ceiling / ampere["mamf"] * shares["attention_share"])
    assert l4.source.startswith("L4: its own measured matmul ceiling")
    assert "Ampere's, scaled by that ceiling" in l4.source
    assert l4.matmul < shipped_factors("ada").matmul  # the borrowed A100 figure is higher


def test_a_gpu_measured_through_its_sibling_takes_its_ratio_and_says_whose():
    """The RTX 6000 Ada is the L40S's chip at the same peak: the L40S's measured ratio, not
    the A100 its architecture would borrow, and the report names the L40S."""
    data = _toml()
    siblings = {g: s for g, s in data["gpu_ceilings"].items() if isinstance(s, str)}
    assert siblings and all(isinstance(data["gpu_ceilings"][s], float)
                            for s in siblings.values())  # a sibling is measured itself
    assert set(data["gpu_ceilings"]) == set(data["gpu_ceilings"]["sources"]) | {"sources"}
    ada, l40s = (factors_for(get_gpu(g), calibrated=False) for g in ("RTX-6000-Ada", "L40S"))
    ratio = data["gpu_ceilings"]["L40S"]
    assert ada.matmul == l40s.matmul == pytest.approx(ratio * data["training"]["matmul_share"])
    assert ada.source.startswith("RTX-6000-Ada: the L40S's measured matmul ceiling")
    assert ada.matmul < shipped_factors("ada").matmul


def test_a_geforce_card_may_pass_its_datasheet_peak():
    """GeForce cards boost past the datasheet clock: the RTX 3090 measures 1.08x its peak,
    and a single-GPU job (matmul share 1) keeps that, not a cap at 1."""
    data = _toml()
    one = factors_for(get_gpu("RTX-3090"), calibrated=False, num_gpus=1)
    share = data["training_single_gpu"]["matmul_share"]
    assert one.matmul == pytest.approx(min(max(1.0, data["gpu_ceilings"]["RTX-3090"]),
                                           data["gpu_ceilings"]["RTX-3090"] * share))
    assert one.matmul > 1.0


def test_fp32_matmuls_take_the_cuda_cores_measured_share_not_the_tensor_cores():
    """torch.mm in fp32 (TF32 off) reaches 91% of a V100's fp32 peak but 66% of an RTX 4090's,
    whose datasheet counts two fp32 operations per core and clock; the matmul factor stands
    for the tensor cores' share (77% and 101%). An fp32 job's matmul and attention terms are
    divided by the ratio of the two; a GPU with no fp32 measurement keeps the factor."""
    data = _toml()
    fp32, ceilings = data["gpu_fp32_ceilings"], data["gpu_ceilings"]
    assert set(fp32) == set(fp32["sources"]) | {"sources"}
    assert all(isinstance(fp32[s], float) for s in fp32.values() if isinstance(s, str))
    v100, r4090 = get_gpu("V100-16GB"), get_gpu("RTX-4090")
    assert fp32_ratio(v100)[0] == pytest.approx(0.910 / 0.769)
    assert fp32_ratio(r4090)[0] == pytest.approx(fp32["RTX-4090"] / ceilings["RTX-4090"])
    sibling, note = fp32_ratio(get_gpu("RTX-6000-Ada"))
    assert sibling == pytest.approx(fp32["L40S"] / ceilings["L40S"]) and "L40S" in note
    flagship, note = fp32_ratio(get_gpu("GH200"))  # not measured: Hopper's flagship
    assert flagship == pytest.approx(data["architectures"]["hopper"]["mamf_fp32"]
                                     / ceilings["GH200"]) and "not measured" in note
    assert fp32_ratio(get_gpu("MI300X"))[0] == 1.0
    job = Job(model="gpt2", precision="fp32", batch_size=4, seq_len=512)
    for gpu in (v100, r4090):
        ratio, note = fp32_ratio(gpu)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(performance, "fp32_ratio", lambda g: (1.0, ""))
            before = performance.step_terms(job, gpu)
        after = performance.step_terms(job, gpu)
        assert any(note in n and "CUDA cores" in n for n in after.notes)
        for b, a in zip(before.phases, after.phases):
            assert a.matmul_s == pytest.approx(b.matmul_s / ratio)
            assert a.attention_s == pytest.approx(b.attention_s / ratio)
    bf16 = Job(model="gpt2", precision="bf16-mixed", batch_size=4, seq_len=512)
    assert not any("CUDA cores" in n for n in performance.step_terms(bf16, r4090).notes)


@pytest.mark.parametrize("num_gpus", [1, 8])
def test_every_time_carries_its_80_percent_interval(num_gpus):
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024,
              parallel={"num_gpus": num_gpus, "strategy": "ddp" if num_gpus > 1 else "none"})
    low, high = performance.job_interval(job)
    assert low < 1 < high
    perf = predict(job, get_gpu("H200"))
    lo, hi = perf.step_time_range_s
    assert lo == pytest.approx(perf.step_time_s * low)
    assert hi == pytest.approx(perf.step_time_s * high)
    assert math.isfinite(lo) and lo < perf.step_time_s < hi


def _shipped(bucket: str) -> tuple[float, float]:
    import tomllib

    from vramplan.planning import efficiency
    table = tomllib.loads((Path(efficiency.__file__).parent / "efficiency.toml").read_text())
    iv = table["interval"]
    return math.exp(iv[f"{bucket}_log_low"]), math.exp(iv[f"{bucket}_log_high"])


def test_each_kind_of_job_gets_its_own_interval():
    """The single-GPU runs, and on several GPUs the encoders' and adapters' runs, miss by more
    than the pre-training runs the multi-GPU shares were fitted on: each kind carries its own
    interval, read from the table (the benchmark writes the three pairs)."""
    ddp = {"num_gpus": 8, "strategy": "ddp"}
    decoder = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024, parallel=ddp)
    lora = decoder.with_changes(peft={"method": "lora"})
    encoder = Job(model="bert-base-uncased", batch_size=8, seq_len=384, parallel=ddp)
    single = decoder.with_changes(parallel={"num_gpus": 1})
    assert performance.job_interval(single) == pytest.approx(_shipped("single_gpu"))
    assert performance.job_interval(decoder) == pytest.approx(_shipped("multi_gpu"))
    assert performance.job_interval(lora) == pytest.approx(_shipped("multi_gpu_other"))
    assert performance.job_interval(encoder) == pytest.approx(_shipped("multi_gpu_other"))
    assert len({_shipped(b) for b in ("single_gpu", "multi_gpu", "multi_gpu_other")}) == 3
    # the range a prediction shows is its kind's
    perf = predict(lora, get_gpu("H200"))
    low, high = _shipped("multi_gpu_other")
    assert perf.step_time_range_s == pytest.approx((perf.step_time_s * low,
                                                    perf.step_time_s * high))


def test_each_stack_multiplies_its_own_tokens():
    """A ViT's GEMMs run over its patches and the class token, a T5 decoder's and the head's
    over the target, not over a default sequence length."""
    vit = Job(model="vit-base-patch16-224", batch_size=2)
    arch = load_architecture(vit.model)
    patches = (224 // 16) ** 2 + 1
    assert {m for m, _, _, _ in gemm.shapes(vit, arch)} == {2 * patches}
    t5 = Job(model="t5-small", batch_size=3, seq_len=512, target_len=64)
    arch = load_architecture(t5.model)
    encoder, decoder = (len(s.linears) for s in arch.stacks)
    ms = [m for m, _, _, _ in gemm.shapes(t5, arch)]
    assert ms == [3 * 512] * encoder + [3 * 64] * decoder + [3 * 64]  # + the head



def test_each_expert_reached_runs_a_gemm_over_its_share_of_the_tokens():
    """Mixtral (8 experts, top 2), 3 x 16 tokens: 96 assignments reach
    8 x (1 - (7/8)^96) experts, each GEMM over 96 / that many tokens."""
    job = Job(model="mixtral-8x7b", batch_size=3, seq_len=16)
    arch = load_architecture(job.model)
    reached = 8 * (1 - (7 / 8) ** 96)
    assert gemm.experts_reached(96, 8) == pytest.approx(reached)
    assert gemm.experts_reached(1, 256) == pytest.approx(1.0)
    stack = arch.stacks[0]
    experts = [(m, copies) for (m, _, _, copies), ln in zip(gemm.shapes(job, arch),
                                                             stack.linears) if ln.count > 1]
    assert experts and all(m == pytest.approx(96 / reached) for m, _ in experts)
    assert all(c == pytest.approx(stack.num_layers * reached) for _, c in experts)


def test_more_tokens_never_time_an_moe_step_faster():
    """DeepSeek-V3 on one A6000: 48 tokens gave each of its 256 experts floor(48 x 8 / 256)
    = 1 token, 96 tokens 3, so the shape model timed the smaller step slower (120.3 s
    against 119.6 s)."""
    gpu = get_gpu("RTX-A6000")
    times = [predict(Job(model="deepseek-v3", batch_size=3, seq_len=s), gpu).step_time_s
             for s in (16, 32, 64, 128)]
    assert times == sorted(times)

def test_single_gpu_jobs_take_their_own_shares_everywhere():
    """One GPU: [training_single_gpu]'s shares (fitted on single-GPU runs); several: [training]'s.
    The planner times a candidate with the same factors as predict()."""
    import tomllib

    from vramplan.planning import efficiency
    from vramplan.planning.efficiency import factors_for
    from vramplan.planning.planner import plan
    table = tomllib.loads((Path(efficiency.__file__).parent / "efficiency.toml").read_text())
    gpu = get_gpu("H100-SXM")
    one, several = factors_for(gpu, num_gpus=1), factors_for(gpu, num_gpus=8)
    assert one.memory == table["training_single_gpu"]["memory"]
    assert several.memory == table["training"]["memory"]
    # the host time is the host machine's: one for every GPU count
    assert one.kernel_us == several.kernel_us == table["training"]["kernel_us"]
    assert one.module_us == several.module_us == table["training"]["module_us"]
    assert "single-GPU shares" in one.source and "single-GPU" not in several.source
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024)
    perf = predict(job, gpu)
    assert perf.factors == one.source
    result = plan(job, gpus=["H100-SXM"], tokens=10**8, max_gpus=1)
    single = [c for c in result.candidates if c.num_gpus == 1]
    assert single
    for c in single:
        assert c.step_time_s == pytest.approx(predict(c.job, gpu).step_time_s)


def test_adapters_or_an_encoder_on_several_gpus_take_the_single_gpu_shares():
    """The multi-GPU shares are pre-training's (a decoder's own weights); a LoRA job or an
    encoder on several GPUs runs at one GPU's rates, in predict() and in the planner alike."""
    import tomllib

    from vramplan.planning import efficiency
    from vramplan.planning.efficiency import factors_for
    from vramplan.planning.planner import plan
    table = tomllib.loads((Path(efficiency.__file__).parent / "efficiency.toml").read_text())
    gpu = get_gpu("RTX-4090")
    single_memory = table["training_single_gpu"]["memory"]
    assert factors_for(gpu, num_gpus=2, adapters=True).memory == single_memory
    assert factors_for(gpu, num_gpus=2, decoder=False).memory == single_memory
    assert factors_for(gpu, num_gpus=2).memory == table["training"]["memory"]
    two = Parallel(strategy="ddp", num_gpus=2)
    lora = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024, parallel=two,
               peft=Peft(method="lora", rank=8))
    assert "single-GPU shares" in predict(lora, gpu).factors
    assert "single-GPU shares" not in predict(lora.with_changes(peft=None), gpu).factors
    bert = Job(model="bert-base-uncased", batch_size=8, seq_len=256, parallel=two)
    assert "single-GPU shares" in predict(bert, gpu).factors
    result = plan(lora, gpus=["RTX-4090"], tokens=10**7, max_gpus=2)
    several = [c for c in result.candidates if c.num_gpus == 2]
    assert several
    for c in several:
        assert c.step_time_s == pytest.approx(predict(c.job, gpu).step_time_s)
