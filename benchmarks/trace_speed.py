"""Trace speed: wall time and process RSS of `vramplan.trace` on Llama-shaped models.

Each size runs in a fresh process (so RSS is that size's alone): bf16-mixed, AdamW
(foreach), sdpa, batch 1 x 2048 tokens, two steps traced.

    nice .venv/bin/python benchmarks/trace_speed.py [7b 70b 405b]
"""

from __future__ import annotations

import json
import subprocess
import sys

from common import QUICK, results_dir  # noqa: E402 (benchmarks/common.py)

OUT = results_dir()

# Shapes from the publishers' config.json files (meta-llama/Llama-2-7b-hf, Llama-2-70b-hf,
# Llama-3.1-405B).
SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=32000),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                 num_attention_heads=128, num_key_value_heads=8, vocab_size=128256),
}

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import torch, transformers, peft  # what any trace needs loaded
from vramplan.engines.trace import trace
from vramplan.job import Job
t1 = time.perf_counter()
config = dict(model_type="llama", max_position_embeddings=4096, tie_word_embeddings=False,
              **json.loads(sys.argv[1]))
job = Job(model="llama", batch_size=1, seq_len=2048, precision="bf16-mixed")
report = trace(job, model_config=config, time_limit_s=600)
t2 = time.perf_counter()
print(json.dumps({"import_s": round(t1 - t0, 2), "trace_s": round(t2 - t1, 2),
                  "rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                  "params": report.params_total, "peak_allocated": report.peak_allocated,
                  "peak_reserved": report.peak_reserved, "peak_phase": report.peak_phase}))
"""


def main(sizes: list[str]) -> None:
    rows = []
    for size in sizes:
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SHAPES[size])],
                             capture_output=True, text=True, timeout=900)
        if out.returncode:
            rows.append({"model": f"llama-{size}", "error": out.stderr.strip().splitlines()[-1]})
        else:
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"model": f"llama-{size}", **result})
        print(rows[-1], flush=True)
    machine = {"uname": subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout
               .strip(), "cpus": len(__import__("os").sched_getaffinity(0))}
    import torch
    machine["torch"] = torch.__version__
    OUT.mkdir(exist_ok=True)
    (OUT / "trace_speed.json").write_text(json.dumps(
        {"benchmark": "trace_speed", "machine": machine, "job": "bf16-mixed AdamW(foreach) sdpa "
         "batch 1 x 2048, 2 steps", "results": rows}, indent=2) + "\n")
    lines = ["# Trace speed (Llama shapes, bf16-mixed AdamW, batch 1 x 2048, 2 steps)", "",
             f"Machine: `{machine['uname']}`, {machine['cpus']} CPUs, torch {machine['torch']}.",
             "", "| model | params | import s | trace s | RSS MiB | peak allocated GiB |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']} | | | | |")
        else:
            lines.append(f"| {r['model']} | {r['params'] / 1e9:.2f} B | {r['import_s']} | "
                         f"{r['trace_s']} | {r['rss_mib']} | {r['peak_allocated'] / 2**30:.2f} |")
    (OUT / "trace_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:] or (["7b"] if QUICK else ["7b", "70b", "405b"]))
