"""Published training runs as vramplan Jobs: what each row of benchmarks/data/published_runs/
states, turned into a Job, a GPU and a measured tokens/s per GPU.

The rows come from public benchmark tables (llm-foundry, Megatron-LM, NeMo / Megatron-Bridge;
see benchmarks/data/published_runs/README.md). Where a row leaves a setting unstated, the
choice made here is written in `assumed` of the case and in the table below, the same for
every row of that source:

  * micro-batch not stated (Megatron-LM tables): 1, the Megatron-LM default
    (`--micro-batch-size`, arguments.py);
  * checkpointing not stated (Megatron-LM 2024, NeMo): none (NeMo's performance recipes turn
    recompute on only where they say so);
  * precision not stated (Megatron-LM 2024): bf16 (its MFU is against the bf16 peak);
  * Megatron-LM 2021 (Narayanan et al. 2021): only TP x PP is stated; TP fills the 8-GPU
    node first (TP = min(8, TP x PP)), as in that paper's configurations;
  * Megatron / NeMo data parallelism: the distributed optimizer (ZeRO-1 layout, `zero1`),
    the NeMo performance recipes' default; Megatron-LM 2021 had none: plain data parallelism
    (`ddp`) whose gradient all-reduce runs after the whole backward (`--DDP-impl local`,
    megatron/training.py train_step at fda81a212b73, May 2021), not overlapped; the 2024
    table's gradient reduce overlaps as its `--overlap-grad-reduce` says;
  * interleaved pipelines: `virtual_pp` model chunks per GPU;
  * Megatron-LM 2021 (Narayanan et al.) predates FlashAttention: eager attention;
  * KempnerForge skips FSDP's gradient reduce-scatter on all but a step's last micro-batch
    (kempnerforge/training/grad.py maybe_no_sync: set_requires_gradient_sync(False), at the
    report's code 01b461a): parallel.fsdp_no_sync;
  * Megatron-LM (2024) and NeMo attend with Transformer Engine's fused attention, cuDNN's
    kernel, on every Hopper and Blackwell GPU (GB300's compute capability 10.3 included,
    where torch's SDPA would not take it);
  * Megatron-LM and NeMo run fused kernels (Transformer Engine, Apex): their memory-bound
    work is timed as vramplan times compiled blocks (`compile`: one kernel per fused chain).

Rows we collected ourselves (lambda-bert, olmo-core, bigscience, flash-attention, llm.c,
llama3-paper, nvidia-bert, qwen1-finetune, answerai-fsdp-qlora, vectorlm, fms-fsdp,
optimum-benchmark; see
`_COLLECTED` below)
state their GPU as a catalog name (`catalog_gpu`) or a family here, and:

  * Lambda's BERT-large SQuAD: the catalog bert-large-uncased with its sequence-classification
    head (the QA head, 2 logits per token, is as small); the 2019 BERT code: eager attention;
  * fused-kernel stacks (Megatron-DeepSpeed, flash-attention's fused MLP / dropout-add-LN,
    llm.c's CUDA kernels) are timed as compiled blocks, as Megatron-LM and NeMo are;
  * BLOOM's Megatron-DeepSpeed of 2022 predates FlashAttention in it: eager attention; its
    DeepSpeed pipeline engine reduces the gradients after the schedule's last micro-batch
    (deepspeed/runtime/pipe/schedule.py TrainSchedule: ReduceGrads, then OptimizerStep):
    not overlapped;
  * BLOOM ran on Jean Zay, whose nodes join through 4 Omni-Path links (the catalog's A100
    node: 8 x 200 Gb/s InfiniBand); its rows take the network the source measured there
    (`network`: parallel.network_gb_s);
  * Llama 3 405B (its paper's Table 4): FSDP that keeps parameters gathered after forward
    (parallel.reshard_after_forward off; under its pipeline, one all-gather per schedule);
    fused kernels; micro-batch 1 and plain 1F1B where the table is silent;
  * OLMo-core's 32B checkpoints only the MLP of each block: full checkpointing (the MLP is
    ~80% of its block's FLOPs); llm.c's GeLU-only recompute: none;
  * NVIDIA's own BERT tables (nvidia-bert) run Lambda's code: the same mapping; their fp32
    rows step with BertAdam (a Python loop: optimizer_impl loop), fp16 with Apex FusedAdam;
    TF32 rows are fp32 with tf32 (fp32 matmuls at the TF32 tensor-core rate);
  * fine-tuning rows (Qwen's LoRA profile, Answer.AI's fsdp_qlora) take LoRA / QLoRA (and
    Qwen's LoRA (emb) its modules_to_save) from techniques.peft and FSDP CPU offload
    (parameters, gradients and the optimizer step on the CPU) from techniques.offload; Qwen 1
    is a qwen2 block; torch's default AdamW (foreach);
    FSDP FULL_SHARD is fsdp, NO_SHARD is ddp;
  * fms-fsdp's Llama 2 benchmark: FSDP1 (HSDP for 7B) with bf16 MixedPrecision, reducing
    the gradients in bf16 (parallel.grad_reduce_dtype compute), the whole model compiled and
    the loss outside it (compile_components "blocks"), SDPA's FlashAttention-2; its
    "400 / 800 Gbps" network read as per node;
  * VectorLM's Llama 3 8B benchmark (HF model, FSDP1 FULL_SHARD, pure bf16, flash-attention-2,
    full checkpointing) accumulates 4 micro-batches under no_sync (parallel.fsdp_no_sync) and
    reports the median micro-batch (published_accuracy.py _one_micro_batch).
  * optimum-benchmark's Llama 2 fine-tuning (HF Trainer, one GPU): pure fp16 timed as
    bf16-pure, eager attention, LoRA's adapters in the model's dtype and QLoRA's in fp32 (peft
    casts adapters to a floating-point base weight's dtype only), torch's default AdamW.

Measured tokens/s per GPU: as published where the row gives it; sequences/s (Lambda) times the
sequence over the GPUs; a step time (BLOOM, llm.c) as global batch x sequence / step / GPUs;
for rows that give MFU (Megatron-LM), the published TFLOP/s per GPU divided by that source's own
FLOPs per token.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from vramplan.job import MASTER_OF, Job

DATA = Path(__file__).parent / "data" / "published_runs"
_CONFIGS = Path(tempfile.mkdtemp(prefix="vramplan-published-"))

# the catalog GPU each row's GPU is
GPUS = {"A100-40": "A100-40GB", "A100-80": "A100-80GB", "H100": "H100-SXM", "H200": "H200",
        "B200": "B200",
        "GB200": "GB200", "GB300": "GB300"}
# NeMo's model names -> catalog models (same shapes as the row's model_config)
# (names compared in upper case without '-', '_' and '.')
CATALOG = {"LLAMA38B": "llama-3.1-8b", "LLAMA370B": "llama-3.1-70b",
           "LLAMA31405B": "llama-3.1-405b", "LLAMA27B": "llama-2-7b", "LLAMA270B": "llama-2-70b"}


# the files we collected from other public sources (README.md of that folder)
COLLECTED_FILES = ("lambda_bert_squad.jsonl", "olmocore_throughput.jsonl",
                   "bigscience_bloom.jsonl", "flashattention_gpt3.jsonl", "llmc_gpt2.jsonl",
                   "llama3_paper.jsonl", "lambda_bert_squad_more.jsonl", "nvidia_bert_squad.jsonl",
                   "qwen1_lora_profile.jsonl", "answerai_fsdp_qlora.jsonl",
                   "vectorlm_throughput.jsonl", "fmsfsdp_throughput.jsonl",
                   "optimum_benchmark_llamas.jsonl")
# their source groups: which ran fused kernels (timed as compiled blocks) and which attention
_COLLECTED = {"lambda-bert": {"fused": False, "attention": "eager"},
              "olmo-core": {"fused": False, "attention": "sdpa"},
              # Megatron-DeepSpeed in 2022: no sequence parallelism (tr11-176B-ml.slurm passes
              # no --sequence-parallel)
              "bigscience": {"fused": True, "attention": "eager", "sequence_parallel": False},
              "flash-attention": {"fused": True, "attention": "flash-attn-2"},
              "llm.c": {"fused": True, "attention": "sdpa"},
              "llama3-paper": {"fused": True, "attention": "sdpa"},
              "nvidia-bert": {"fused": False, "attention": "eager"},
              "qwen1-finetune": {"fused": False, "attention": "sdpa"},
              "answerai-fsdp-qlora": {"fused": False, "attention": "sdpa"},
              # HF's attn_implementation flash_attention_2 (vectorlm/utils/model_utils.py)
              "vectorlm": {"fused": False, "attention": "flash-attn-2"},
              # fms LLaMA's SDPA (FlashAttention-2's kernel on A100 and, before torch 2.5, H100)
              "fms-fsdp": {"fused": False, "attention": "flash-attn-2"},
              # transformers 4.33 / 4.35 LlamaAttention: no SDPA for Llama yet
              "optimum-benchmark": {"fused": False, "attention": "eager"}}


def _catalog_name(model: str) -> str | None:
    return CATALOG.get(re.sub(r"[-_.]", "", model.upper()))


# Sources whose 16-bit training keeps the model itself in 16-bit with fp32 master weights in
# the optimizer (vramplan's bf16-mixed / fp16-mixed are autocast over fp32 weights): Megatron-
# Core's Float16Module (Megatron-LM, NeMo; megatron/core/transformer/module.py), Megatron-
# DeepSpeed's bf16 optimizer (BLOOM), and Apex AMP O2, the fp16 path of NVIDIA's run_squad.py
# that both BERT sources ran (data/published_runs/README.md). Megatron's fp32 main_grad
# buffer differs from the master precisions' 16-bit gradients: published_accuracy.py drops
# the per-micro-batch gradient adds it fuses.
_MEGATRON_CORE = ("megatron-lm", "nemo", "bigscience", "llama3-paper")
# Megatron-LM's cross-entropy is fused only with --cross-entropy-loss-fusion (opt-in at
# f2e5db402c44, megatron/training/arguments.py; its tables state no such flag) and
# Megatron-DeepSpeed's (BLOOM) has no fused one: their rows run the loss eager
# (compile_components "blocks"), its bytes as Megatron's code moves them
# (published_accuracy.py _megatron_loss). NeMo's and the Llama 3 paper's are left fused.
UNFUSED_LOSS = ("megatron-lm", "bigscience")
# sources that compile (or fuse) the model's blocks and run the loss eager outside them:
# those, and fms-fsdp (torch.compile of the model; train_utils.py's nn.CrossEntropyLoss)
EAGER_LOSS = (*UNFUSED_LOSS, "fms-fsdp")
MASTER_WEIGHT_GROUPS = {"bf16-mixed": _MEGATRON_CORE,
                        "fp16-mixed": (*_MEGATRON_CORE, "lambda-bert", "nvidia-bert")}


@dataclass
class Case:
    id: str
    source: str          # source group: llm-foundry, megatron-lm, nemo, ...
    job: Job | None
    gpu: str
    measured_tokens_per_s_per_gpu: float
    assumed: list[str] = field(default_factory=list)
    skipped: str = ""    # why vramplan cannot express the row (empty when it can)
    attention_kernel: str = ""  # "triton": llm-foundry's Triton FlashAttention


def load_rows() -> list[dict]:
    """Every row once (the full llm-foundry file repeats 36 rows of the dev file)."""
    rows: dict[str, dict] = {}
    for name in ("throughput_dev.jsonl", "llmfoundry_mpt_full.jsonl", "kempnerforge_mfu.jsonl",
                 *COLLECTED_FILES):
        for line in (DATA / name).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                row.setdefault("source_group", row.get("group"))
                rows.setdefault(row["id"], row)
    return list(rows.values())


def _config(name: str, config: dict) -> str:
    # the name carries a digest of the config: two sources' models of the same shape family
    # (KempnerForge's and OLMo-core's Llama-3 8B) may differ in a key and must not share a file
    text = json.dumps(config, sort_keys=True)
    path = _CONFIGS / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(text)
    return str(path)


def _gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int, ffn: int | None = None):
    """A GPT-2-style block (learned positions, LayerNorm, GELU MLP, biases, tied embeddings):
    Megatron-LM's GPT and NeMo's GPT-3."""
    cfg = {"model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": heads,
           "vocab_size": vocab, "n_positions": max(seq, 1024)}
    if ffn:
        cfg["n_inner"] = ffn
    return _config(f"gpt-{layers}-{hidden}-{heads}-{vocab}-{seq}-{ffn}", cfg)


def _nemotron(mc: dict, seq: int) -> str:
    """Nemotron-4 340B (transformers' NemotronConfig: squared-ReLU MLP, GQA, rotary)."""
    cfg = {"model_type": "nemotron", "num_hidden_layers": mc["layers"],
           "hidden_size": mc["hidden"], "num_attention_heads": mc["heads"],
           "num_key_value_heads": mc["kv_heads"], "intermediate_size": mc["ffn"],
           "vocab_size": mc["vocab"], "max_position_embeddings": max(seq, 4096),
           "hidden_act": "relu2", "tie_word_embeddings": False}
    return _config("nemotron-340b", cfg)


def _llama(mc: dict, seq: int) -> str:
    """A Llama-3-style model from its shapes (KempnerForge's configs/model/llama_*.toml)."""
    cfg = {"model_type": "llama", "num_hidden_layers": mc["layers"], "hidden_size": mc["hidden"],
           "num_attention_heads": mc["heads"], "num_key_value_heads": mc["kv_heads"],
           "intermediate_size": mc["ffn"], "vocab_size": mc["vocab"],
           "max_position_embeddings": max(seq, 4096), "rope_theta": 500000.0,
           "tie_word_embeddings": False, "hidden_act": "silu"}
    return _config(f"llama-{mc['layers']}-{mc['hidden']}-{mc['ffn']}", cfg)


def _mpt(mc: dict, seq: int) -> str:
    """llm-foundry's MPT as scripts/train/yamls/pretrain/mpt-*.yaml builds it (commit 8c8dd48f:
    attn_impl flash, and MPTConfig's defaults: learned positions, biases, tied embeddings)."""
    cfg = {"model_type": "mpt", "d_model": mc["d_model"], "n_heads": mc["n_heads"],
           "n_layers": mc["n_layers"], "expansion_ratio": mc.get("expansion_ratio", 4),
           "vocab_size": mc["vocab"], "max_seq_len": seq, "no_bias": False,
           "learned_pos_emb": True, "attn_config": {"alibi": False, "attn_impl": "flash"},
           "tie_word_embeddings": True}
    return _config(f"mpt-{mc['n_layers']}-{mc['d_model']}-{seq}", cfg)


def _olmo2(mc: dict, seq: int) -> str:
    """OLMo 2 (transformers' Olmo2Config: Llama block, norms after attention and MLP, QK-norm)
    from OLMo-core's TransformerConfig.olmo2_* shapes."""
    cfg = {"model_type": "olmo2", "num_hidden_layers": mc["layers"], "hidden_size": mc["hidden"],
           "num_attention_heads": mc["heads"], "num_key_value_heads": mc["kv_heads"],
           "intermediate_size": mc["ffn"], "vocab_size": mc["vocab"],
           "max_position_embeddings": max(seq, 4096), "rope_theta": 500000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6}
    return _config(f"olmo2-{mc['layers']}-{mc['hidden']}-{mc['ffn']}", cfg)


def _qwen2(mc: dict, seq: int) -> str:
    """A Qwen-2-style block (transformers' Qwen2Config: Llama block with q/k/v biases) from a
    row's shapes: Qwen 1 (QwenLM/Qwen) has the same layout with fused c_attn."""
    cfg = {"model_type": "qwen2", "num_hidden_layers": mc["layers"], "hidden_size": mc["hidden"],
           "num_attention_heads": mc["heads"], "num_key_value_heads": mc["kv_heads"],
           "intermediate_size": mc["ffn"], "vocab_size": mc["vocab"],
           "max_position_embeddings": max(seq, 8192), "rope_theta": 10000.0,
           "tie_word_embeddings": bool(mc.get("tie_embeddings")), "hidden_act": "silu",
           "rms_norm_eps": 1e-6}
    return _config(f"qwen2-{mc['layers']}-{mc['hidden']}-{mc['ffn']}", cfg)


def _decoder(mc: dict, seq: int) -> str:
    """A Llama / Mistral decoder from a row's shapes (Yi 34B is a Llama; Mistral 7B v0.2
    has no sliding window)."""
    kind = mc.get("model_type", "llama")
    cfg = {"model_type": kind, "num_hidden_layers": mc["layers"], "hidden_size": mc["hidden"],
           "num_attention_heads": mc["heads"], "num_key_value_heads": mc["kv_heads"],
           "intermediate_size": mc["ffn"], "vocab_size": mc["vocab"],
           "max_position_embeddings": max(seq, 4096), "rope_theta": mc.get("rope_theta", 10000.0),
           "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-5}
    if kind == "mistral":
        cfg["sliding_window"] = mc.get("sliding_window")
    return _config(f"{kind}-{mc['layers']}-{mc['hidden']}-{mc['ffn']}", cfg)


def _collected_peft(tech: dict) -> dict | None:
    """LoRA / QLoRA as a collected row's techniques.peft states it."""
    peft = tech.get("peft")
    if not isinstance(peft, dict):
        return None
    keys = ("method", "rank", "alpha", "dropout", "target_modules", "double_quant",
            "adapter_dtype")
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in peft.items() if k in keys}
    if peft.get("modules_to_save"):  # the model's own names (Qwen's wte): Job reads them
        out["modules_to_save"] = tuple(peft["modules_to_save"])
    return out


def _collected_model(row: dict, seq: int) -> str:
    """The model of a row we collected: a catalog name or a config.json from its shapes."""
    group, mc = row["source_group"], row["model_config"]
    if group in ("lambda-bert", "nvidia-bert"):
        return "bert-base-uncased" if row["model"].startswith("BERT-base") else "bert-large-uncased"
    if group == "llama3-paper":
        return "llama-3.1-405b"
    if group == "olmo-core":
        return _olmo2(mc, seq) if mc["arch"] == "olmo2" else _llama(mc, seq)
    if group == "qwen1-finetune":
        return _qwen2(mc, seq)
    if group in ("answerai-fsdp-qlora", "vectorlm", "fms-fsdp", "optimum-benchmark"):
        return mc.get("catalog") or _decoder(mc, seq)
    # BLOOM (ALiBi instead of learned positions: 0.02% of its parameters), flash-attention's
    # GPT-3 sizes and llm.c's GPT-2: GPT-2 blocks
    return _gpt(mc["layers"], mc["hidden"], mc["heads"], mc["vocab"], seq)


# FSDP that keeps each unit gathered from its forward to its backward (torch's
# SHARD_GRAD_OP; the Llama 3 paper's FSDP "without resharding"): strategy fsdp with
# parallel.reshard_after_forward off
NO_RESHARD = "fsdp without resharding"


def _collected_strategy(row: dict, dp: int) -> str:
    """Data parallelism as each collected source states it."""
    group, par = row["source_group"], row.get("parallelism") or {}
    if dp == 1:
        return "none"
    if group == "olmo-core":  # HSDP sharding within a node; the 32B shards over 32 GPUs
        return "hybrid-shard" if "one replica per node" in str(par.get("fsdp_strategy")) else "fsdp"
    if par.get("fsdp_strategy") == "FULL_SHARD":
        return "fsdp"
    if par.get("fsdp_strategy") == "HYBRID_SHARD":  # sharded in a node, replicated across
        return "hybrid-shard"
    optimizer = str((row.get("techniques") or {}).get("optimizer"))
    if "without resharding" in optimizer:  # Llama 3: parameters stay gathered after forward
        return NO_RESHARD
    return "zero1" if "ZeRO-1" in optimizer else "ddp"


# Megatron-LM 2021 (Narayanan et al. 2021, Table 1): heads and layers by hidden size
_MEGATRON_2021 = {2304: (24, 24), 3072: (32, 30), 4096: (32, 36), 6144: (48, 40),
                  8192: (64, 48), 10240: (80, 60), 12288: (96, 80), 16384: (128, 96),
                  20480: (128, 105), 25600: (160, 128)}
_NEMO_GPT = {"GPT3-5B": (24, 4096, 32), "GPT3-175B": (96, 12288, 96)}


def _gpu(row: dict) -> str:
    if row.get("catalog_gpu"):
        return row["catalog_gpu"]
    family, text = row["gpu_family"], row["gpu"]
    if family == "A100":
        return GPUS["A100-40" if "40GB" in text else "A100-80"]
    return GPUS[family]


def _measured(row: dict, seq: int) -> float:
    if row["metric"] == "tokens_per_s_per_gpu":
        return float(row["value"])
    if row["metric"] == "samples_per_s":
        return float(row["value"]) * seq / int(row["num_gpus"])
    if row["metric"] == "step_time_s":
        return int(row["global_batch"]) * seq / float(row["value"]) / int(row["num_gpus"])
    mc = row["model_config"]
    tflops = (row.get("also_reported") or {}).get("model_tflops_per_gpu") or (
        row.get("also_reported") or {}).get("achieved_tflops_per_gpu")
    h = mc["hidden"]
    layers = mc["layers"] if isinstance(mc["layers"], int) else _MEGATRON_2021[h][1]
    vocab = mc["vocab"]
    if "WITH recomputation" in row["unit"]:
        # Narayanan et al. 2021, eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh) per batch
        per_token = 96 * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))
    else:
        # Megatron-LM training.py num_floating_point_operations (GPT, 4h MLP, MHA):
        # 12 l h^2 (6 + s/h + V/(2 l h)) per token
        per_token = 12 * layers * h * h * (6 + seq / h + vocab / (2 * layers * h))
    return tflops * 1e12 / per_token


def _collected_kernels(row: dict, assumed: list[str]) -> tuple[bool, str]:
    """(compiled, attention) of a collected row: fused-kernel stacks time as compiled blocks."""
    kind = _COLLECTED[row["source_group"]]
    if kind["fused"]:
        assumed.append("the source's fused kernels timed as compiled blocks")
    compiled = kind["fused"] or bool((row.get("techniques") or {}).get("compile"))
    return compiled, kind["attention"]


# sources that step with torch's AdamW as constructed by default (foreach on CUDA): HF
# Trainer's adamw_torch (Qwen's finetune.py), fsdp_qlora's optim.AdamW, VectorLM's and
# fms-fsdp's AdamW
_FOREACH = ("llm-foundry", "qwen1-finetune", "answerai-fsdp-qlora", "vectorlm", "fms-fsdp",
            "optimum-benchmark")
# torch's CUDA major (Runtime.torch_cuda: the foreach / fused optimizers' launches per op):
# a row's own where it states it, else 12 for every source that ran before CUDA 13 (August
# 2025; CUDA 11 builds share 12's launch limits); KempnerForge's 2026 report states none:
# the Job's default
_TORCH_CUDA_UNSTATED = ("kempnerforge",)
# sources whose micro-batches accumulate without FSDP's gradient reduce-scatter (no_sync)
_FSDP_NO_SYNC = ("kempnerforge", "vectorlm")


def _optimizer_impl(group: str, tech: dict) -> str:
    """BERT's fp32 runs step with BertAdam, a Python loop over the parameters."""
    if group in _FOREACH:
        return "foreach"
    return "loop" if "BertAdam" in str(tech.get("optimizer")) else "fused"


def case(row: dict) -> Case:
    """The Job of one published row (see the module docstring for the choices)."""
    group = row["source_group"]
    seq = int(row["seq_len"])
    par = dict(row.get("parallelism") or {})
    tech = row.get("techniques") or {}
    n = int(row["num_gpus"])
    # Megatron-LM's 2021 table (its FLOPs count the recomputation)
    megatron_2021 = "WITH recomputation" in str(row.get("unit"))
    assumed: list[str] = []
    precision_text = str(row.get("precision"))
    if tech.get("float8") or precision_text.startswith("fp8"):
        precision = "fp8"
    elif precision_text.startswith("fp16"):
        precision = "fp16-mixed"
    elif precision_text.startswith("tf32"):
        precision = "fp32"  # with tf32 (below)
    elif precision_text.startswith("fp32"):
        precision = "fp32"
    elif precision_text.startswith("pure bf16"):
        precision = "bf16-pure"
    elif precision_text.startswith("pure fp16"):
        # vramplan has no pure-fp16 precision: bf16-pure moves the same bytes and runs at
        # the same tensor-core rate on every GPU such a row ran on (catalog fp16 = bf16)
        precision = "bf16-pure"
        assumed.append("pure fp16 timed as bf16-pure")
    else:
        precision = "bf16-mixed"
        if "not stated" in precision_text:
            assumed.append("precision bf16")
    if group in MASTER_WEIGHT_GROUPS.get(precision, ()):
        precision = MASTER_OF[precision]
    tp = int(par.get("tp") or 1)
    pp = int(par.get("pp") or 1)
    cp = int(par.get("cp") or 1)
    if par.get("model_parallel_total"):
        total = int(par["model_parallel_total"])
        tp, pp = min(8, total), max(1, total // 8)
        assumed.append(f"TP {tp} x PP {pp} (only TP x PP = {total} stated)")
    dp = n // (tp * pp * cp)
    micro = row.get("micro_batch")
    if micro is None:
        micro = 1
        assumed.append("micro-batch 1")
    micro = int(micro)
    grad_accum = max(1, round(int(row["global_batch"]) / (micro * dp)))
    ckpt_text = str(tech.get("checkpointing"))
    checkpointing = "full" if ckpt_text.startswith("full") else "none"
    if group == "olmo-core" and ckpt_text.startswith("selective"):
        checkpointing = "full"
        assumed.append("full checkpointing (the source checkpoints each block's MLP only)")
    if "not stated" in ckpt_text:
        assumed.append("no checkpointing")
    if group == "llm-foundry":
        strategy = NO_RESHARD if par.get("fsdp_strategy") == "SHARD_GRAD_OP" else "fsdp"
    elif group == "kempnerforge":
        strategy = "fsdp" if par.get("fsdp") else "none"
    elif group in _COLLECTED:
        strategy = _collected_strategy(row, dp)
    elif dp > 1 and megatron_2021:
        strategy = "ddp"  # no distributed optimizer yet (the module docstring)
    elif dp > 1:
        strategy = "zero1"
        assumed.append("distributed optimizer (zero1)")
    else:
        strategy = "none"
    peft = None
    if group == "kempnerforge":
        model = _llama(row["model_config"], seq)
    elif group in _COLLECTED:
        model = _collected_model(row, seq)
    elif row["model"].startswith("MPT"):
        model = _mpt(row["model_config"], seq)
    elif _catalog_name(row["model"]):
        model = _catalog_name(row["model"])
    elif row["model"] == "Nemotron-340B":
        mc = row["model_config"]
        model = _nemotron(mc, seq)
    elif row["model"].startswith("GPT3"):
        layers, h, heads = _NEMO_GPT[row["model"]]
        model = _gpt(layers, h, heads, 50257, seq)
    elif group == "megatron-lm":
        mc = row["model_config"]
        h = mc["hidden"]
        heads, layers = (mc["heads"], mc["layers"]) if isinstance(mc.get("heads"), int) else (
            _MEGATRON_2021[h][0], mc["layers"])
        model = _gpt(layers, h, heads, mc["vocab"], seq)
    else:
        return Case(row["id"], group, None, _gpu(row), 0.0, assumed,
                    skipped=f"model {row['model']} is not in the catalog")
    if group in _COLLECTED:
        peft = _collected_peft(tech)
    elif "lora" in row["id"]:
        # no adapter dropout: Megatron-Bridge's LoRA default (peft/lora.py, LoRA.dropout 0.0)
        peft = {"method": "lora", "target_modules": ("q_proj", "k_proj", "v_proj"),
                "dropout": 0.0}
        assumed.append("LoRA on the attention projections (NeMo's linear_qkv)")
    pipeline = {}
    vpp = par.get("virtual_pp")
    if pp > 1 and vpp and int(vpp) > 1:
        pipeline = {"pipeline_schedule": "interleaved", "pipeline_chunks": min(int(vpp), 64)}
    fused = group in ("megatron-lm", "nemo")
    compiled = fused or bool(tech.get("compile"))
    # Megatron-LM 2021 predates FlashAttention (unfused QK^T and PV with a fused softmax)
    # and Megatron-LM's sequence parallelism (2022): its tensor-parallel ranks keep the norms
    # and residual stream whole
    # (the others: Transformer Engine's fused attention is cuDNN's; llm-foundry's Triton
    # kernel is timed from FlashAttention-2's rate, published_accuracy.py)
    attention = ("eager" if megatron_2021 else "cudnn" if fused and precision != "fp32"
                 else "flash-attn-2" if group == "llm-foundry" else "sdpa")
    if fused:
        assumed.append("Transformer Engine / Megatron fused kernels timed as compiled blocks")
    task = None
    if group in _COLLECTED:
        compiled, attention = _collected_kernels(row, assumed)
        task = "seq-classification" if group in ("lambda-bert", "nvidia-bert") else None
    offload = tech.get("offload") if group in _COLLECTED else None
    offload = offload if isinstance(offload, dict) else {}
    loss_eager = compiled and group in EAGER_LOSS
    if loss_eager and group in UNFUSED_LOSS:
        assumed.append("loss unfused: Megatron's vocab-parallel cross-entropy (its default)")
    job = Job(model=model, batch_size=micro, grad_accum=grad_accum, seq_len=seq, compile=compiled,
              **({"compile_components": "blocks"} if loss_eager else {}),
              offload={"params": bool(offload.get("params")),
                       "optimizer": bool(offload.get("optimizer"))},
              activation_offload=bool(offload.get("activations")),
              attention=attention, task=task,
              precision=precision, tf32=precision_text.startswith("tf32"),
              # OLMo-core's Float8Config gathers FSDP's weights in float8 by default
              # (src/olmo_core/float8/__init__.py at eaecf879: enable_fsdp_float8_all_gather
              # = True, precompute_float8_dynamic_scale_for_fsdp = True)
              **({"fp8": {"fsdp_float8_all_gather": True}}
                 if group == "olmo-core" and precision == "fp8" else {}),
              checkpointing=checkpointing, peft=peft,
              optimizer_impl=_optimizer_impl(group, tech),
              **({} if group in _TORCH_CUDA_UNSTATED
                 else {"runtime": {"torch_cuda": int(row.get("torch_cuda", 12))}}),
              parallel={"strategy": "fsdp" if strategy == NO_RESHARD else strategy,
                        "reshard_after_forward": strategy != NO_RESHARD,
                        "num_gpus": n, "tensor_parallel": tp,
                        "pipeline_parallel": pp, "context_parallel": cp,
                        "async_tp": "--tp-comm-overlap" in str(tech.get("other")), **pipeline,
                        "overlap_grad_reduce": not (megatron_2021 or group == "bigscience"),
                        # KempnerForge and VectorLM reduce-scatter a step's last micro-batch
                        "fsdp_no_sync": group in _FSDP_NO_SYNC and strategy == "fsdp",
                        # fms-fsdp's bfSixteen MixedPrecision reduces in bf16
                        # (fms_fsdp/policies/mixed_precision.py reduce_dtype=torch.bfloat16)
                        **({"grad_reduce_dtype": "compute"} if group == "fms-fsdp" else {}),
                        "sequence_parallel": not megatron_2021 and _COLLECTED.get(
                            group, {}).get("sequence_parallel", True),
                        # a row's own node size where it states one, else the catalog GPU's
                        **({"gpus_per_node": int(row["gpus_per_node"])}
                           if row.get("gpus_per_node") else {}),
                        # and its cluster's own network, where the source measured it
                        **({"network_gb_s": float(row["network"]["gb_s_per_gpu"])}
                           if row.get("network") else {})})
    measured = _measured(row, seq)
    if not math.isfinite(measured) or measured <= 0:
        return Case(row["id"], group, None, _gpu(row), 0.0, assumed, skipped="no throughput")
    kernel = "triton" if "triton" in str(row["model_config"].get("attn_impl", "")) else ""
    return Case(row["id"], group, job, _gpu(row), measured, assumed, attention_kernel=kernel)


def cases() -> list[Case]:
    out = []
    for row in load_rows():
        try:
            out.append(case(row))
        except Exception as error:  # a row the Job refuses: say why, never drop it silently
            out.append(Case(row["id"], row["source_group"], None, "", 0.0,
                            skipped=f"{type(error).__name__}: {str(error).splitlines()[0]}"))
    return out
