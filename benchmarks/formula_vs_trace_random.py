"""Formula against trace on random small jobs (issue 12): every difference over 5% in peak
allocated is fixed or listed with its cause.

Tiny configs of each supported family (a few MB of weights) and random job fields: batch,
sequence, accumulation, precision, optimizer and its implementation, checkpointing,
attention, LoRA/QLoRA, and sharding over 2 to 4 GPUs. cuBLAS workspaces are set to 0 so
that the 64 MiB both engines add do not hide differences in small models. Writes
benchmarks/results/formula_vs_trace_random.{json,md}.

    PYTHONPATH=. python benchmarks/formula_vs_trace_random.py            # 120 jobs, ~3 min
    PYTHONPATH=. python benchmarks/formula_vs_trace_random.py --jobs 20  # a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from common import QUICK, results_dir  # noqa: E402 (benchmarks/common.py)

from vramplan import Job, VramplanError
from vramplan.engines.formula import estimate
from vramplan.engines.trace import trace

RESULTS = results_dir()
THRESHOLD = 0.05

# Dropout rates are written out as the published configs have them (gpt2, bert-base-uncased,
# t5-small: 0.1); left out, both engines now take transformers' config class default
# (models/dropout_defaults.toml), which is the same 0.1.
CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=128, intermediate_size=344,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=2048, max_position_embeddings=512, tie_word_embeddings=False),
    "qwen2-tied": dict(model_type="qwen2", hidden_size=128, intermediate_size=344,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=2048, max_position_embeddings=512, tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=2048,
                 n_positions=512, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
    "bert": dict(model_type="bert", hidden_size=128, intermediate_size=512,
                 num_hidden_layers=2, num_attention_heads=4, vocab_size=2048,
                 max_position_embeddings=512, hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1),
    "t5": dict(model_type="t5", d_model=128, d_ff=256, d_kv=32, num_layers=2,
               num_decoder_layers=2, num_heads=4, vocab_size=2048, dropout_rate=0.1),
    "vit": dict(model_type="vit", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, image_size=64, patch_size=16, num_labels=10),
}


def random_job(rnd: random.Random, paths: dict[str, str]) -> dict:
    family = rnd.choice(sorted(CONFIGS))
    fields = dict(
        model=paths[family], batch_size=rnd.choice([1, 2, 4, 8]),
        grad_accum=rnd.choice([1, 1, 2]),
        precision=rnd.choice(["fp32", "bf16-mixed", "bf16-pure"]),
        optimizer=rnd.choice(["adamw", "sgd", "sgd-momentum", "adafactor", "lion",
                              "adamw-8bit"]),
        optimizer_impl=rnd.choice(["foreach", "loop"]),
        checkpointing=rnd.choice(["none", "none", "selective", "full"]),
        attention=rnd.choice(["sdpa", "eager"]), runtime={"cublas_workspaces": 0})
    if family != "vit":
        fields["seq_len"] = rnd.choice([16, 64, 128])
    if rnd.random() < 0.3:
        fields["peft"] = {"method": rnd.choice(["lora", "qlora"]), "rank": 8,
                          "target_modules": ["all-linear"]}
    if rnd.random() < 0.3:
        fields["parallel"] = {"strategy": rnd.choice(["ddp", "zero1", "zero2", "zero3",
                                                      "fsdp"]),
                              "num_gpus": rnd.choice([2, 4])}
    return {"family": family, "fields": fields}


def cause(job: dict) -> str:
    """The known reason for a difference over the threshold, or 'unexplained'."""
    fields = job["fields"]
    strategy = fields.get("parallel", {}).get("strategy")
    if strategy == "zero2":
        return ("zero2: the formula models DeepSpeed ZeRO-2 (parameters replicated); the trace "
                "runs FSDP2 without resharding after forward (sharded parameters plus a full "
                "gathered copy)")
    if strategy in ("zero3", "fsdp") and not fields.get("peft"):
        return ("FSDP2 full fine-tune of a model whose root unit (embeddings, head) outweighs "
                "its blocks: the root's unsharded gradients and fp32 reduce-scatter buffer at "
                "the end of backward are not in the formula")
    if strategy in ("zero3", "fsdp"):
        return ("suspected: FSDP2 with LoRA on a 2-block model: at the backward peak the "
                "formula's gathered weights are one block (0.35 MiB) above the trace's (it "
                "counts the current and the prefetched block; the trace peaks in the head's "
                "backward with one gathered), a large share of so small a job")
    if strategy in ("ddp", "zero1"):
        return "suspected: DDP's gradient buckets as the trace allocates them (not investigated)"
    if fields.get("peft", {}).get("method") == "qlora":
        return ("suspected: QLoRA on 128-wide layers: per-tensor 4-bit layout overheads "
                "and dequantised-weight transients of the trace's low-bit stand-ins are a "
                "large share of so small a job; not traced to a tensor yet")
    if fields["optimizer"] == "adafactor":
        return ("Adafactor: the formula counts states and step temporaries of the matrices "
                "outside the blocks (position tables, patch conv) as unfactored")
    if job["family"] == "vit" and fields["checkpointing"] == "selective":
        return ("ViT under selective checkpointing: the trace's forward (torch's selective "
                "activation checkpointing) keeps more than the formula's kept set (the trace "
                "has selective above no checkpointing on vit-base with LoRA)")
    return "unexplained"


def compare(job: dict) -> dict:
    row = {"family": job["family"], "job": {k: v for k, v in job["fields"].items()
                                            if k not in ("model", "runtime")}}
    parsed = Job.model_validate(job["fields"])
    start = time.perf_counter()
    try:
        traced = trace(parsed)
    except VramplanError as error:
        return {**row, "trace_error": str(error)}
    row["trace_seconds"] = round(time.perf_counter() - start, 2)
    formula = estimate(parsed)
    row.update(trace_peak=traced.peak_allocated, formula_peak=formula.peak_allocated,
               difference=(formula.peak_allocated - traced.peak_allocated)
               / traced.peak_allocated,
               phases=f"{traced.peak_phase}/{formula.peak_phase}")
    if abs(row["difference"]) > THRESHOLD:
        row["cause"] = cause(job)
    return row


def markdown(rows: list[dict], summary: dict) -> str:
    lines = ["# Formula vs trace on random small jobs", "",
             f"Machine: {summary['machine']}. Date: {summary['date']}. Seed {summary['seed']}.",
             "", f"{summary['compared']} jobs compared ({summary['trace_errors']} the trace "
             f"refused); median |difference| {100 * summary['median_abs']:.2f}%, "
             f"{summary['over_threshold']} over {100 * THRESHOLD:.0f}% "
             f"({summary['unexplained']} unexplained).", "",
             "cuBLAS workspaces are 0 in these jobs (both engines would add 64 MiB).", "",
             "## Over 5%", "", "| family | job | trace MiB | formula MiB | difference | "
             "phases (trace/formula) | cause |", "|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        if "cause" in r:
            job = ", ".join(f"{k}={v}" for k, v in r["job"].items())
            lines.append(f"| {r['family']} | {job} | {r['trace_peak'] / 2**20:.1f} | "
                         f"{r['formula_peak'] / 2**20:.1f} | {100 * r['difference']:+.1f}% | "
                         f"{r['phases']} | {r['cause']} |")
    causes: dict[str, int] = {}
    for r in rows:
        if "cause" in r:
            causes[r["cause"]] = causes.get(r["cause"], 0) + 1
    lines += ["", "## Causes", ""] + [f"* {n} jobs: {c}" for c, n in causes.items()]
    lines += ["", "## Jobs the trace could not run (trace defects, for the trace's owner)", ""]
    lines += [f"* {r['family']}: {', '.join(f'{k}={v}' for k, v in r['job'].items())}: "
              f"{r['trace_error'].split(' failed: ', 1)[-1][:160]}"
              for r in rows if "trace_error" in r]
    return "\n".join(lines) + "\n"


def rerender(out: Path) -> None:
    """The committed rows with today's cause() (after a cause is found, not a rerun)."""
    data = json.loads((out / "formula_vs_trace_random.json").read_text())
    for row in data["rows"]:
        if "cause" in row:
            row["cause"] = cause({"family": row["family"], "fields": row["job"]})
    over = [r for r in data["rows"] if "cause" in r]
    data["summary"]["unexplained"] = sum(r["cause"] == "unexplained" for r in over)
    (out / "formula_vs_trace_random.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "formula_vs_trace_random.md").write_text(markdown(data["rows"], data["summary"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4 if QUICK else 120)
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--causes-only", action="store_true",
                        help="re-derive the causes of the committed results (no tracing)")
    args = parser.parse_args()
    if args.causes_only:
        rerender(args.out)
        return
    warnings.filterwarnings("ignore")
    rnd = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        paths = {}
        for family, config in CONFIGS.items():
            path = Path(folder) / f"{family}.json"
            path.write_text(json.dumps(config))
            paths[family] = str(path)
        attempts = 0
        while len(rows) < args.jobs and attempts < 20 * args.jobs:
            attempts += 1
            job = random_job(rnd, paths)
            try:
                estimate(Job.model_validate(job["fields"]))
            except VramplanError:
                continue  # a combination the job refuses: draw another
            rows.append(compare(job))
            print(len(rows), rows[-1].get("difference", rows[-1].get("trace_error")),
                  flush=True)
    compared = [r for r in rows if "difference" in r]
    over = [r for r in compared if "cause" in r]
    summary = {
        "machine": f"{platform.machine()} VM, {platform.python_version()}, "
                   "2 shared cores",
        "date": time.strftime("%Y-%m-%d"), "seed": args.seed, "jobs": len(rows),
        "compared": len(compared), "trace_errors": len(rows) - len(compared),
        "median_abs": statistics.median(abs(r["difference"]) for r in compared),
        "max_abs": max(abs(r["difference"]) for r in compared),
        "over_threshold": len(over),
        "unexplained": sum(r["cause"] == "unexplained" for r in over),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "formula_vs_trace_random.json").write_text(
        json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    (args.out / "formula_vs_trace_random.md").write_text(markdown(rows, summary))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
