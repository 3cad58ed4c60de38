"""The formula against the trace on DeepSeek-style models (issue 10 section 4): multi-head
latent attention and DeepSeek's MoE (dense first block, routed experts, router, shared
experts), on tiny configs the trace runs in seconds (benchmarks/configs/deepseek-*.json:
h 256, 3 blocks of which 1 dense, 8 experts top-2).

  deepseek-v3-tiny          q/k heads 48, v heads 32 (as DeepSeek-V3's 192 / 128)
  deepseek-v3-tiny-eqheads  v heads 48: the CPU runs sdpa's flash kernel. With unequal heads
                            it runs sdpa's math path, which keeps the s x s scores; CUDA
                            runs its memory-efficient kernel, which the formula models, so
                            sdpa rows use equal heads
  deepseek-v2-tiny          DeepSeek-V2-Lite's layout: one q_proj, softmax router, 2 shared

No cuBLAS workspaces (they would dwarf these tiny models). The formula's LoRA rows carry a
gap of every family, not of MLA: the first block sees embeddings without grad under PEFT,
so it saves less than the others (its norm input, its adapters' dropout masks), and a
frozen final norm saves only its fp32 copy; the formula counts every block alike (the
llama row of the same width shows it). Checkpointing rows too: the llama rows of the same
width show the formula's checkpointing model on models this small. Selective checkpointing
keeps the matmul outputs (block_matmul_outputs), which the formula lists for the usual
attention only: for MLA it is an estimate. Writes benchmarks/results/mla_vs_trace.{json,md}.

    python benchmarks/mla_vs_trace.py      # about 5 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from common import QUICK, machine_line, results_dir  # noqa: E402 (benchmarks/common.py)

sys.path.insert(0, str(Path(__file__).parent))
from frameworks_vs_trace import compare_with_forward  # noqa: E402

CONFIGS = Path(__file__).parent / "configs"
V3 = str(CONFIGS / "deepseek-v3-tiny.json")
V3_EQ = str(CONFIGS / "deepseek-v3-tiny-eqheads.json")
V2 = str(CONFIGS / "deepseek-v2-tiny.json")
BASE = dict(batch_size=2, seq_len=512, runtime={"cublas_workspaces": 0})
ATTENTION_LORA = {"rank": 8, "target_modules": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                "kv_b_proj", "o_proj"]}
LLAMA_SAME_WIDTH = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
                    "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 512,
                    "max_position_embeddings": 2048}

CASES: list[dict] = [
    dict(BASE, model=V3, attention="eager"),
    dict(BASE, model=V3_EQ, attention="sdpa"),
    dict(BASE, model=V3, attention="eager", precision="bf16-pure"),
    dict(BASE, model=V3_EQ, attention="sdpa", precision="bf16-pure"),
    dict(BASE, model=V3_EQ, attention="sdpa", checkpointing="full"),
    dict(BASE, model=V3_EQ, attention="sdpa", checkpointing="selective"),
    dict(BASE, model=V3, attention="eager", peft=ATTENTION_LORA),
    dict(BASE, model=V3_EQ, attention="sdpa", peft=ATTENTION_LORA),
    dict(BASE, model=V2, attention="eager"),
    dict(BASE, model=V2, attention="eager", peft={"rank": 8, "target_modules": [
        "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}),
    dict(BASE, model="llama-same-width", attention="sdpa", peft={"rank": 8}),
    dict(BASE, model="llama-same-width", attention="sdpa", checkpointing="full"),
    dict(BASE, model="llama-same-width", attention="sdpa", checkpointing="selective"),
    # the catalog models at full size (fake tensors: a minute or less each). Eager
    # attention: with q/k heads of 192 and v heads of 128 the CPU's sdpa takes its math path
    dict(model="deepseek-v2-lite", batch_size=1, seq_len=1024, attention="eager"),
    dict(model="deepseek-v2-lite", batch_size=1, seq_len=1024, attention="eager",
         peft={"rank": 16, "target_modules": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                              "o_proj"]}),
    dict(model="deepseek-v3", batch_size=1, seq_len=1024, attention="eager",
         peft=dict(ATTENTION_LORA, rank=16)),
    dict(model="deepseek-v3", batch_size=1, seq_len=1024, attention="eager",
         checkpointing="full", peft=dict(ATTENTION_LORA, rank=16)),
]


def _row(fields: dict, tmp: Path) -> dict:
    if fields["model"] == "llama-same-width":
        path = tmp / "llama-same-width.json"
        path.write_text(json.dumps(LLAMA_SAME_WIDTH))
        row = compare_with_forward(dict(fields, model=str(path)))
        row["job"] = fields
        return row
    row = compare_with_forward(fields)
    row["job"] = dict(fields, model=Path(fields["model"]).stem)
    row["activations"] = row["categories"]["activations"]
    return row


def markdown(rows: list[dict], summary: dict) -> str:
    lines = ["# Formula vs trace: DeepSeek-style models (MLA + DeepSeek MoE)", "",
             f"Machine: {summary['machine']}. Date: {summary['date']}.", "",
             f"Peak allocated: median |difference| {100 * summary['median_abs']:.2f}%, max "
             f"{100 * summary['max_abs']:.2f}% over {len(rows)} jobs; full fine-tuning without "
             f"checkpointing: max {100 * summary['full_ft_max_abs']:.2f}%.", "",
             "| job | trace MiB | formula MiB | difference | forward trace MiB | "
             "forward formula MiB | forward difference |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        job = ", ".join(f"{k}={v}" for k, v in r["job"].items() if k not in ("runtime",))
        lines.append(f"| {job} | {r['trace_peak'] / 2**20:.2f} | {r['formula_peak'] / 2**20:.2f}"
                     f" | {100 * r['difference']:+.2f}% | {r['trace_forward'] / 2**20:.2f} | "
                     f"{r['formula_forward'] / 2**20:.2f} | "
                     f"{100 * r['forward_difference']:+.2f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fields in (CASES[:2] if QUICK else CASES):
            rows.append(_row(fields, Path(tmp)))
            print(f"{rows[-1]['difference']:+.3%} fwd {rows[-1]['forward_difference']:+.3%}  "
                  f"{rows[-1]['job']}", flush=True)
    diffs = [abs(r["difference"]) for r in rows]
    full = [abs(r["difference"]) for r in rows
            if "peft" not in r["job"] and "checkpointing" not in r["job"]]
    summary = {"machine": machine_line() + f", torch {__import__('torch').__version__}",
               "date": time.strftime("%Y-%m-%d"),
               "median_abs": statistics.median(diffs), "max_abs": max(diffs),
               "full_ft_max_abs": max(full)}
    results = results_dir()
    (results / "mla_vs_trace.json").write_text(
        json.dumps({"summary": summary, "rows": rows}, indent=2, default=str) + "\n")
    (results / "mla_vs_trace.md").write_text(markdown(rows, summary))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
