"""benchmarks/published_runs.py: published training runs as Jobs, with their measured rates."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import published_runs  # noqa: E402

from vramplan.models import load_architecture  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return {r["id"]: r for r in published_runs.load_rows()}


def test_every_row_once_and_every_row_a_job(rows):
    # the 36 llm-foundry rows in both files once; 54 rows collected from six more sources;
    # 143 fine-tuning rows from five more (Lambda's other BERT columns, NVIDIA's BERT tables,
    # Qwen's LoRA profile with and without trained embeddings, Answer.AI's fsdp_qlora,
    # VectorLM's Llama 3 8B benchmark); fms-fsdp's 4 pre-training rows; optimum-benchmark's
    # 33 single-GPU fine-tuning rows
    assert len(rows) == 77 + 216 - 36 + 14 + 54 + 143 + 4 + 33
    # every row is a Job (NVIDIA's TF32 BERT rows: fp32 with tf32)
    cases = published_runs.cases()
    assert [c.id for c in cases if c.job is None] == []
    tf32 = [c for c in cases if c.job.tf32]
    assert len(tf32) == 5 and all(c.source == "nvidia-bert" and c.job.precision == "fp32"
                                  and "_tf32_" in c.id for c in tf32)


@pytest.mark.parametrize("row_id", [
    "llmfoundry_mpt125m_a100_80gb_8gpu_seq2048_amp_bf16",
    "llmfoundry_mpt7b_h100_80gb_8gpu_seq65536_amp_bf16",
    "llmfoundry_mpt70b_h100_80gb_512gpu_seq2048_amp_bf16",
])
def test_mpt_parameters_equal_llm_foundry_s_own_count(rows, row_id):
    row = rows[row_id]
    arch = load_architecture(published_runs.case(row).job.model)
    assert arch.total_params() == row["model_config"]["num_params"]


def test_megatron_mfu_rows_become_tokens_per_second_with_the_source_s_flop_count(rows):
    row = rows["megatron_h100_weak_gpt_1.7b_48gpu"]
    layers, h, s, v = 24, 2048, 4096, 131072
    per_token = 12 * layers * h * h * (6 + s / h + v / (2 * layers * h))
    case = published_runs.case(row)
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(408.8e12 / per_token)
    assert case.job.parallel.num_gpus == 48 and case.job.seq_len == 4096
    # 192 sequences over 48 data-parallel GPUs at the assumed micro-batch 1
    assert case.job.grad_accum == 4 and "micro-batch 1" in case.assumed


def test_megatron_2021_counts_the_recomputed_forward(rows):
    row = rows["megatron_a100_2021_gpt_1.7b_32gpu"]
    layers, h, s, v = 24, 2304, 2048, 51200
    per_token = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    case = published_runs.case(row)
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(137e12 / per_token)
    assert case.job.checkpointing == "full" and case.job.precision == "fp16-master"


def test_kempnerforge_rows_match_the_report_s_own_counts(rows):
    # the report: 7B 8.03B, 13B 14.84B, 70B 70.55B parameters; tokens per step per
    # data-parallel rank = batch x accumulation x 4096
    for row_id, params in (("kempnerforge_01_7b_1xh200_single", 8.03e9),
                           ("kempnerforge_08_13b_8xh200_fsdp8", 14.84e9),
                           ("kempnerforge_14_70b_32xh200_tp4_fsdp8", 70.55e9)):
        case = published_runs.case(rows[row_id])
        arch = load_architecture(case.job.model)
        assert arch.total_params() == pytest.approx(params, rel=5e-3)
        dp = case.job.parallel.num_gpus // case.job.parallel.tensor_parallel
        tokens = case.job.batch_size * case.job.grad_accum * case.job.seq_len * dp
        step = rows[row_id]["also_reported"]["step_time_s"]
        total = rows[row_id]["also_reported"]["tokens_per_s_total"]
        assert tokens / step == pytest.approx(total, rel=0.01)


# rows per source group we collected (benchmarks/data/published_runs/README.md)
COLLECTED = {"lambda-bert": 48, "olmo-core": 10, "bigscience": 12, "flash-attention": 5, "llm.c": 1,
             "llama3-paper": 3, "nvidia-bert": 34, "qwen1-finetune": 36,
             "answerai-fsdp-qlora": 30, "vectorlm": 18, "fms-fsdp": 4,
             "optimum-benchmark": 33}


def test_every_collected_row_becomes_a_job_on_a_catalog_gpu(rows):
    from vramplan.hardware import get_gpu
    cases = [c for c in published_runs.cases() if c.source in COLLECTED]
    counts = {group: sum(c.source == group for c in cases) for group in COLLECTED}
    assert counts == COLLECTED
    for c in cases:
        assert c.job is not None, (c.id, c.skipped)
        assert get_gpu(c.gpu).name == c.gpu
        assert c.measured_tokens_per_s_per_gpu > 0
        par = c.job.parallel
        assert par.num_gpus == rows[c.id]["num_gpus"]
        # micro-batch x accumulation x data-parallel GPUs = the stated global batch
        assert c.job.batch_size * c.job.grad_accum * par.data_parallel == rows[c.id]["global_batch"]


def test_collected_parameter_counts_match_the_sources_within_3_percent(rows):
    # stated: BLOOM 176B and the chronicle's 181B / 196B, the GPT-3 sizes of
    # flash-attention's table, llm.c's GPT-2 124M, Llama 3's 405B
    stated = [r for r in rows.values() if r["source_group"] in COLLECTED
              and r["model_config"].get("params")]
    assert len(stated) == 12 + 5 + 1 + 3
    for row in stated:
        case = published_runs.case(row)
        params = load_architecture(case.job.model).total_params(case.job.task)
        assert params == pytest.approx(row["model_config"]["params"], rel=0.03), row["id"]


def test_sequences_per_second_and_step_times_become_tokens_per_second_per_gpu(rows):
    # Lambda: 2167 sequences/s of 384 tokens over 8 H100s
    case = published_runs.case(rows["lambda_bert_large_squad_fp16_8xh100-sxm"])
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(2167 * 384 / 8)
    assert case.job.task == "seq-classification" and case.job.precision == "fp16-master"
    assert case.job.parallel.strategy == "ddp" and case.job.batch_size == 112
    # BLOOM: 2048 sequences of 2048 tokens in 104.70 s on 384 GPUs, TP 4 x PP 12 x DP 8
    case = published_runs.case(rows["bigscience_bloom176b_384xa100_tp4_pp12_mbs2"])
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(2048 * 2048 / 104.70 / 384)
    par = case.job.parallel
    assert (par.tensor_parallel, par.pipeline_parallel, par.data_parallel) == (4, 12, 8)
    assert case.job.grad_accum == 2048 // (2 * 8) and case.job.checkpointing == "full"


def test_olmo_core_rows_keep_their_float8_and_sharding(rows):
    bf16 = published_runs.case(rows["olmocore_7b_bf16_h100"])
    fp8 = published_runs.case(rows["olmocore_7b_fp8_h100"])
    assert (bf16.job.precision, fp8.job.precision) == ("bf16-mixed", "fp8")
    assert bf16.job.parallel.strategy == "hybrid-shard" and bf16.job.compile
    big = published_runs.case(rows["olmocore_32b_bf16_h100"])
    assert big.job.parallel.strategy == "fsdp" and big.job.checkpointing == "full"
    assert any("MLP only" in a for a in big.assumed)


def test_llama3_rows_derive_tokens_from_the_table_s_tflops(rows):
    row = rows["llama3_405b_16384xh100_tp8_cp16_pp16_seq131072"]
    case = published_runs.case(row)
    params = load_architecture(case.job.model).total_params()
    # 380 TFLOP/s per GPU over 6 N + 6 l h s FLOPs per token, s = 131072
    per_token = 6 * params + 6 * 126 * 16384 * 131072
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(380e12 / per_token, rel=1e-3)
    par = case.job.parallel
    assert (par.tensor_parallel, par.context_parallel, par.pipeline_parallel,
            par.data_parallel) == (8, 16, 16, 8)
    # 16M tokens = 128 sequences of 128k over 8 data-parallel ranks at the assumed micro-batch 1
    assert case.job.grad_accum == 16 and "micro-batch 1" in case.assumed
    # FSDP "without resharding" (parameters kept gathered after forward)
    assert par.strategy == "fsdp" and not par.reshard_after_forward


def test_a_rows_own_node_size_and_tp_overlap_reach_the_job(rows):
    # KempnerForge states 4 H200 per node; NeMo's GB200 rows state none: the catalog's
    # 72-GPU NVLink domain stays; Megatron's --tp-comm-overlap rows overlap TP
    kempner = published_runs.case(rows["kempnerforge_07_7b_8xh200_tp4_fsdp2"]).job.parallel
    assert kempner.gpus_per_node == 4 and "gpus_per_node" in kempner.model_fields_set
    gb200 = published_runs.case(rows["mbridge2511_llama370b_64xgb200_fp8cs"]).job.parallel
    assert "gpus_per_node" not in gb200.model_fields_set
    assert published_runs.case(rows["megatron_h100_weak_gpt_16b_192gpu"]).job.parallel.async_tp
    assert not kempner.async_tp


def test_megatron_2021_rows_ran_before_sequence_parallelism(rows):
    old = published_runs.case(rows["megatron_a100_2021_gpt_1t_3072gpu"]).job.parallel
    new = published_runs.case(rows["megatron_h100_weak_gpt_16b_192gpu"]).job.parallel
    bloom = published_runs.case(rows["bigscience_bloom176b_384xa100_tp4_pp12_mbs2"]).job.parallel
    assert old.tensor_parallel > 1 and not old.sequence_parallel
    assert bloom.tensor_parallel == 4 and not bloom.sequence_parallel
    assert new.sequence_parallel


def test_two_sources_models_of_one_name_keep_their_own_config(rows):
    # KempnerForge's and OLMo-core's Llama-3 8B share layers, hidden and ffn (the config's
    # name) but not every key: each row must read its own config.json
    configs = {}
    for row in rows.values():
        case = published_runs.case(row)
        if case.job is not None and case.job.model.startswith("/"):
            text = (Path(case.job.model) / "config.json").read_text()
            assert configs.setdefault(case.job.model, text) == text, row["id"]


def test_fine_tuning_rows_keep_their_adapters_offload_and_precision(rows):
    # Answer.AI: QLoRA rank 64 on six projections, FSDP FULL_SHARD with CPU offload, pure bf16;
    # 1,024 samples of 2,048 tokens in 483 s on two 4090s
    row = rows["answerai_4090_2x_mistral-7b-v0.2_qlora_fsdp_offload_bs12_ctx2048"]
    case = published_runs.case(row)
    job = case.job
    assert job.peft.method == "qlora" and job.peft.rank == 64
    assert "o_proj" not in job.peft.target_modules
    assert job.parallel.strategy == "fsdp" and job.offload.params and job.offload.optimizer
    assert job.precision == "bf16-pure" and job.checkpointing == "full"
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(1024 * 2048 / 483 / 2, rel=1e-3)
    ddp = published_runs.case(rows["answerai_4090_2x_llama2-7b_lora_ddp_bs4"]).job
    assert ddp.parallel.strategy == "ddp"
    # Qwen: LoRA on every block linear, 8 micro-batches of one padded sequence per s/it
    case = published_runs.case(rows["qwen1_7b_lora_1xa100_seq2048"])
    assert case.job.peft.method == "lora" and len(case.job.peft.target_modules) == 7
    assert case.job.grad_accum == 8
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(8 * 2048 / 5.2)
    assert load_architecture(case.job.model).total_params() == pytest.approx(7.72e9, rel=5e-3)
    assert case.job.peft.modules_to_save == ()
    # LoRA (emb): finetune.py's modules_to_save ['wte', 'lm_head'] for a base model
    emb = published_runs.case(rows["qwen1_7b_lora_emb_1xa100_seq2048"])
    assert emb.job.peft.modules_to_save == ("embed_tokens", "lm_head")
    assert emb.measured_tokens_per_s_per_gpu == pytest.approx(8 * 2048 / 5.3)
    # BERT fp32 on V100: plain fp32 and BertAdam's Python loop; BERT-base from its own column
    case = published_runs.case(rows["lambda_bert_base_squad_fp32_8xv100-16gb"])
    assert case.job.precision == "fp32" and case.job.optimizer_impl == "loop"
    assert case.job.model == "bert-base-uncased"


def test_optimum_benchmark_rows_are_hf_trainer_on_one_gpu(rows):
    # QLoRA r 8 / alpha 8 on q and v (peft's Llama default), fp32 adapters over the 4-bit
    # base, no double quantisation; pure fp16 timed as bf16-pure; eager attention, no
    # checkpointing, torch's foreach AdamW under a CUDA 11 build; 14.167 samples/s of 256
    case = published_runs.case(rows["optimum_benchmark_aug2023_rtx-4090_llama-2-7b_qlora_bs4"])
    job = case.job
    assert (job.peft.method, job.peft.rank, job.peft.alpha, job.peft.dropout) == (
        "qlora", 8, 8.0, 0.0)
    assert job.peft.target_modules == ("q_proj", "v_proj")
    assert job.peft.adapter_dtype == "fp32" and not job.peft.double_quant
    assert (job.precision, job.attention, job.checkpointing) == ("bf16-pure", "eager", "none")
    assert job.optimizer_impl == "foreach" and job.runtime.torch_cuda == 11
    assert (job.batch_size, job.grad_accum, job.seq_len) == (4, 1, 256)
    assert "pure fp16 timed as bf16-pure" in case.assumed
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(14.1674 * 256)
    lora = published_runs.case(rows["optimum_benchmark_dec2023_a100-80gb_llama-2-13b_lora_bs16"])
    assert lora.job.peft.adapter_dtype == "model" and lora.job.model == "llama-2-13b"
    full = published_runs.case(rows["optimum_benchmark_dec2023_a100-80gb_llama-2-7b_full_bs1"])
    assert full.job.peft is None and full.gpu == "A100-80GB"
    # a source that ran before CUDA 13 and states none: 12's launch limits
    bert = published_runs.case(rows["lambda_bert_large_squad_fp16_1xv100-16gb"])
    assert bert.job.runtime.torch_cuda == 12


def test_sixteen_bit_models_with_fp32_master_weights_are_expressed_as_such(rows):
    """NVIDIA's run_squad.py runs fp16 as Apex AMP O2 (an fp16 model, fp32 master weights)
    and Megatron-Core keeps its model in bf16 (Float16Module): fp16-master / bf16-master.
    fp32 rows, and llm-foundry's autocast, stay as they are."""
    fp16 = published_runs.case(rows["lambda_bert_large_squad_fp16_1xv100-16gb"])
    fp32 = [published_runs.case(r) for i, r in rows.items()
            if i.startswith("nvidia_bert") and "_fp32_" in i][0]
    assert (fp16.job.precision, fp32.job.precision) == ("fp16-master", "fp32")
    megatron = [published_runs.case(r) for r in rows.values()
                if r.get("source_group") == "megatron-lm"]
    assert {c.job.precision for c in megatron if c.job} <= {"bf16-master", "fp16-master", "fp8"}
    assert "bf16-master" in {c.job.precision for c in megatron if c.job}
    foundry = [published_runs.case(r) for r in rows.values()
               if r.get("source_group") == "llm-foundry"]
    assert "bf16-master" not in {c.job.precision for c in foundry if c.job}


def test_vectorlm_rows_are_one_no_sync_micro_batch(rows):
    # LoRA r 8 on q and v, FSDP FULL_SHARD accumulating 4 micro-batches without syncing,
    # pure bf16, flash-attention-2, every decoder layer checkpointed; the table's 7182.97
    # tokens/s over both GPUs
    from benchmarks import published_accuracy as pa
    from vramplan.hardware import get_gpu
    from vramplan.planning.performance import step_terms

    case = published_runs.case(rows["vectorlm_llama3_8b_lora_2xa100_seq2048"])
    job = case.job
    assert job.peft.rank == 8 and set(job.peft.target_modules) == {"q_proj", "v_proj"}
    assert job.parallel.strategy == "fsdp" and job.parallel.fsdp_no_sync
    assert (job.batch_size, job.grad_accum, job.seq_len) == (8, 4, 2048)
    assert job.precision == "bf16-pure" and job.attention == "flash-attn-2"
    assert job.checkpointing == "full" and job.optimizer_impl == "foreach"
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(7182.97 / 2)
    # the median step: each micro-batch phase and all-gather once, no reduce-scatter, and of
    # the optimizer only the clipping
    gpu = get_gpu("A100-80GB")
    step = step_terms(job, gpu)
    one = pa._one_micro_batch(step, job, gpu)
    assert one.tokens_per_step == 8 * 2048 * 2 == step.tokens_per_step // 4
    assert {p.phase: p.per_step for p in one.phases} == {
        "forward": 1, "backward": 1, "recompute": 1, "optimizer": 1}
    gathers = [c for c in step.collectives if c.times == 4]
    assert [(c.name, c.times) for c in one.collectives] == [(c.name, 1) for c in gathers]
    assert all("all-gather" in c.name for c in gathers)
    clip = [p for p in one.phases if p.phase == "optimizer"][0]
    optimizer = [p for p in step.phases if p.phase == "optimizer"][0]
    assert 0 < clip.bytes < optimizer.bytes


def test_fms_fsdp_rows_keep_their_sharding_network_and_bf16_gradient_reduction(rows):
    # 7B: HSDP over 16 nodes of 8 A100s on "400 Gbps" a node (6.25 GB/s a GPU), the whole
    # model compiled and the loss outside it; 34B: FSDP with every block checkpointed
    from vramplan.hardware import get_gpu
    from vramplan.planning.performance import step_terms

    job = published_runs.case(rows["fmsfsdp_llama2_7b_128xa100"]).job
    assert job.parallel.strategy == "hybrid-shard" and job.parallel.network_gb_s == 6.25
    assert job.compile and job.compile_components == "blocks" and job.checkpointing == "none"
    assert (job.batch_size, job.grad_accum, job.seq_len) == (2, 1, 4096)
    big = published_runs.case(rows["fmsfsdp_llama2_34b_128xa100"]).job
    assert big.parallel.strategy == "fsdp" and big.checkpointing == "full"
    # bfSixteen reduces in bf16 where bf16-mixed's fp32 gradients would move 4 bytes
    assert job.parallel.grad_reduce_dtype == "compute"
    gpu = get_gpu("A100-80GB")
    own = job.model_copy(update={"parallel": job.parallel.model_copy(
        update={"grad_reduce_dtype": "grad"})})
    half, full = step_terms(job, gpu).collectives, step_terms(own, gpu).collectives
    for after, before in zip(half, full):
        scale = 0.5 if before.name.startswith("gradient") else 1.0
        assert after.link_s == pytest.approx(scale * before.link_s)
    assert any(c.name.startswith("gradient") for c in full)
