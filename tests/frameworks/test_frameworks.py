"""Framework profiles and the behaviours they switch on, in the formula (docs/frameworks.md).

Expected values are derived in each test from the model's shapes, with the arithmetic in a
comment; the model is Llama-3.2-1B (16 layers, hidden 2048, 32 heads of 64, 8 KV heads,
MLP 8192, vocab 128256, tied embeddings) unless a test says otherwise.
"""

import json
from typing import get_args

import pytest

from vramplan import Job, JobError, Offload, Peft, estimate
from vramplan.engines import activations as act
from vramplan.engines import optimizer_states as opt_states
from vramplan.engines import pipeline
from vramplan.engines import step as step_desc
from vramplan.engines.formula import loss, saved
from vramplan.engines.precision import dtypes_for
from vramplan.engines.runtime import runtime_context_bytes
from vramplan.frameworks import framework_names, get_profile, load_profiles
from vramplan.hardware import get_gpu
from vramplan.job import Framework, Runtime, job_from_dict
from vramplan.models import load_architecture
from vramplan.units import MiB

MODEL = "llama-3.2-1b"
ARCH = load_architecture(MODEL)
H, LAYERS, VOCAB = 2048, 16, 128256


# --- profiles ------------------------------------------------------------------------------


def test_profiles_match_the_job_literal_and_each_setting_has_a_source():
    assert set(framework_names()) == set(get_args(Framework))
    for profile in load_profiles().values():
        for dotted, setting in profile.settings.items():
            assert setting.source, (profile.name, dotted)
        for dotted, allowed in profile.allowed.items():
            assert allowed.source and allowed.values, (profile.name, dotted)


@pytest.mark.parametrize("name", sorted(get_args(Framework)))
def test_every_profile_builds_a_valid_job(name):
    job = Job(model=MODEL, framework=name, peft=Peft())
    for dotted, setting in get_profile(name).settings.items():
        if dotted.startswith("fp8."):
            continue  # fp8 jobs only: tests/engines/test_float8_recipes.py
        part = job
        for key in dotted.split("."):
            part = getattr(part, key)
        assert part == setting.value, dotted


def test_profile_fills_only_what_the_job_leaves_unset():
    job = Job(model=MODEL, framework="torchtune", precision="bf16-mixed", peft=Peft(rank=8))
    assert job.precision == "bf16-mixed"            # explicit: kept
    assert job.checkpointing == "full"              # torchtune configs
    assert job.loss == "chunked:torchtune-linear"
    assert job.peft.adapter_dtype == "model" and job.peft.rank == 8
    explicit = Job(model=MODEL, framework="torchtune", peft=Peft(adapter_dtype="fp32"))
    assert explicit.peft.adapter_dtype == "fp32"
    from_file = job_from_dict({"model": MODEL, "framework": "torchtitan",
                               "parallel": {"strategy": "fsdp", "num_gpus": 8}})
    assert from_file.parallel.shard_over_context_parallel and from_file.parallel.num_gpus == 8
    assert from_file.keep_grads_between_steps and from_file.optimizer_impl == "fused"
    assert Job(model=MODEL).framework == "plain" and not Job().keep_grads_between_steps


@pytest.mark.parametrize("data, message", [
    ({"framework": "torchtitan", "peft": {"method": "qlora"}},
     "torchtitan does not support peft.method='qlora'"),
    ({"framework": "torchtune", "parallel": {"strategy": "zero3", "num_gpus": 2}},
     "torchtune does not support parallel.strategy='zero3'"),
    ({"framework": "torchtune", "activation_offload": True, "checkpointing": "none"},
     "torchtune offloads activations only with activation checkpointing"),
    ({"framework": "torchtitan", "optimizer": "adamw-8bit"},
     "torchtitan does not support optimizer='adamw-8bit'"),
    ({"framework": "hf-trainer", "loss": "chunked:torchtune-linear"},
     "loss chunked:torchtune-linear is torchtune's"),
    ({"framework": "pytorch"}, "framework: must be one of"),
])
def test_bad_combinations_are_one_clear_line(data, message):
    with pytest.raises(JobError, match=message) as error:
        job_from_dict({"model": MODEL, **data})
    assert "\n" not in str(error.value)


def test_compile_with_eager_attention_is_sent_to_the_trace():
    with pytest.raises(JobError, match="eager attention: use --engine trace"):
        estimate(Job(model=MODEL, compile=True, attention="eager"))


# --- gradients kept between steps ------------------------------------------------------------


def test_keep_grads_between_steps_adds_the_gradients_to_the_forward():
    base = dict(model=MODEL, seq_len=256, precision="bf16-mixed")
    kept = estimate(Job(**base, keep_grads_between_steps=True))
    dropped = estimate(Job(**base))
    # fp32 gradients of all 1,235,814,400 parameters are alive from the previous step
    assert kept.phase_peaks["forward"] - dropped.phase_peaks["forward"] == ARCH.total_params() * 4


# --- named selective checkpointing -----------------------------------------------------------


def test_torchtitan_op_policy_recomputes_every_second_matmul():
    dt = dtypes_for(Job(precision="bf16-mixed"))
    kept = act.block_op_sac_outputs(ARCH.stacks[0], act.BlockShape(1, 8), dt,
                                    attention="sdpa", adapters=act.Adapters())
    names = [name for name, _ in kept]
    # mm order q, k, v, o, gate, up, down: counts 1..7, the even ones (k, o, up) recomputed
    assert names == ["block input", "q_proj out", "v_proj out", "gate_proj out",
                     "down_proj out", "self sdpa out+lse"]
    n = 1 * 8  # tokens
    expected = (4 * n * H                       # fp32 residual stream input
                + 2 * n * (2048 + 512 + 8192 + 2048)  # bf16 q, v, gate, down outputs
                + 2 * n * 2048 + 4 * 32 * n)    # sdpa output + fp32 logsumexp (32 heads)
    assert sum(b for _, b in kept) == expected


def test_torchtitan_op_policy_with_bias_and_lora_counts_only_plain_mms():
    gpt2 = load_architecture("gpt2")
    dt = dtypes_for(Job(precision="bf16-mixed"))
    kept = act.block_op_sac_outputs(gpt2.stacks[0], act.BlockShape(1, 4), dt, attention="sdpa",
                                    adapters=act.Adapters(frozenset({"c_attn"}), 8, 0.0, False))
    # GPT-2's linears have biases (aten.addmm: always saved, not counted); LoRA's A and B
    # are the block's only mms: A is the 1st (kept), B the 2nd (recomputed)
    assert [n for n, _ in kept] == ["block input", "c_attn out", "c_attn lora_A out",
                                    "c_proj out", "c_fc out", "c_proj out", "self sdpa out+lse"]


def _stack_activations(**fields):
    job = Job(model=MODEL, seq_len=128, precision="bf16-mixed", **fields)
    shapes = step_desc.shapes_of(job, ARCH, "causal-lm")
    return saved.stack_activations(job, ARCH, shapes, step_desc.activation_dtypes(job))[0]


def test_selective_policies_against_each_other():
    none, full = _stack_activations(), _stack_activations(checkpointing="full")
    # every second block (8 of 16) fully checkpointed, the others keep everything
    assert _stack_activations(checkpointing="selective:every-2nd-layer") == (none + full) / 2
    # torchtitan's op policy keeps the same as "selective" minus k, o and up outputs
    n = 1 * 128
    dropped = 2 * n * (512 + 2048 + 8192)
    assert (_stack_activations(checkpointing="selective")
            - _stack_activations(checkpointing="selective:torchtitan-op")) == LAYERS * dropped


def test_cast_copies_stay_until_the_end_of_the_forward_under_checkpointing():
    base = dict(model=MODEL, seq_len=128, precision="bf16-mixed")
    none = estimate(Job(**base))
    full = estimate(Job(**base, checkpointing="full"))
    # the forward phases differ by the saved activations only: autocast's 16-bit weight
    # copies are cached until the forward ends, checkpointed or not
    assert (none.phase_peaks["forward"] - full.phase_peaks["forward"]
            == _stack_activations() - _stack_activations(checkpointing="full"))


# --- LoRA adapter dtype ----------------------------------------------------------------------


def test_adapter_dtype_fp32_versus_model_dtype():
    lora = Peft(rank=16, target_modules=("q_proj", "v_proj"))
    fp32 = estimate(Job(model=MODEL, seq_len=64, peft=lora.model_copy(update={
        "adapter_dtype": "fp32"})))
    bf16 = estimate(Job(model=MODEL, seq_len=64, peft=lora.model_copy(update={
        "adapter_dtype": "model"})))
    # q: A 16x2048 + B 2048x16, v: A 16x2048 + B 512x16, per layer x 16 layers
    adapters = LAYERS * 16 * ((2048 + 2048) + (2048 + 512))
    assert fp32.params_trainable == adapters == 1_703_936
    assert fp32.categories["weights"] - bf16.categories["weights"] == adapters * 2
    assert fp32.categories["optimizer_states"] - bf16.categories["optimizer_states"] == (
        2 * adapters * 2)  # AdamW's two states follow the adapters' dtype


# --- low-bit and paged optimizer states ------------------------------------------------------


def test_torchao_block_layouts():
    # 4-bit, 8192 elements: two states of 4096 code bytes + 64 fp32 scales + 16 fp32 qmap
    assert opt_states.state_bytes("adamw-4bit", 8192, 2) == (2 * (4096 + 64 * 4 + 64), 0)
    # fp8, 8192 elements: two states of 8192 float8 codes + 32 fp32 scales
    assert opt_states.state_bytes("adamw-fp8", 8192, 2) == (2 * (8192 + 32 * 4), 0)
    # under 4096 elements, or not a multiple of the block: plain states in the param dtype
    assert opt_states.state_bytes("adamw-4bit", 2048, 2) == (2 * 2048 * 2, 0)
    assert opt_states.state_bytes("adamw-4bit", 4160, 4) == (2 * 4160 * 4, 0)


def test_paged_states_are_outside_the_allocator():
    # 100,000+ elements: paged; smaller: ordinary torch tensors
    assert opt_states.state_bytes("paged-adamw", 100_000, 2) == (0, 8 * 100_000)
    assert opt_states.state_bytes("paged-adamw", 99_999, 2) == (8 * 99_999, 0)
    # 8-bit: uint8 codes paged, fp32 absmax per 256 in torch; under 4096: fp32, not paged
    assert opt_states.state_bytes("paged-adamw-8bit", 262_144, 2) == (2 * 4 * 1024, 2 * 262_144)
    assert opt_states.state_bytes("paged-adamw-8bit", 2048, 2) == (8 * 2048, 0)


def test_paged_adamw_full_finetune_reports_unified_memory():
    job = Job(model=MODEL, seq_len=64, precision="bf16-pure", optimizer="paged-adamw")
    report = estimate(job)
    # every block linear and the embedding have >= 1e5 elements: their fp32 states are
    # paged; the norms (2048 elements: 2 per layer + the final one) stay in torch
    linears = LAYERS * (2048 * 2048 * 2 + 2048 * 512 * 2 + 2048 * 8192 * 3)
    paged = 8 * (linears + VOCAB * H)
    norms = 8 * 2048 * (2 * LAYERS + 1)
    assert report.unified_memory_bytes == paged
    assert report.categories["optimizer_states"] == norms
    assert paged + norms == 8 * ARCH.total_params()
    assert any("unified memory" in note for note in report.notes)


def test_qlora_paged_8bit_adapters_are_too_small_to_page():
    # rank-16 adapters on 2048-wide linears: A and B have 32,768 (or 8,192) elements < 1e5
    job = Job(model=MODEL, seq_len=64, peft=Peft(method="qlora"), optimizer="paged-adamw-8bit")
    assert estimate(job).unified_memory_bytes == 0


def test_adamw_4bit_lora_state_bytes():
    lora = Peft(rank=16, target_modules=("q_proj",), adapter_dtype="fp32")
    report = estimate(Job(model=MODEL, seq_len=64, peft=lora, optimizer="adamw-4bit"))
    # per layer A and B each 16 x 2048 = 32,768 elements: quantised (>= 4096, % 128 == 0)
    per_tensor = 2 * (32768 / 2 + 32768 / 128 * 4 + 64)
    assert report.categories["optimizer_states"] == LAYERS * 2 * per_tensor


# --- optimizer step temporaries ----------------------------------------------------------


def test_optimizer_in_backward_has_no_all_parameter_buffer():
    base = dict(model=MODEL, seq_len=64, precision="bf16-pure", optimizer_in_backward=True)
    foreach = estimate(Job(**base, optimizer_impl="foreach"))
    fused = estimate(Job(**base, optimizer_impl="fused"))
    # foreach steps one parameter at a time: its sqrt(exp_avg_sq) temporary is the largest
    # parameter's, the 128256 x 2048 bf16 embedding
    assert (foreach.phase_peaks["optimizer"] - fused.phase_peaks["optimizer"]
            == VOCAB * H * 2)


def test_cpu_offloaded_optimizer_step_has_no_gpu_temporaries():
    base = dict(model=MODEL, seq_len=64, offload=Offload(optimizer=True))
    foreach = estimate(Job(**base, optimizer_impl="foreach"))
    fused = estimate(Job(**base, optimizer_impl="fused"))
    assert foreach.phase_peaks["optimizer"] == fused.phase_peaks["optimizer"]


# --- torchtune: loss and activation offloading ---------------------------------------------


def test_torchtune_linear_cross_entropy_buffers():
    job = Job(model=MODEL, seq_len=64, framework="torchtune", checkpointing="none")
    dt = step_desc.activation_dtypes(job)
    forward, backward = loss.loss_buffers(job, ARCH, step_desc.shapes_of(job, ARCH,
                                                                         "causal-lm"),
                                              dt, "causal-lm")
    t, tc = 64, 8
    # every chunk's fp32 log_softmax, plus the last chunk's bf16 logits and fp32 copy
    assert forward == 4 * t * VOCAB + (2 + 4) * tc * VOCAB
    # the larger of: the first chunk's fp32 nll and log_softmax grads beside all saved
    # log_softmax outputs; or, at the second chunk, 6 chunks' outputs and three bf16
    # head-sized gradients (running sum, the chunk's, their sum)
    first = 4 * t * VOCAB + 8 * tc * VOCAB
    second = 4 * 6 * tc * VOCAB + 3 * VOCAB * H * 2
    assert backward == max(first, second) == second


def test_torchtune_offload_leaves_no_block_input_with_full_checkpointing():
    base = dict(model=MODEL, seq_len=128, framework="torchtune")
    job = Job(**base, activation_offload=True)
    dt = step_desc.activation_dtypes(job)
    shapes = step_desc.shapes_of(job, ARCH, "causal-lm")
    on_gpu = saved.offloaded_activations(job, ARCH, shapes, dt, "causal-lm",
                                            pipeline.WHOLE,
                                            _stack_activations(checkpointing="full"))
    outside = saved.outside_block_activations(job, ARCH, shapes, dt, "causal-lm")
    # the forward stash keeps the last 5 packed tensors: the final RMSNorm packs 6, so no
    # block input is among them (tests/engines/test_offload_trace.py checks this on the trace)
    assert on_gpu == outside
    # without offloading all 16 block inputs stay (bf16-pure: 2 x 128 x 2048 bytes each)
    assert (estimate(Job(**base)).phase_peaks["forward"] - estimate(job).phase_peaks["forward"]
            == 16 * 2 * 128 * H)


# --- torchtitan meshes -------------------------------------------------------------------------


def test_torchtitan_shards_over_data_and_context_parallel_ranks():
    parallel = {"strategy": "fsdp", "num_gpus": 8, "context_parallel": 8}
    titan = job_from_dict({"model": MODEL, "framework": "torchtitan", "parallel": parallel})
    plain = job_from_dict({"model": MODEL, "parallel": parallel})
    assert titan.parallel.shard_degree == 8 and plain.parallel.shard_degree == 1
    # fp32 AdamW states (8 bytes per parameter) over 8 ranks
    assert estimate(titan).categories["optimizer_states"] == ARCH.total_params() * 8 // 8


# --- the GPU: runtime context and precision --------------------------------------------------


def test_runtime_context_per_gpu():
    job = Job(model=MODEL, seq_len=64)
    l4, h200 = get_gpu("L4"), get_gpu("H200")
    assert estimate(job.with_changes(gpu="H200")).categories["runtime_context"] == 1390 * MiB
    # the driver's share of the L4's memory (644,939,776 of 150,754,820,096 bytes) + the
    # H200's context and kernels (1390 MiB - 644,939,776 bytes)
    expected = int(644_939_776 * l4.usable_bytes / 150_754_820_096) + (1390 * MiB - 644_939_776)
    assert estimate(job.with_changes(gpu="L4")).categories["runtime_context"] == expected
    assert runtime_context_bytes(Runtime(cuda_context_bytes=1000 * MiB), l4) == 1000 * MiB
    assert runtime_context_bytes(Runtime(), h200) == 1390 * MiB


def test_precision_the_gpu_cannot_run_is_refused_and_marked():
    with pytest.raises(JobError, match="V100-16GB .* has no bf16 tensor cores"):
        estimate(Job(model=MODEL, seq_len=64, precision="bf16-mixed", gpu="V100-16GB"))
    with pytest.raises(JobError, match="A100-80GB .* has no fp8 tensor cores: use bf16-mixed"):
        estimate(Job(model=MODEL, seq_len=64, precision="fp8", gpu="A100-80GB"))
    fits = {f.gpu: f for f in estimate(Job(model=MODEL, seq_len=64, precision="bf16-mixed")).fits}
    assert not fits["T4"].supported and not fits["T4"].fits and "bf16" in fits["T4"].problem
    assert fits["H100-SXM"].supported and fits["H100-SXM"].fits
    assert estimate(Job(model=MODEL, seq_len=64, precision="fp16-mixed", gpu="T4"))


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_framework_flags(run_cli):
    code, out, _ = run_cli("estimate", MODEL, "-s", "256", "--framework", "torchtune",
                           "--lora-rank", "8", "--lora-dtype", "fp32", "--keep-grads", "--json")
    data = json.loads(out)
    job = data["job"]
    assert code == 0 and job["framework"] == "torchtune" and job["precision"] == "bf16-pure"
    assert job["peft"]["adapter_dtype"] == "fp32" and job["keep_grads_between_steps"]
    assert job["loss"] == "chunked:torchtune-linear" and job["checkpointing"] == "full"


@pytest.mark.parametrize("args, fragment", [
    (["--framework", "torchtitan", "--peft", "qlora"], "torchtitan does not support peft"),
    (["--compile", "--attention", "eager"], "eager attention: use --engine trace"),
    (["--framework", "megatron"], "'megatron' is not one of"),
    (["--gpu", "T4"], "T4 (compute capability 7.5) has no bf16 tensor cores"),
])
def test_cli_bad_framework_input_is_one_line(run_cli, args, fragment):
    code, _, err = run_cli("estimate", MODEL, *args)
    assert code == 2 and fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_search_advice_offers_only_what_the_framework_supports():
    from vramplan.search.suggestions import suggestions_for

    titan = suggestions_for(Job(model=MODEL, framework="torchtitan"), "optimizer_states")
    plain = suggestions_for(Job(model=MODEL), "optimizer_states")
    assert any("8bit" in s for s in plain) and not any("8bit" in s for s in titan)
    assert any("--strategy fsdp" in s for s in titan)
    assert not any("--strategy zero2" in s for s in titan)
    weights = suggestions_for(Job(model=MODEL, framework="torchtitan"), "weights")
    assert weights and not any("qlora" in s.lower() for s in weights)
