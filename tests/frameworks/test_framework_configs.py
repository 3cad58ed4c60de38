"""Framework configs in (issue 18): real shipped example configs read without hand-editing
and give the same Job, so the same estimate, as the Job written by hand from the same file;
overrides, the mapped / ignored / not-understood report, the fix written back in the
file's own format, and `vramplan check`."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

import vramplan
from vramplan.frameworks.configs import ConfigError, detect_format, read_config
from vramplan.frameworks.configs.core import load_table, parse_text, read_text
from vramplan.frameworks.configs.write import (
    config_changes,
    override_line,
    patched_text,
    unified_diff,
)
from vramplan.job import Job, Parallel, Peft

DATA = Path(__file__).parents[1] / "data" / "framework_configs"
TT, TI, HF = DATA / "torchtune", DATA / "torchtitan", DATA / "hf"
AX, LF, AC, DS = DATA / "axolotl", DATA / "llama-factory", DATA / "accelerate", DATA / "deepspeed"

# files the CLI or the test names a model for (they name none themselves)
MODEL = "llama-3.1-8b"


def raw(path: Path) -> dict:
    return parse_text(read_text(path), path)[0]


def same_estimate(read_job: Job, hand: Job) -> None:
    """The two jobs are equal, and so are their formula estimates (every category)."""
    assert read_job == hand
    a, b = vramplan.estimate(read_job), vramplan.estimate(hand)
    assert a.categories == b.categories and a.peak_allocated == b.peak_allocated


# --- evidence: torchtune -----------------------------------------------------------------------


def test_torchtune_1b_lora():
    cfg = raw(TT / "llama3_2_1B_lora_single_device.yaml")
    m = cfg["model"]
    targets = ("q_proj", "v_proj", "o_proj") + (("gate_proj", "up_proj", "down_proj")
                                                if m["apply_lora_to_mlp"] else ())
    hand = Job(model="llama-3.2-1b", framework="torchtune", batch_size=cfg["batch_size"],
               grad_accum=cfg["gradient_accumulation_steps"], precision="bf16-pure",
               checkpointing="full" if cfg["enable_activation_checkpointing"] else "none",
               optimizer="adamw", optimizer_impl="fused", loss="chunked:torchtune-linear",
               activation_offload=False, optimizer_in_backward=False,
               compile=cfg["compile"],
               peft=Peft(method="lora", rank=m["lora_rank"], alpha=m["lora_alpha"],
                         dropout=m["lora_dropout"], target_modules=targets))
    read = read_config(TT / "llama3_2_1B_lora_single_device.yaml")
    same_estimate(read.job(), hand)
    assert read.job().peft.adapter_dtype == "model"  # the torchtune profile fills it
    assert read.job().batch_size == 4 and read.job().checkpointing == "none"


def test_torchtune_3b_full_paged_8bit():
    cfg = raw(TT / "llama3_2_3B_full_single_device.yaml")
    assert cfg["optimizer"]["_component_"] == "bitsandbytes.optim.PagedAdamW8bit"
    hand = Job(model="llama-3.2-3b", framework="torchtune", batch_size=cfg["batch_size"],
               grad_accum=cfg["gradient_accumulation_steps"], precision="bf16-pure",
               checkpointing="full" if cfg["enable_activation_checkpointing"] else "none",
               optimizer="paged-adamw-8bit", optimizer_impl="foreach",
               optimizer_in_backward=cfg["optimizer_in_bwd"],
               activation_offload=cfg["enable_activation_offloading"],
               loss="chunked:torchtune-linear", compile=cfg["compile"])
    read = read_config(TT / "llama3_2_3B_full_single_device.yaml")
    same_estimate(read.job(), hand)
    assert read.job().optimizer == "paged-adamw-8bit"


def test_torchtune_8b_qlora():
    cfg = raw(TT / "llama3_1_8B_qlora_single_device.yaml")
    m = cfg["model"]
    assert m["_component_"].endswith(".qlora_llama3_1_8b")
    hand = Job(model="llama-3.1-8b", framework="torchtune", batch_size=cfg["batch_size"],
               grad_accum=cfg["gradient_accumulation_steps"], precision="bf16-pure",
               checkpointing="full" if cfg["enable_activation_checkpointing"] else "none",
               optimizer="adamw", optimizer_impl="fused", loss="chunked:torchtune-linear",
               activation_offload=cfg["enable_activation_offloading"],
               compile=cfg["compile"], optimizer_in_backward=False,
               peft=Peft(method="qlora", rank=m["lora_rank"], alpha=m["lora_alpha"],
                         dropout=m["lora_dropout"],
                         target_modules=("q_proj", "v_proj", "o_proj", "gate_proj",
                                         "up_proj", "down_proj")))
    same_estimate(read_config(TT / "llama3_1_8B_qlora_single_device.yaml").job(), hand)


def test_torchtune_overrides_and_seq_len_note():
    path = TT / "qwen2_5_0.5B_full_single_device.yaml"
    plain = read_config(path)
    assert any("max_seq_len is not set" in n for n in plain.notes)
    read = read_config(path, overrides=["batch_size=3", "tokenizer.max_seq_len=1024",
                                        "enable_activation_checkpointing=True"])
    job = read.job()
    assert (job.batch_size, job.seq_len, job.checkpointing) == (3, 1024, "full")
    assert not any("max_seq_len is not set" in n for n in read.notes)
    assert job.model == "qwen2.5-0.5b"


def test_torchtune_distributed_70b_offload_on_the_gpus_of_tune_run():
    """llama3_1/70B_full.yaml (`tune run --nproc_per_node 8 full_finetune_distributed`):
    FSDP2 over the launcher's GPUs, fsdp_cpu_offload as CPUOffloadPolicy, foreach=False ->
    torch's loop on the CPU."""
    cfg = raw(TT / "llama3_1_70B_full.yaml")
    assert cfg["fsdp_cpu_offload"] is True and cfg["optimizer"]["fused"] is False
    read = read_config(TT / "llama3_1_70B_full.yaml")
    assert any("data_parallel_shard_dim -1" in n and "1 GPU(s)" in n for n in read.notes)
    hand = Job(model="llama-3.1-70b", framework="torchtune", batch_size=cfg["batch_size"],
               grad_accum=1, precision="bf16-pure", checkpointing="full",
               optimizer="adamw", optimizer_impl="foreach", loss="chunked:torchtune-linear",
               activation_offload=False, optimizer_in_backward=False, compile=False,
               offload={"params": True, "optimizer": True},
               parallel=Parallel(strategy="fsdp", num_gpus=8,
                                 shard_over_context_parallel=True))
    same_estimate(read.job(parallel={"num_gpus": 8}), hand)


def test_torchtune_distributed_tp_and_hsdp_degrees():
    path = TT / "llama3_3_70B_full_multinode.yaml"
    cfg = raw(path)
    tp = cfg["tensor_parallel_dim"]
    job = read_config(path).job()  # shard -1: the TP group alone until -n says more
    assert (job.model, job.parallel.strategy, job.parallel.num_gpus,
            job.parallel.tensor_parallel) == ("llama-3.1-70b", "fsdp", tp, tp)
    wide = read_config(path).job(parallel={"num_gpus": 32})
    assert wide.parallel.data_parallel == 32 // tp
    # 2 replicas x 4 shards x TP 8: HSDP whose shard groups are 4 GPUs, on 64 GPUs
    hsdp = read_config(path, overrides=["data_parallel_shard_dim=4",
                                        "data_parallel_replicate_dim=2"]).job()
    assert (hsdp.parallel.strategy, hsdp.parallel.num_gpus, hsdp.parallel.shard_degree) == (
        "hybrid-shard", 2 * 4 * tp, 4)
    # a resharding switch goes to FSDP2's reshard_after_forward
    kept = read_config(path, overrides=["fsdp_reshard_after_forward=False"]).job()
    assert kept.parallel.reshard_after_forward is False


@pytest.mark.parametrize("overrides, says", [
    (["data_parallel_shard_dim=1", "data_parallel_replicate_dim=4"], "nothing reduces"),
    (["data_parallel_replicate_dim=2"], "set data_parallel_shard_dim"),
    (["data_parallel_shard_dim=0"], "at least 1"),
])
def test_torchtune_degrees_it_cannot_size_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        read_config(TT / "llama3_3_70B_full_multinode.yaml", overrides=overrides).job()


def test_torchtune_on_several_gpus_is_fsdp2():
    """A config without distributed keys (llama3_1/8B_full.yaml names none but
    custom_sharded_layers; a single-device one none at all) on -n 8: FSDP2, as torchtune's
    *_distributed recipes run; on one GPU no strategy."""
    for name in ("llama3_1_8B_full.yaml", "llama3_2_1B_lora_single_device.yaml"):
        read = read_config(TT / name)
        assert read.job(parallel={"num_gpus": 8}).parallel.strategy == "fsdp"
    one = read_config(TT / "llama3_2_1B_lora_single_device.yaml").job()
    assert one.parallel.strategy == "none"
    assert Job(model="llama-3.1-8b", framework="torchtune",
               parallel={"num_gpus": 4}).parallel.strategy == "fsdp"


# --- torchtitan ---------------------------------------------------------------------------------


def test_torchtitan_8b_op_sac():
    cfg = tomllib.loads((TI / "llama3_8b.toml").read_text())
    assert cfg["activation_checkpoint"]["selective_ac_option"] == "op"
    hand = Job(model="llama-3.1-8b", framework="torchtitan",
               batch_size=cfg["training"]["local_batch_size"], seq_len=cfg["training"]["seq_len"],
               precision="bf16-mixed", checkpointing="selective:torchtitan-op",
               optimizer="adamw", optimizer_impl="fused", keep_grads_between_steps=False,
               compile=cfg["compile"]["enable"], parallel=Parallel(strategy="fsdp", num_gpus=1,
                                                                    shard_over_context_parallel=True))
    read = read_config(TI / "llama3_8b.toml")
    same_estimate(read.job(), hand)
    assert any("data_parallel_shard_degree = -1" in n for n in read.notes)


def test_torchtitan_70b_tp_and_overrides():
    cfg = tomllib.loads((TI / "llama3_70b.toml").read_text())
    tp = cfg["parallelism"]["tensor_parallel_degree"]
    read = read_config(TI / "llama3_70b.toml")
    hand = Job(model="llama-3.1-70b", framework="torchtitan",
               batch_size=cfg["training"]["local_batch_size"], seq_len=cfg["training"]["seq_len"],
               precision="bf16-mixed", checkpointing=cfg["activation_checkpoint"]["mode"],
               optimizer="adamw", optimizer_impl="fused", keep_grads_between_steps=False,
               parallel=Parallel(strategy="fsdp", num_gpus=tp, tensor_parallel=tp,
                                 shard_over_context_parallel=True))
    same_estimate(read.job(), hand)
    both = [read_config(TI / "llama3_70b.toml", overrides=o).job() for o in (
        ["--training.local_batch_size=2"], ["--training.local_batch_size", "2"])]
    assert both[0] == both[1] and both[0].batch_size == 2
    # vramplan's own flags win over the file: 64 GPUs (the preset's comment), 8 shards
    wide = read.job(parallel={"num_gpus": 64})
    assert wide.parallel.data_parallel == 64 // tp


def test_torchtitan_hsdp_shards_over_its_context_parallel_ranks_too():
    # 2 replicas x 4 shards x CP 2: FSDP2's mesh is dp_shard x cp, 8 ranks per shard group
    job = read_config(TI / "llama3_8b.toml", overrides=[
        "--parallelism.data_parallel_replicate_degree=2",
        "--parallelism.data_parallel_shard_degree=4",
        "--parallelism.context_parallel_degree=2"]).job()
    assert (job.parallel.strategy, job.parallel.num_gpus, job.parallel.shard_degree) == (
        "hybrid-shard", 16, 8)


def test_torchtitan_405b_asks_for_what_torchtitan_removed():
    """llama3_405b.toml turns on enable_fsdp_float8_all_gather, which current torchtitan
    (the profile's commit) no longer has: refused with that reason, not guessed."""
    with pytest.raises(vramplan.errors.JobError, match="fsdp_float8_all_gather"):
        read_config(TI / "llama3_405b.toml").job()
    job = read_config(TI / "llama3_405b.toml", framework="plain").job()
    assert job.precision == "fp8" and job.fp8.fsdp_float8_all_gather


def test_torchtitan_405b_async_tp_and_compile_components():
    cfg = tomllib.loads((TI / "llama3_405b.toml").read_text())
    assert cfg["parallelism"]["enable_async_tensor_parallel"] is True
    job = read_config(TI / "llama3_405b.toml", framework="plain").job()
    assert job.parallel.async_tp and job.parallel.tensor_parallel == 8
    assert job.compile and job.compile_components == "blocks+loss"
    blocks = read_config(TI / "llama3_70b.toml", overrides=[
        "--compile.enable=true", "--compile.components=model"]).job()
    assert (blocks.compile, blocks.compile_components) == (True, "blocks")
    with pytest.raises(ConfigError, match="needs compile.enable"):  # torchtitan refuses it
        read_config(TI / "llama3_70b.toml",
                    overrides=["--parallelism.enable_async_tensor_parallel=true"])


def test_torchtitan_pipeline_schedule_and_micro_batches():
    """pipeline_parallel.py: local_batch_size / pipeline_parallel_microbatch_size
    micro-batches of that size per schedule, one schedule per accumulation step (train.py);
    a multi-stage schedule's stages per rank from layers_per_stage (2 by default)."""
    cfg = tomllib.loads((TI / "llama3_70b.toml").read_text())
    tp = cfg["parallelism"]["tensor_parallel_degree"]
    local, size, pp, global_batch = 8, 2, 4, 16
    pipeline = [f"--parallelism.pipeline_parallel_degree={pp}",
                "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                f"--training.local_batch_size={local}",
                f"--parallelism.pipeline_parallel_microbatch_size={size}",
                f"--training.global_batch_size={global_batch}"]
    job = read_config(TI / "llama3_70b.toml", overrides=pipeline).job()
    steps = global_batch // local  # one data-parallel rank (shard degree -1: 1 assumed)
    assert (job.batch_size, job.grad_accum) == (size, local // size * steps)
    assert job.parallel.pipeline_flushes == steps
    assert (job.parallel.pipeline_schedule, job.parallel.pipeline_chunks) == ("interleaved", 2)
    assert job.parallel.num_gpus == tp * pp
    # a fix to a pipelined job is written back as torchtitan's three batch keys
    read = read_config(TI / "llama3_70b.toml", overrides=pipeline)
    changes, missing = config_changes(read, job, job.with_changes(batch_size=1, grad_accum=16))
    assert changes == {"parallelism.pipeline_parallel_microbatch_size": 1,
                       "training.local_batch_size": 1 * 16 // steps,
                       "training.global_batch_size": 1 * 16 // steps * 1 * steps}
    assert missing == []
    # 80 layers + the embedding and the output counted as one each: ceil(82 / 7) = 12
    # stages, 3 per rank
    job = read_config(TI / "llama3_70b.toml", overrides=pipeline + [
        "--parallelism.pipeline_parallel_layers_per_stage=7"]).job()
    assert job.parallel.pipeline_chunks == 3
    # the split counts them too: first/last_stage_less_layers, 1 each by default
    assert (job.parallel.pipeline_embedding_layers, job.parallel.pipeline_head_layers) == (1, 1)
    job = read_config(TI / "llama3_70b.toml", overrides=pipeline + [
        "--parallelism.pipeline_parallel_first_stage_less_layers=2",
        "--parallelism.pipeline_parallel_last_stage_less_layers=0"]).job()
    assert (job.parallel.pipeline_embedding_layers, job.parallel.pipeline_head_layers) == (2, 0)
    with pytest.raises(ConfigError, match="cannot spread over 4 ranks"):  # ceil(82 / 10) = 9
        read_config(TI / "llama3_70b.toml", overrides=pipeline + [
            "--parallelism.pipeline_parallel_layers_per_stage=10"])
    gpipe = read_config(TI / "llama3_70b.toml", overrides=[
        f"--parallelism.pipeline_parallel_degree={pp}",
        "--parallelism.pipeline_parallel_schedule=GPipe"]).job()
    assert (gpipe.parallel.pipeline_schedule, gpipe.batch_size, gpipe.grad_accum) == (
        "gpipe", 1, cfg["training"]["local_batch_size"])  # micro-batches of 1 by default
    with pytest.raises(ConfigError, match="ZBVZeroBubble.*not modelled"):
        read_config(TI / "llama3_70b.toml", overrides=[
            f"--parallelism.pipeline_parallel_degree={pp}",
            "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble"])
    with pytest.raises(ConfigError, match="not a multiple of pipeline_parallel_microbatch"):
        read_config(TI / "llama3_70b.toml", overrides=pipeline[:1] + [
            "--training.local_batch_size=3",
            "--parallelism.pipeline_parallel_microbatch_size=2"])
    # without a pipeline its keys change nothing (the DeepSeek presets name a schedule)
    plain = read_config(TI / "llama3_70b.toml", overrides=[
        "--parallelism.pipeline_parallel_schedule=Interleaved1F1B"]).job()
    assert plain == read_config(TI / "llama3_70b.toml").job()


# --- Hugging Face TrainingArguments, TRL, peft ---------------------------------------------------


def test_trl_example_config_gets_sftconfig_defaults():
    cfg = raw(HF / "trl_example_config.yaml")
    hand = Job(model="qwen2.5-0.5b", framework="hf-trainer", batch_size=8, seq_len=1024,
               precision="bf16-mixed", checkpointing="full", optimizer="adamw",
               optimizer_impl="fused")
    read = read_config(HF / "trl_example_config.yaml")
    same_estimate(read.job(), hand)
    assert cfg["model_name_or_path"] == "Qwen/Qwen2.5-0.5B"
    assert set(read.ignored) >= {"learning_rate", "dataset_name"}


def test_training_arguments_json():
    d = json.loads((HF / "training_args_bf16.json").read_text())
    hand = Job(model="llama-3.2-1b", framework="hf-trainer",
               batch_size=d["per_device_train_batch_size"],
               grad_accum=d["gradient_accumulation_steps"], precision="bf16-mixed",
               checkpointing="none", optimizer="adamw", optimizer_impl="foreach")
    read = read_config(HF / "training_args_bf16.json", model="llama-3.2-1b")
    same_estimate(read.job(), hand)
    assert len(read.mapped) + len(read.ignored) + len(read.not_understood) >= len(d)
    gc = read_config(HF / "training_args_fp32_gc.json", model="llama-3.2-1b").job()
    assert (gc.precision, gc.checkpointing, gc.optimizer) == ("fp32", "full", "paged-adamw-8bit")


def test_peft_adapter_config():
    d = json.loads((HF / "adapter_config.json").read_text())
    hand = Job(model="llama-3.2-1b", framework="hf-trainer", batch_size=8, precision="fp32",
               optimizer_impl="fused",
               peft=Peft(method="lora", rank=d["r"], alpha=d["lora_alpha"],
                         dropout=d["lora_dropout"], target_modules=tuple(sorted(
                             d["target_modules"]))))
    read = read_config(HF / "adapter_config.json", model="llama-3.2-1b")
    same_estimate(read.job(), hand)
    assert read.job().peft.adapter_dtype == "fp32"  # the hf-trainer profile (peft's upcast)


# --- accelerate and DeepSpeed ----------------------------------------------------------------


def test_accelerate_templates():
    fsdp = raw(AC / "fsdp.yaml")
    read = read_config(AC / "fsdp.yaml", model=MODEL)
    hand = Job(model=MODEL, framework="accelerate", precision="bf16-mixed",
               parallel=Parallel(strategy="fsdp", num_gpus=fsdp["num_processes"]))
    same_estimate(read.job(), hand)
    multi = read_config(AC / "multi_gpu.yaml", model=MODEL).job()
    assert multi.parallel == Parallel(strategy="ddp", num_gpus=raw(AC / "multi_gpu.yaml")
                                      ["num_processes"])
    single = read_config(AC / "single_accelerator.yaml", model=MODEL).job()
    assert single == Job(model=MODEL, framework="accelerate", precision="bf16-mixed")


def test_accelerate_deepspeed_plugin_reads_the_json_it_names():
    ds = json.loads((DATA / "deepspeed_config_templates" / "zero_stage1_config.json")
                    .read_text())
    read = read_config(AC / "deepspeed.yaml", model=MODEL)
    # DeepSpeed's fp16: the module in fp16, fp32 master weights in the optimizer
    hand = Job(model=MODEL, framework="accelerate",
               precision="fp16-master" if ds["fp16"]["enabled"] else "fp32",
               grad_accum=ds["gradient_accumulation_steps"],
               parallel=Parallel(strategy=f"zero{ds['zero_optimization']['stage']}",
                                 num_gpus=raw(AC / "deepspeed.yaml")["num_processes"],
                                 overlap_grad_reduce=ds["zero_optimization"]["overlap_comm"]))
    same_estimate(read.job(), hand)


@pytest.mark.parametrize("name, strategy, offload", [
    ("zero_stage1_config.json", "zero1", False), ("zero_stage2_config.json", "zero2", False),
    ("zero_stage3_offload_config.json", "zero3", True), ("ds_z3_config.json", "zero3", False)])
def test_deepspeed_json(name, strategy, offload):
    d = json.loads((DS / name).read_text())
    stage = d["zero_optimization"]["stage"]
    assert strategy == f"zero{stage}"
    fp16 = d.get("fp16", {}).get("enabled")
    # fp16 / bf16 on: a 16-bit module with fp32 master weights; "auto" (the HF integration
    # fills it from the launcher's bf16 / fp16) reads as bf16, unless the job says otherwise
    hand = Job(model=MODEL, framework="plain", precision="fp16-master" if fp16 is True
               else "bf16-master", parallel=Parallel(
                   strategy=strategy, overlap_grad_reduce=d["zero_optimization"]["overlap_comm"]),
               offload={"optimizer": offload, "params": offload})
    read = read_config(DS / name, model=MODEL)
    same_estimate(read.job(), hand)
    assert read.job().parallel.overlap_grad_reduce is d["zero_optimization"]["overlap_comm"]
    if fp16 == "auto":
        assert read.job(precision="fp16-mixed").precision == "fp16-mixed"


@pytest.mark.parametrize("stage, overlapped", [(0, False), (1, False), (2, False), (3, True)])
def test_deepspeed_overlap_comm_defaults_by_stage(stage, overlapped, tmp_path):
    """Left out, overlap_comm is DeepSpeed's default: on for ZeRO-3 only; set, it wins."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    assert read_config(path, model=MODEL).job().parallel.overlap_grad_reduce is overlapped
    path.write_text(json.dumps({"zero_optimization": {"stage": stage,
                                                      "overlap_comm": not overlapped}}))
    assert read_config(path, model=MODEL).job().parallel.overlap_grad_reduce is not overlapped


# --- Axolotl and LLaMA-Factory --------------------------------------------------------------


def test_axolotl_examples():
    g = raw(AX / "gemma2_qlora.yml")
    hand = Job(model="gemma-2-9b", framework="hf-trainer", batch_size=g["micro_batch_size"],
               grad_accum=g["gradient_accumulation_steps"], seq_len=g["sequence_len"],
               precision="bf16-mixed", checkpointing="full", optimizer="adamw-8bit",
               optimizer_impl="foreach", attention="flash-attn-2", tf32=g["tf32"],
               peft=Peft(method="qlora", rank=g["lora_r"], alpha=g["lora_alpha"],
                         dropout=g["lora_dropout"], target_modules=("all-linear",)))
    assert g["attn_implementation"] == "flash_attention_2"
    same_estimate(read_config(AX / "gemma2_qlora.yml").job(), hand)
    f = raw(AX / "llama-3_fft-8b.yaml")
    assert f["base_model"] == "NousResearch/Meta-Llama-3.1-8B"  # a re-upload of the catalog's
    fft = Job(model="llama-3.1-8b", framework="hf-trainer", batch_size=f["micro_batch_size"],
              grad_accum=f["gradient_accumulation_steps"], seq_len=f["sequence_len"],
              precision="bf16-mixed", checkpointing="full", optimizer="paged-adamw-8bit",
              optimizer_impl="foreach", attention="flash-attn-2")
    assert f["attn_implementation"] == "flash_attention_2"
    same_estimate(read_config(AX / "llama-3_fft-8b.yaml").job(), fft)
    q = read_config(AX / "llama-2_qlora.yml").job()
    assert (q.model, q.peft.method, q.seq_len) == ("llama-2-7b", "qlora",
                                                   raw(AX / "llama-2_qlora.yml")["sequence_len"])


def test_axolotl_8bit_base_is_refused():
    with pytest.raises(ConfigError, match="load_in_8bit"):
        read_config(AX / "llama-2_lora.yml")


def _local_model_folder(tmp_path: Path) -> Path:
    """A local config folder standing in for a Hub id the catalog lacks (Llama 3.1 8B's)."""
    folder = tmp_path / "llama3-8b"
    folder.mkdir()
    catalog = Path(vramplan.__file__).parent / "models" / "configs" / "llama-3.1-8b.json"
    (folder / "config.json").write_text(catalog.read_text())
    return folder


def test_llamafactory_examples(tmp_path):
    e = raw(LF / "qwen25_05b_eaft_full.yaml")
    hand = Job(model="qwen2.5-0.5b", framework="hf-trainer",
               batch_size=e["per_device_train_batch_size"],
               grad_accum=e["gradient_accumulation_steps"], seq_len=e["cutoff_len"],
               precision="bf16-mixed", checkpointing="none", optimizer="adamw",
               optimizer_impl="fused")
    read = read_config(LF / "qwen25_05b_eaft_full.yaml")
    same_estimate(read.job(), hand)
    assert "use_eaft_loss" in read.not_understood
    assert any("use_eaft_loss" in n and "not understood" in n for n in read.notes)
    f = raw(LF / "qwen3_full_sft_fsdp2.yaml")
    q3 = read_config(LF / "qwen3_full_sft_fsdp2.yaml").job()
    assert (q3.model, q3.batch_size, q3.peft) == ("qwen3-8b", f["per_device_train_batch_size"],
                                                  None)
    # a Hub id the catalog lacks: a local config folder stands in for it
    folder = _local_model_folder(tmp_path)
    lora = read_config(LF / "llama3_lora_sft.yaml", model=str(folder)).job()
    cfg = raw(LF / "llama3_lora_sft.yaml")
    assert lora.peft == Peft(method="qlora", rank=cfg["lora_rank"], alpha=2 * cfg["lora_rank"],
                             dropout=0.0, target_modules=("all-linear",), adapter_dtype="fp32")


def test_llamafactory_names_its_deepspeed_json():
    with pytest.raises(ConfigError, match="Qwen3-4B"):
        read_config(LF / "qwen3_full_sft.yaml")
    job = read_config(LF / "qwen3_full_sft.yaml", model="qwen3-8b").job()
    stage = json.loads((LF / "examples" / "deepspeed" / "ds_z3_config.json").read_text())[
        "zero_optimization"]["stage"]
    assert job.parallel.strategy == f"zero{stage}"


# --- detection, the key report, profiles ----------------------------------------------------


@pytest.mark.parametrize("path, expected", [
    (TT / "llama3_2_1B_lora_single_device.yaml", "torchtune"),
    (TI / "llama3_8b.toml", "torchtitan"), (HF / "trl_example_config.yaml", "hf-trainer"),
    (HF / "adapter_config.json", "hf-trainer"), (HF / "training_args_bf16.json", "hf-trainer"),
    (AC / "fsdp.yaml", "accelerate"), (DS / "ds_z3_config.json", "deepspeed"),
    (AX / "gemma2_qlora.yml", "axolotl"), (LF / "qwen25_05b_eaft_full.yaml", "llama-factory")])
def test_format_detected_from_content(path, expected, tmp_path):
    copy = tmp_path / ("config" + (".toml" if path.suffix == ".toml" else ".txt"))
    copy.write_text(path.read_text())  # the name says nothing
    assert detect_format(*parse_text(copy.read_text(), copy)) == expected


def test_every_key_is_mapped_ignored_or_not_understood(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text((TT / "llama3_2_1B_lora_single_device.yaml").read_text()
                    + "my_custom_knob: 3\n")
    read = read_config(path)
    flat_keys = set(read.mapped) | set(read.ignored) | set(read.not_understood)
    assert "my_custom_knob" in read.not_understood
    assert "optimizer.lr" in read.ignored and "batch_size" in read.mapped
    assert any("my_custom_knob" in n for n in read.notes)
    from vramplan.frameworks.configs.core import flatten
    assert set(flatten(raw(path))) <= flat_keys  # nothing dropped silently


def test_framework_flag_replaces_the_formats_profile():
    hf = read_config(DS / "zero_stage2_config.json", model=MODEL, framework="hf-trainer").job()
    plain = read_config(DS / "zero_stage2_config.json", model=MODEL).job()
    assert (plain.framework, plain.optimizer_impl) == ("plain", "foreach")
    assert (hf.framework, hf.optimizer_impl) == ("hf-trainer", "fused")  # profiles.toml


def test_every_table_cites_its_source():
    for name in ("torchtune", "torchtitan", "hf-trainer", "accelerate", "deepspeed", "axolotl",
                 "llama-factory"):
        table = load_table(name)
        assert table.source and table.docs.startswith("https://")
        assert all(e.source for e in table.entries.values()), name


def test_readers_import_no_torch():
    code = ("import sys, vramplan.frameworks.configs.write; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- writers and the round trip ---------------------------------------------------------------


def _fix_for(read, gpu="L4"):
    from vramplan.hardware import get_gpu
    from vramplan.planning.make_fit import make_it_fit

    job = read.job(gpu=gpu)
    for fix in make_it_fit(job, get_gpu(gpu), allow=(), limit=10):
        changes, missing = config_changes(read, job, fix.job)
        if not missing:
            return job, fix, changes
    raise AssertionError("no fix the file can express")


def test_torchtune_round_trip(tmp_path, capsys):
    """Does not fit an L4 -> patched -> OmegaConf loads it -> `vramplan check` says fits."""
    omegaconf = pytest.importorskip("omegaconf")
    from vramplan.cli.app import main

    path = TT / "llama3_2_1B_lora_single_device.yaml"
    read = read_config(path)
    assert not vramplan.estimate(read.job(gpu="L4")).fits[0].fits
    job, fix, changes = _fix_for(read)
    assert changes  # e.g. batch_size / gradient_accumulation_steps
    patched = patched_text(read, changes)
    loaded = omegaconf.OmegaConf.create(patched)
    for key, value in changes.items():
        assert omegaconf.OmegaConf.select(loaded, key) == value
    assert patched.count("\n") == read.text.count("\n")  # lines changed in place
    assert "# Use to increase effective batch size" in patched  # comments kept
    diff = unified_diff(read, changes)
    assert diff.startswith("--- a/") and sum(ln.startswith("+") for ln in diff.splitlines()) \
        == len(changes) + 1
    line = override_line(read, changes)
    assert line.startswith("tune run") and all(f"{k}=" in line for k in changes)
    out = tmp_path / "patched.yaml"
    out.write_text(patched)
    assert read_config(out).job().with_changes(gpu="L4") == fix.job.with_changes(gpu="L4")
    for argv, code in ((["check", "--config", str(path), "--gpu", "L4"], 1),
                       (["check", "--config", str(out), "--gpu", "L4"], 0)):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == code
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("does not fit on L4 by") and "tune run" in lines[0]
    assert lines[1].startswith("fits on L4")


def test_torchtitan_patch_is_valid_toml():
    read = read_config(TI / "llama3_8b.toml")
    changes = {"training.local_batch_size": 1, "activation_checkpoint.mode": "full",
               "compile.enable": True}
    patched = tomllib.loads(patched_text(read, changes))
    assert patched["training"]["local_batch_size"] == 1
    assert patched["activation_checkpoint"]["mode"] == "full"
    assert patched["compile"]["enable"] is True
    assert override_line(read, {"training.local_batch_size": 2}).endswith(
        "--training.local_batch_size=2")


def test_changes_map_back_to_the_files_keys():
    read = read_config(TT / "llama3_2_1B_lora_single_device.yaml")
    before = read.job()
    after = before.with_changes(batch_size=2, grad_accum=16, checkpointing="full")
    changes, missing = config_changes(read, before, after)
    assert changes == {"batch_size": 2, "gradient_accumulation_steps": 16,
                       "enable_activation_checkpointing": True}
    assert not missing
    _, missing = config_changes(read, before, before.with_changes(
        parallel=Parallel(strategy="fsdp", num_gpus=2)))
    assert missing  # said, not dropped
    hf = read_config(HF / "training_args_bf16.json", model="llama-3.2-1b")
    c, _ = config_changes(hf, hf.job(), hf.job().with_changes(batch_size=4, grad_accum=8,
                                                                checkpointing="full"))
    assert c == {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 8,
                 "gradient_checkpointing": True}


@pytest.mark.torch
@pytest.mark.slow  # imports transformers and peft (over 10 s on the CI VM)
def test_patched_hf_files_are_accepted_by_transformers_and_peft(tmp_path):
    import peft
    import transformers
    read = read_config(HF / "training_args_bf16.json", model="qwen2.5-0.5b")
    job, fix, changes = _fix_for(read)
    patched = json.loads(patched_text(read, changes))
    args = transformers.TrainingArguments(**patched)
    for key, value in changes.items():
        assert getattr(args, key) == value
    lora = json.loads((HF / "adapter_config.json").read_text())
    peft.LoraConfig(**lora)


def test_check_exit_codes(tmp_path, capsys):
    from vramplan.cli.app import main

    fits = TT / "qwen2_5_0.5B_full_single_device.yaml"
    for argv, code in ((["check", "--config", str(fits), "--gpu", "H100-SXM"], 0),
                       (["check", "--config", str(fits), "--gpu", "L4", "batch_size=64",
                         "tokenizer.max_seq_len=8192"], 1),
                       (["check", "--config", str(fits)], 2)):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == code, argv
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 2 and err.startswith("error: check needs the GPU")


def test_estimate_config_carries_the_notes(capsys):
    from vramplan.cli.app import main

    with pytest.raises(SystemExit) as stop:
        main(["estimate", "--config", str(LF / "qwen25_05b_eaft_full.yaml"), "--json"])
    assert stop.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert any("use_eaft_loss" in n for n in report["notes"])
    assert report["job"]["model"] == "qwen2.5-0.5b"


def test_yaml_content_is_plain_data():
    """Every committed example parses with yaml.safe_load / json / tomllib as is."""
    for path in DATA.rglob("*"):
        if path.suffix in (".yaml", ".yml"):
            assert isinstance(yaml.safe_load(path.read_text()), dict)


def test_check_patch_and_diff(tmp_path, capsys):
    """--patch writes the fixed file, --diff prints the same change; the patched
    TrainingArguments JSON differs from the original in the fix's keys only."""
    from vramplan.cli.app import main

    src, out = HF / "training_args_bf16.json", tmp_path / "fixed.json"
    with pytest.raises(SystemExit) as stop:
        main(["check", "qwen2.5-0.5b", "--config", str(src), "--gpu", "L4", "--patch", str(out),
              "--diff"])
    assert stop.value.code == 1
    printed = capsys.readouterr().out
    before, after = json.loads(src.read_text()), json.loads(out.read_text())
    changed = {k for k in before if before[k] != after[k]}
    assert changed and changed <= {"per_device_train_batch_size", "gradient_accumulation_steps",
                                   "gradient_checkpointing", "activation_checkpointing", "optim"}
    assert all(f"+  \"{k}\": {json.dumps(after[k])}," in printed for k in changed)
    assert after["per_device_train_batch_size"] * after["gradient_accumulation_steps"] == \
        before["per_device_train_batch_size"] * before["gradient_accumulation_steps"]
    with pytest.raises(SystemExit) as stop:
        main(["check", "qwen2.5-0.5b", "--config", str(out), "--gpu", "L4"])
    assert stop.value.code == 0


def test_model_argument_with_a_config_that_names_none(capsys):
    from vramplan.cli.app import main

    with pytest.raises(SystemExit) as stop:
        main(["estimate", "llama-3.2-1b", "--config", str(DS / "zero_stage2_config.json"),
              "--json"])
    assert stop.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["job"]["model"] == "llama-3.2-1b"
    assert report["job"]["parallel"]["strategy"] == "zero2"


def test_web_reads_an_uploaded_framework_config():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from vramplan.web import create_app

    client = TestClient(create_app())
    text = (TT / "llama3_2_1B_lora_single_device.yaml").read_text()
    r = client.post("/api/v1/framework-config", json={"text": text, "overrides": ["batch_size=2"]})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["format"] == "torchtune" and data["job"]["batch_size"] == 2
    assert data["job"] == read_config(TT / "llama3_2_1B_lora_single_device.yaml",
                                      overrides=["batch_size=2"]).job().model_dump(mode="json")
    est = client.post("/api/v1/estimate", json={"job": data["job"]})
    assert est.status_code == 200
    # nothing is read from disk over HTTP: not the DeepSpeed JSON the config names, no folder
    lf = (LF / "qwen3_full_sft.yaml").read_text()
    r = client.post("/api/v1/framework-config", json={"text": lf, "model": "qwen3-8b"})
    assert r.status_code == 200 and r.json()["job"]["parallel"]["strategy"] == "none"
    assert any("deepspeed" in k for k in r.json()["not_understood"])
    r = client.post("/api/v1/framework-config", json={"text": lf})
    assert r.status_code == 422 and "catalog model" in r.text
    r = client.post("/api/v1/framework-config", json={"text": "a: 1", "model": "/etc/x"})
    assert r.status_code == 422


# --- preflight: the live model and arguments, before the first step --------------------------


class _Config:
    def __init__(self, data: dict):
        self.data = data

    def to_dict(self) -> dict:
        return dict(self.data)


class _Model:
    """What preflight reads of a transformers model (and of a peft one)."""

    def __init__(self, name: str, lora: dict | None = None):
        path = Path(vramplan.__file__).parent / "models" / "configs" / f"{name}.json"
        self.config = _Config(json.loads(path.read_text()))
        if lora is not None:
            self.peft_config, self.active_adapter = {"default": _Config(lora)}, "default"


def test_preflight_matches_the_hand_written_job():
    from vramplan.integrations.preflight import preflight

    args = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "bf16": True,
            "gradient_checkpointing": True}
    lora = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
            "target_modules": ["v_proj", "q_proj"]}
    result = preflight(_Model("llama-3.2-1b", lora), args, seq_len=1024, gpu="L4")
    hand = Job(model="llama-3.2-1b", framework="hf-trainer", batch_size=2, grad_accum=4,
               seq_len=1024, precision="bf16-mixed", checkpointing="full", optimizer_impl="fused",
               gpu="L4", peft=Peft(method="lora", rank=8, alpha=16, dropout=0.0,
                                   target_modules=("q_proj", "v_proj")))
    expected = vramplan.run_engine(hand, "formula")
    assert result.report.categories == expected.categories
    assert result.fits is True and result.fix is None and "fits on L4" in result.message


def test_preflight_warns_or_stops_with_the_fix():
    from vramplan.integrations.preflight import OomRisk, OomRiskWarning, preflight

    args = {"per_device_train_batch_size": 16, "bf16": True}
    with pytest.warns(OomRiskWarning, match="predicted not to fit on L4"):
        result = preflight(_Model("qwen2.5-0.5b"), args, seq_len=2048, gpu="L4")
    assert result.fits is False and "per_device_train_batch_size" in result.fix
    with pytest.raises(OomRisk, match="per_device_train_batch_size"):
        preflight(_Model("qwen2.5-0.5b"), args, seq_len=2048, gpu="L4", on_oom_risk="stop")
    quiet = preflight(_Model("qwen2.5-0.5b"), args, seq_len=2048, on_oom_risk="stop")
    assert quiet.fits is None  # no GPU here and none named: no verdict, no stop
    with pytest.raises(vramplan.JobError, match="on_oom_risk"):
        preflight(_Model("qwen2.5-0.5b"), args, on_oom_risk="panic")


@pytest.mark.torch
@pytest.mark.slow  # builds a real (tiny) transformers model with peft
def test_preflight_on_real_transformers_and_peft_objects(tmp_path):
    import peft
    import transformers

    from tests.tiny_configs import LLAMA
    from vramplan.integrations.hf_trainer import VramplanCallback
    from vramplan.integrations.preflight import OomRisk

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in LLAMA.items() if k != "model_type"}))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                       target_modules=["q_proj", "v_proj"]))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                          per_device_train_batch_size=2)
    result = vramplan.preflight(model, args, seq_len=64, gpu="L4")
    assert result.fits and result.job.peft.method == "lora" and result.job.peft.rank == 4
    assert result.job.peft.target_modules == ("q_proj", "v_proj")
    assert result.job.batch_size == 2 and result.job.precision == "fp32"
    # the callback stops before the first step when asked (a budget the tiny job exceeds)
    big = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                         per_device_train_batch_size=100_000)
    callback = VramplanCallback(tmp_path / "t.json", on_oom_risk="stop", seq_len=64, gpu="T4")
    with pytest.raises(OomRisk, match="per_device_train_batch_size"):
        callback.on_train_begin(big, None, None, model=model)


def test_trl_use_peft_takes_trl_and_peft_defaults(tmp_path):
    """use_peft without lora_* keys: TRL ModelConfig's rank 16 / alpha 32 / dropout 0.05;
    no target_modules: peft's default for the family (q_proj, v_proj)."""
    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nuse_peft: true\nload_in_4bit: true\n"
                    "lora_r: 32\n")
    peft = read_config(path).job().peft
    assert peft == Peft(method="qlora", rank=32, alpha=32.0, dropout=0.05,
                        target_modules=("q_proj", "v_proj"), adapter_dtype="fp32")


@pytest.mark.parametrize("name, strategy", [("trl_fsdp2.yaml", "fsdp"),
                                            ("trl_zero3.yaml", "zero3")])
def test_trl_accelerate_configs(name, strategy):
    cfg = raw(AC / name)
    # accelerate's bf16 under DeepSpeed is DeepSpeed's bf16: fp32 master weights
    precision = "bf16-master" if cfg["distributed_type"] == "DEEPSPEED" else "bf16-mixed"
    hand = Job(model=MODEL, framework="accelerate", precision=precision,
               parallel=Parallel(strategy=strategy, num_gpus=cfg["num_processes"]))
    read = read_config(AC / name, model=MODEL)
    same_estimate(read.job(), hand)
    assert not read.not_understood


EXAMPLES = sorted(p for p in DATA.rglob("*") if p.is_file() and p.name != "SOURCE"
                  and p.name != "llama-2_lora.yml")  # (refused: an 8-bit base)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_key_of_every_example_is_classified(path):
    """Nothing in a shipped config is dropped silently: each of its keys is mapped, ignored
    or not understood (a DeepSpeed JSON it names counts under the key that names it)."""
    from vramplan.frameworks.configs.core import flatten

    read = read_config(path, model=MODEL)
    seen = set(read.mapped) | set(read.ignored) | {k.split("=")[0] for k in read.not_understood}
    for key in flatten(read.content):
        assert key in seen or any(s.startswith((f"{key}.", f"{key}:")) for s in seen), key


def test_headroom_what_if_in_the_files_words(capsys):
    from vramplan.cli.app import main

    path = TT / "llama3_2_1B_lora_single_device.yaml"
    with pytest.raises(SystemExit) as stop:
        main(["headroom", "--config", str(path), "--gpu", "L4", "--what-if",
              "seq_len=4096,batch_size=2"])
    # 21.9 GiB needs more than an L4's usable memory less the 5% margin: exit 1
    assert stop.value.code == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # each what-if variant, in the file's own words (several --what-if give one line each)
    assert last.startswith(f"  seq_len=4096,batch_size=2 in {path.name}: tune run")
    assert "batch_size=2" in last and "tokenizer.max_seq_len=4096" in last


def test_a_change_without_a_key_is_said_not_dropped():
    """LoRA on an accelerate config: accelerate has no key for it (it is the script's)."""
    read = read_config(AC / "fsdp.yaml", model=MODEL)
    before = read.job()
    changes, missing = config_changes(read, before, before.with_changes(
        checkpointing="full", peft=Peft(method="lora")))
    assert changes == {"fsdp_config.fsdp_activation_checkpointing": True}
    assert any(m.startswith("peft.method=lora") for m in missing)
    assert any(m.startswith("peft.target_modules") for m in missing)


def test_torchtitan_global_batch_gives_the_accumulation():
    """train.py: accumulation = global_batch_size // (local_batch_size x DP degree)."""
    path = TI / "llama3_8b.toml"
    job = read_config(path, overrides=["--training.global_batch_size=12",
                                       "--training.local_batch_size=3"]).job()
    assert (job.batch_size, job.grad_accum) == (3, 12 // 3)
    with pytest.raises(ConfigError, match="not a multiple"):
        read_config(path, overrides=["--training.global_batch_size=10",
                                     "--training.local_batch_size=3"])


def test_plan_picks_in_the_files_words(capsys):
    from vramplan.cli.app import main

    path = TT / "qwen2_5_0.5B_full_single_device.yaml"
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--config", str(path), "--tokens", "1B", "--gpus", "L4,A100-80GB"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    tail = out[out.index(f"In {path.name}:"):].strip().splitlines()[1:]
    assert {line.split(" (")[0].strip() for line in tail} == {"cheapest", "fastest",
                                                             "recommended"}
    assert all("tune run <recipe>" in line or line.endswith("as it is") for line in tail)


@pytest.mark.parametrize("name, key, value, saved", [
    ("adapter.json", "modules_to_save", ["embed_tokens", "lm_head"], ("embed_tokens", "lm_head")),
    ("axolotl.yml", "lora_modules_to_save", ["embed_tokens"], ("embed_tokens",)),
    ("llamafactory.yaml", "additional_target", "wte,lm_head", ("embed_tokens", "lm_head")),
])
def test_modules_trained_in_full_beside_lora_are_read(tmp_path, name, key, value, saved):
    """peft trains a full copy of each module_to_save (weights, gradients, states): the
    token embedding and the LM head, by any model's name for them, become the Job's
    peft.modules_to_save; a classifier head is counted with the task; a module vramplan
    would not count is refused; peft's own file names its model."""
    base = {"adapter.json": {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"],
                             "base_model_name_or_path": "meta-llama/Llama-3.2-1B"},
            "axolotl.yml": {"base_model": "meta-llama/Llama-3.2-1B", "adapter": "lora",
                            "micro_batch_size": 1, "sequence_len": 512},
            "llamafactory.yaml": {"model_name_or_path": "meta-llama/Llama-3.2-1B",
                                  "stage": "sft", "finetuning_type": "lora",
                                  "cutoff_len": 512}}[name]
    path = tmp_path / name
    dump = json.dumps if name.endswith(".json") else yaml.safe_dump
    path.write_text(dump({**base, key: value}))
    read = read_config(path)
    assert read.job().peft.modules_to_save == saved and key in read.mapped
    path.write_text(dump({**base, key: "score" if isinstance(value, str) else ["score"]}))
    read = read_config(path)
    assert read.job().model == "llama-3.2-1b" and read.job().peft.modules_to_save == ()
    path.write_text(dump({**base, key: "norm" if isinstance(value, str) else ["norm"]}))
    with pytest.raises(ConfigError, match=f"^{key}: norm would train in full.*not model"):
        read_config(path)


@pytest.mark.parametrize("key, value", [
    ("layer_replication", [[0, 4], [2, 6]]),
    ("target_parameters", ["mlp.experts.gate_up_proj"]),
    ("rank_pattern", {"q_proj": 64}),
])
def test_peft_keys_that_change_memory_unmodelled_are_refused(tmp_path, key, value):
    """These LoraConfig keys were read as irrelevant; set, they change the layers or the
    adapters; at peft's defaults (None, empty) they read as before."""
    base = {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"],
            "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**base, key: value}))
    with pytest.raises(ConfigError, match=f"^{key}: .*does not model"):
        read_config(path)
    path.write_text(json.dumps({**base, key: {} if isinstance(value, dict) else None}))
    read = read_config(path)
    assert key in read.ignored and read.job().peft.rank == 8


def test_dora_is_read_where_peft_runs_it_and_refused_for_torchtunes_own(tmp_path):
    """peft's use_dora, as the Trainer's LoraConfig, Axolotl (peft_use_dora) and
    LLaMA-Factory (use_dora) pass it; torchtune's DoRALinear is another implementation."""
    g = raw(AX / "gemma2_qlora.yml")
    (tmp_path / "dora.yml").write_text(yaml.safe_dump({**g, "peft_use_dora": True}))
    axolotl = read_config(tmp_path / "dora.yml").job()
    assert axolotl.peft.dora and axolotl.peft == read_config(
        AX / "gemma2_qlora.yml").job().peft.model_copy(update={"dora": True})
    folder = _local_model_folder(tmp_path)
    lf = raw(LF / "llama3_lora_sft.yaml")
    (tmp_path / "lf.yaml").write_text(yaml.safe_dump({**lf, "use_dora": True}))
    assert read_config(tmp_path / "lf.yaml", model=str(folder)).job().peft.dora
    hf = json.loads((HF / "adapter_config.json").read_text())
    assert hf["use_dora"] is False
    (tmp_path / "adapter_config.json").write_text(json.dumps({**hf, "use_dora": True}))
    assert read_config(tmp_path / "adapter_config.json", model=MODEL).job().peft.dora
    torchtune = read_config(TT / "llama3_2_1B_lora_single_device.yaml",
                            overrides=["model.use_dora=True"])
    assert not torchtune.job().peft.dora  # said, not modelled as peft's
    assert "model.use_dora=true" in torchtune.not_understood


def test_ligers_fused_loss_is_read_where_the_frameworks_apply_it(tmp_path):
    """use_liger_kernel (Trainer), enable_liger_kernel (LLaMA-Factory) and
    liger_fused_linear_cross_entropy (Axolotl) run Liger's fused linear cross-entropy."""
    g = raw(AX / "gemma2_qlora.yml")
    (tmp_path / "liger.yml").write_text(yaml.safe_dump(
        {**g, "liger_fused_linear_cross_entropy": True, "liger_rms_norm": True}))
    axolotl = read_config(tmp_path / "liger.yml")
    assert axolotl.job().loss == "chunked:liger"
    assert "liger_rms_norm" in axolotl.not_understood  # counted as eager: said
    folder = _local_model_folder(tmp_path)
    lf = raw(LF / "llama3_lora_sft.yaml")
    (tmp_path / "lf.yaml").write_text(yaml.safe_dump({**lf, "enable_liger_kernel": True}))
    assert read_config(tmp_path / "lf.yaml", model=str(folder)).job().loss == "chunked:liger"
    trl = raw(HF / "trl_example_config.yaml")
    (tmp_path / "trl.yaml").write_text(yaml.safe_dump({**trl, "use_liger_kernel": True}))
    assert read_config(tmp_path / "trl.yaml", model=MODEL).job().loss == "chunked:liger"


def test_shard_grad_op_is_fsdp_kept_gathered_and_its_fix_is_full_shard():
    """torch FSDP's SHARD_GRAD_OP shards the parameters too (not DeepSpeed's ZeRO-2): fsdp
    without resharding after forward, from accelerate's FSDP1 and FSDP2 keys and a Trainer's
    fsdp words; make-it-fit's "reshard after forward" is written back as FULL_SHARD."""
    from vramplan.frameworks.configs.read import read_config_text
    from vramplan.planning.techniques import TECHNIQUES

    text = (AC / "fsdp.yaml").read_text().replace("FULL_SHARD", "SHARD_GRAD_OP")
    read = read_config_text(text, model=MODEL)
    par = read.job().parallel
    assert (par.strategy, par.reshard_after_forward) == ("fsdp", False)
    two = read_config_text(text.replace("fsdp_sharding_strategy: SHARD_GRAD_OP",
                                        "fsdp_version: 2\n  fsdp_reshard_after_forward: false"),
                           model=MODEL).job().parallel
    assert (two.strategy, two.reshard_after_forward) == ("fsdp", False)
    hybrid = read_config_text(text.replace("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2"),
                              model=MODEL).job().parallel
    assert (hybrid.strategy, hybrid.reshard_after_forward) == ("hybrid-shard", False)
    hf = read_config_text('{"output_dir": "o", "fsdp": "shard_grad_op auto_wrap"}',
                          path=Path("args.json"), model=MODEL).job().parallel
    assert (hf.strategy, hf.reshard_after_forward) == ("fsdp", False)
    # the fix: FSDP that reshards after forward, in the file's own key
    before = read.job()
    reshard = next(t for t in TECHNIQUES if t.name == "reshard after forward")
    after = reshard.applied(before)
    assert after.parallel.reshard_after_forward and after.parallel.strategy == "fsdp"
    assert reshard.applied(after) is None  # nothing left to reshard
    changes, missing = config_changes(read, before, after)
    assert changes == {"fsdp_config.fsdp_sharding_strategy": "FULL_SHARD"} and not missing
    # and it fits in less: the gathered weights no longer wait for backward
    assert vramplan.estimate(after).peak_allocated < vramplan.estimate(before).peak_allocated


def test_torchao_adamw_8bit_is_its_own_optimizer_in_both_readers():
    from vramplan.frameworks.configs.read import read_config_text

    hf = read_config_text('{"output_dir": "o", "optim": "adamw_torch_8bit"}',
                          path=Path("args.json"), model=MODEL).job()
    bnb = read_config_text('{"output_dir": "o", "optim": "adamw_bnb_8bit"}',
                           path=Path("args.json"), model=MODEL).job()
    assert (hf.optimizer, bnb.optimizer) == ("adamw-8bit-torchao", "adamw-8bit")
    text = (TT / "llama3_2_3B_full_single_device.yaml").read_text().replace(
        "bitsandbytes.optim.PagedAdamW8bit", "torchao.optim.AdamW8bit")
    assert read_config_text(text).job().optimizer == "adamw-8bit-torchao"


@pytest.mark.parametrize("fsdp, config, strategy, reshard, checkpointing, offload", [
    # transformers 5: fsdp=True, the rest in fsdp_config (FSDP2 unless version 1)
    (True, {"reshard_after_forward": False, "activation_checkpointing": True}, "fsdp", False,
     "full", False),
    (True, {"fsdp_version": 2, "fsdp_cpu_offload": True}, "fsdp", True, "none", True),
    (True, {"version": 1, "reshard_after_forward": "shard_grad_op"}, "fsdp", False, "none",
     False),
    # a legacy word and an FSDP2 config: the config's value wins (the Trainer's setdefault)
    ("shard_grad_op", {"reshard_after_forward": True}, "fsdp", True, "none", False),
    # fsdp_config without fsdp: the Trainer reads none of it
    (None, {"reshard_after_forward": False}, "none", True, "none", False),
])
def test_trainer_fsdp_config_keys(fsdp, config, strategy, reshard, checkpointing, offload):
    from vramplan.frameworks.configs.read import read_config_text

    args = {"output_dir": "o", "fsdp_config": config, **({"fsdp": fsdp} if fsdp else {})}
    read = read_config_text(json.dumps(args), path=Path("args.json"), model=MODEL)
    job = read.job()
    assert (job.parallel.strategy, job.parallel.reshard_after_forward) == (strategy, reshard)
    assert (job.checkpointing, job.offload.params) == (checkpointing, offload)
    assert not read.not_understood


def test_trainer_fsdp2_reshard_fix_is_written_to_its_fsdp_config():
    from vramplan.frameworks.configs.read import read_config_text
    from vramplan.planning.techniques import TECHNIQUES

    args = {"output_dir": "o", "fsdp": True, "fsdp_config": {"reshard_after_forward": False}}
    read = read_config_text(json.dumps(args), path=Path("args.json"), model=MODEL)
    before = read.job()
    after = next(t for t in TECHNIQUES if t.name == "reshard after forward").applied(before)
    changes, missing = config_changes(read, before, after)
    assert changes == {"fsdp_config.reshard_after_forward": True} and not missing
    patched = json.loads(patched_text(read, changes))
    assert patched["fsdp_config"] == {"reshard_after_forward": True} and patched["fsdp"] is True


@pytest.mark.parametrize("block, strategy, reshard, offload", [
    # FSDP2 block of axolotl's current examples: its own keys, no fsdp_ prefix
    ("fsdp_version: 2\nfsdp_config:\n  offload_params: false\n  reshard_after_forward: false\n"
     "  auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
     "  transformer_layer_cls_to_wrap: LlamaDecoderLayer\n", "fsdp", False, False),
    # the deprecated list and fsdp_-prefixed keys (schemas/validation.py drops the prefix)
    ("fsdp:\n  - shard_grad_op\n  - auto_wrap\nfsdp_config:\n  fsdp_offload_params: true\n"
     "  fsdp_state_dict_type: FULL_STATE_DICT\n", "fsdp", False, True),
    ("fsdp_config:\n", "none", True, False),  # a null block: no FSDP
])
def test_axolotl_fsdp(block, strategy, reshard, offload):
    from vramplan.frameworks.configs.read import read_config_text

    text = (AX / "llama-3_fft-8b.yaml").read_text().replace(
        "optimizer: paged_adamw_8bit", "optimizer: adamw_torch") + "\n" + block
    read = read_config_text(text, path=Path("axolotl.yaml"))
    job = read.job()
    assert (job.parallel.strategy, job.parallel.reshard_after_forward) == (strategy, reshard)
    assert job.offload.params == offload and not read.not_understood
    if not reshard and strategy == "fsdp":  # the fix, written to fsdp_config
        from vramplan.planning.techniques import TECHNIQUES

        after = next(t for t in TECHNIQUES if t.name == "reshard after forward").applied(job)
        changes, missing = config_changes(read, job, after)
        assert changes == {"fsdp_config.reshard_after_forward": True} and not missing


def test_llama_factory_reads_the_trainers_fsdp_keys():
    """LLaMA-Factory files carry TrainingArguments: fsdp and fsdp_config as the Trainer
    reads them (they set no strategy before)."""
    from vramplan.frameworks.configs.read import read_config_text

    text = (LF / "qwen3_full_sft_fsdp2.yaml").read_text()
    assert read_config_text(text, path=Path("lf.yaml")).job().parallel.strategy == "none"
    words = read_config_text(text + "\nfsdp: shard_grad_op\n", path=Path("lf.yaml")).job()
    assert (words.parallel.strategy, words.parallel.reshard_after_forward) == ("fsdp", False)
    block = read_config_text(text + "\nfsdp: true\nfsdp_config:\n  activation_checkpointing: "
                             "true\n", path=Path("lf.yaml")).job()
    assert (block.parallel.strategy, block.checkpointing) == ("fsdp", "full")


def test_trainer_fsdp1_reshard_fix_is_spelt_as_its_strategy():
    from vramplan.frameworks.configs.read import read_config_text
    from vramplan.planning.techniques import TECHNIQUES

    args = {"output_dir": "o", "fsdp": True,
            "fsdp_config": {"version": 1, "reshard_after_forward": "shard_grad_op"}}
    read = read_config_text(json.dumps(args), path=Path("args.json"), model=MODEL)
    before = read.job()
    after = next(t for t in TECHNIQUES if t.name == "reshard after forward").applied(before)
    changes, missing = config_changes(read, before, after)
    assert changes == {"fsdp_config.reshard_after_forward": "full_shard"} and not missing
