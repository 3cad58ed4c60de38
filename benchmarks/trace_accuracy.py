"""Trace accuracy: traced peak vs the real peak of the same two steps run on this CPU.

The real peak comes from torch.profiler's allocator memory events (not from the hooks the
tracer uses), with oneDNN off (its CPU-only scratch buffers have no CUDA counterpart).
Both sides use the same builders (vramplan.training), optimizer implementation and
attention backend; sizes are compared unrounded, since the CPU allocator does not round.

    nice .venv/bin/python benchmarks/trace_accuracy.py   # writes results/trace_accuracy.*
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import QUICK, results_dir  # noqa: E402 (benchmarks/common.py)
from ground_truth import cpu_profiler_peak  # noqa: E402 (benchmarks/ground_truth.py)

from vramplan.engines.trace import run_trace
from vramplan.job import Job, Peft

OUT = results_dir()

GPT2 = dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=256)
BERT = dict(model_type="bert", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=512, max_position_embeddings=256)
# T5 runs eager here (with sdpa the trace keeps CUDA's memory-efficient kernel's tensors,
# which a CPU run cannot), and eager attention's dropout on the s x s probabilities would
# hit the CPU native_dropout copy explained below: no dropout in this config
T5 = dict(model_type="t5", d_model=128, d_ff=256, d_kv=32, num_layers=2, num_decoder_layers=2,
          num_heads=4, vocab_size=512, dropout_rate=0.0)
LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
VIT = dict(model_type="vit", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
           num_attention_heads=4, image_size=64, patch_size=8, num_labels=10)
WHISPER = dict(model_type="whisper", d_model=128, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
               decoder_ffn_dim=256, vocab_size=512, num_mel_bins=80, max_source_positions=100,
               max_target_positions=64, pad_token_id=1, bos_token_id=2, eos_token_id=2,
               decoder_start_token_id=3, suppress_tokens=[], begin_suppress_tokens=[])

GPT2_LORA = Peft(rank=8, target_modules=("c_attn", "c_proj"))
BERT_LORA = Peft(rank=8, target_modules=("query", "value"))
T5_LORA = Peft(rank=8, target_modules=("q", "v"))

CASES = [  # (name, model config, job fields)
    ("gpt2 fp32 sdpa adamw", GPT2, dict(precision="fp32")),
    ("gpt2 bf16-mixed eager adamw", GPT2, dict(attention="eager")),
    ("gpt2 bf16-mixed ckpt sgd-momentum", GPT2, dict(checkpointing="full",
                                                     optimizer="sgd-momentum")),
    ("gpt2 bf16-pure adamw-8bit", GPT2, dict(precision="bf16-pure", optimizer="adamw-8bit")),
    ("gpt2 bf16-mixed lora", GPT2, dict(peft=GPT2_LORA)),
    ("bert mlm fp32 eager adamw", BERT, dict(task="masked-lm", precision="fp32",
                                             attention="eager")),
    ("bert mlm bf16-mixed accum2", BERT, dict(task="masked-lm", grad_accum=2)),
    ("bert cls bf16-pure sgd", BERT, dict(task="seq-classification", precision="bf16-pure",
                                          optimizer="sgd")),
    ("bert mlm bf16-mixed ckpt lora", BERT, dict(task="masked-lm", checkpointing="full",
                                                 peft=BERT_LORA)),
    ("t5 fp32 adamw", T5, dict(task="seq2seq", precision="fp32", attention="eager")),
    ("t5 bf16-mixed adamw-8bit", T5, dict(task="seq2seq", optimizer="adamw-8bit",
                                          attention="eager")),
    ("t5 bf16-mixed lora", T5, dict(task="seq2seq", peft=T5_LORA, target_len=16,
                                    attention="eager")),
    ("llama fp32 sdpa adamw", LLAMA, dict(precision="fp32")),
    ("llama bf16-mixed eager adamw", LLAMA, dict(attention="eager")),
    ("llama bf16-mixed ckpt adamw", LLAMA, dict(checkpointing="full")),
    ("llama bf16-mixed selective adamw", LLAMA, dict(checkpointing="selective")),
    ("gpt2 bf16-pure selective eager", GPT2, dict(checkpointing="selective", attention="eager",
                                                  precision="bf16-pure")),
    ("llama bf16-pure adamw-8bit", LLAMA, dict(precision="bf16-pure", optimizer="adamw-8bit")),
    ("llama bf16-mixed lora", LLAMA, dict(peft=Peft(rank=8))),
    ("llama bf16-mixed lora ckpt eager", LLAMA, dict(peft=Peft(rank=8), checkpointing="full",
                                                     attention="eager")),
    ("llama fp32 sgd accum2", LLAMA, dict(precision="fp32", optimizer="sgd", grad_accum=2)),
    ("llama bf16-mixed chunked loss", LLAMA, dict(loss="chunked")),
    ("llama bf16-mixed adamw fused", LLAMA, dict(optimizer_impl="fused")),
    ("llama bf16-mixed adamw loop", LLAMA, dict(optimizer_impl="loop")),
    ("llama fp8", LLAMA, dict(precision="fp8")),
    ("llama bf16-mixed optimizer-in-backward", LLAMA, dict(optimizer_in_backward=True)),
    ("llama cls bf16-mixed", LLAMA, dict(task="seq-classification")),
    ("vit fp32 adamw", VIT, dict(precision="fp32")),
    ("vit bf16-mixed eager sgd-momentum", VIT, dict(attention="eager",
                                                   optimizer="sgd-momentum")),
    ("vit bf16-pure adamw-8bit", VIT, dict(precision="bf16-pure", optimizer="adamw-8bit")),
    ("whisper fp32 adamw", WHISPER, dict(precision="fp32", seq_len=64)),
    ("whisper bf16-mixed adamw", WHISPER, dict(seq_len=64)),
    ("whisper bf16-mixed ckpt adamw-8bit", WHISPER, dict(checkpointing="full", seq_len=64,
                                                         optimizer="adamw-8bit")),
]


# Why a case misses by more than 0.1% (checked by varying one setting at a time).
EXPLAINED = {
    "vit bf16-mixed eager sgd-momentum": (
        "the patch-embedding convolution runs in bf16 under autocast; the CPU's native bf16 "
        "convolution allocates an internal buffer (~60 KB here) inside the kernel, below "
        "dispatch, so no tracer can see it. The same case in fp32 or with batch 1 is exact, "
        "and it does not depend on attention or optimizer. On CUDA the analogue is cuDNN's "
        "workspace, which the trace report notes as not traced."),
}
_CPU_DROPOUT = (
    "LoRA dropout: the CPU's native_dropout kernel turns its 1-byte mask into a float copy "
    "of the input inside the kernel (aten::to under native_dropout in torch.profiler), below "
    "the fake kernel; CUDA's fused dropout has no such copy. With lora dropout 0 the same "
    "case is exact (checked).")
EXPLAINED["gpt2 bf16-mixed lora"] = EXPLAINED["t5 bf16-mixed lora"] = _CPU_DROPOUT
EXPLAINED["bert mlm bf16-mixed ckpt lora"] = (
    "15,216 bytes = 3 x 5,056 (three CPU RNG states kept by checkpointing, see below) + 48 "
    "bytes of host scalars; 0.17% only because the model is tiny (9 MB).")
NOTES = [
    "The 5-15 KB gaps of the checkpointing cases are multiples of 5,056 bytes: the CPU RNG "
    "state (torch.get_rng_state(), the Mersenne Twister state) that torch.utils.checkpoint "
    "keeps per live checkpointed region. It is host memory, outside the GPU, so the trace "
    "is right to leave it out. Remaining gaps of 8-100 bytes are scalar host tensors.",
    "The real run uses the same builders (vramplan.training), so both sides emulate CUDA "
    "autocast op lists and the bitsandbytes 8-bit state layout; a run on a real GPU checks "
    "those emulations: gpu_validation.md (one H200).",
    "Sharded jobs (FSDP over a fake process group, DDP buckets) are not in this table: their "
    "CPU ground truth needs torchrun with gloo, not done yet.",
    "oneDNN is switched off for the real run: with it on, bf16 matmuls and convolutions "
    "allocate oneDNN scratch (up to +40% on a bf16 ViT) that CUDA kernels do not have.",
    "QLoRA is not in this table: its CPU stand-in computes the dequantised weight with extra "
    "temporaries, while the trace counts bitsandbytes' kernel output only.",
]


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import transformers
    return {"uname": subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip(),
            "cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def run_case(name: str, config: dict, fields: dict) -> dict:
    job = Job(**{"model": config["model_type"], "batch_size": 4, "seq_len": 256,
                 "precision": "bf16-mixed", **fields})
    started = time.monotonic()
    traced, _ = run_trace(job, model_config=config).peak(rounded=False)
    real = cpu_profiler_peak(job, model_config=config)
    return {"case": name, "traced_bytes": traced, "real_bytes": real,
            "error_pct": round((traced - real) / real * 100, 4),
            "seconds": round(time.monotonic() - started, 2),
            "job": job.model_dump(exclude={"runtime", "parallel", "offload", "gpu"})}


def main() -> None:
    rows = [run_case(*case) for case in (CASES[:3] if QUICK else CASES)]
    for row in rows:
        if row["case"] in EXPLAINED:
            row["explanation"] = EXPLAINED[row["case"]]
    errors = sorted(abs(r["error_pct"]) for r in rows)
    p90 = errors[min(len(errors) - 1, int(0.9 * len(errors) + 0.5) - 1)]
    summary = {"cases": len(rows), "median_abs_error_pct": statistics.median(errors),
               "p90_abs_error_pct": p90, "max_abs_error_pct": errors[-1]}
    data = {"benchmark": "trace_accuracy", "machine": machine(), "summary": summary,
            "results": rows}
    OUT.mkdir(exist_ok=True)
    (OUT / "trace_accuracy.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = ["# Trace accuracy: traced peak vs real CPU step (torch.profiler allocator events)",
             "", f"Machine: `{data['machine']['uname']}`; CPU {data['machine']['cpu']}; "
             f"torch {torch.__version__}; transformers {data['machine']['transformers']}.", "",
             f"{summary['cases']} cases: median |error| {summary['median_abs_error_pct']:.3f}%, "
             f"p90 {summary['p90_abs_error_pct']:.3f}%, max {summary['max_abs_error_pct']:.3f}%.",
             "", "| case | traced bytes | real bytes | error |", "|---|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['traced_bytes']:,} | {r['real_bytes']:,} | "
              f"{r['error_pct']:+.3f}% |" for r in rows]
    outliers = [r for r in rows if abs(r["error_pct"]) > 0.1]
    if outliers:
        lines += ["", "## Outliers (|error| > 0.1%)", ""]
        lines += [f"* {r['case']} ({r['error_pct']:+.3f}%): "
                  f"{EXPLAINED.get(r['case'], 'not yet explained')}" for r in outliers]
    lines += ["", "## Notes", ""] + [f"* {note}" for note in NOTES]
    (OUT / "trace_accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
