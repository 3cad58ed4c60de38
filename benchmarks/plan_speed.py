"""Planner speed: `plan llama-3.1-70b --tokens 10B` over the whole GPU catalog and GPU
counts up to 512 (target: at most 2 s on the 2-core VM), and estimate() with performance
(target: at most 1 ms in-process).

    PYTHONPATH=. python benchmarks/plan_speed.py
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

from common import QUICK, results_dir  # benchmarks/common.py

from vramplan.api import estimate
from vramplan.hardware import list_gpus
from vramplan.job import Job
from vramplan.planning.planner import plan

CASES = [
    ("llama-3.1-70b full fine-tune, 10B tokens (the job's own global batch: 1 sample)",
     Job(model="llama-3.1-70b", seq_len=2048), dict(tokens=10_000_000_000)),
    ("llama-3.1-70b full fine-tune, 10B tokens, global batch 4M tokens",
     Job(model="llama-3.1-70b", seq_len=2048),
     dict(tokens=10_000_000_000, global_batch_tokens=4_000_000)),
    ("llama-3.1-70b, global batch 1024, allow lora,qlora,8bit", Job(model="llama-3.1-70b",
     seq_len=2048), dict(tokens=10_000_000_000, global_batch=1024,
                         allow=("lora", "qlora", "8bit"))),
    ("llama-3.1-8b full fine-tune, 2B tokens", Job(model="llama-3.1-8b", seq_len=2048),
     dict(tokens=2_000_000_000)),
]


def main() -> None:
    rows = []
    for name, job, options in (CASES[:1] if QUICK else CASES):
        times = []
        for _ in range(1 if QUICK else 3):
            start = time.perf_counter()
            result = plan(job, max_gpus=512, **options)
            times.append(time.perf_counter() - start)
        rec = result.recommended.candidate if result.recommended else None
        rows.append({"case": name, "seconds_median": statistics.median(times),
                     "seconds_max": max(times), "status": result.status,
                     "memory_checks": result.configurations, "gpus": len(list_gpus()),
                     "front": len(result.front),
                     "recommended": f"{rec.num_gpus} x {rec.gpu}: {rec.flags}" if rec else None})
    # a different job each call, so nothing is served from the planner's memo
    jobs = [Job(model="llama-3.1-8b", batch_size=b, seq_len=2048) for b in range(1, 301)]
    n = len(jobs)
    start = time.perf_counter()  # a first call, so the loop times calls in steady state
    estimate(Job(model="llama-3.1-8b", seq_len=2048), gpu="H100-SXM", tokens=2_000_000_000,
             fixes=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for job in jobs:
        estimate(job, gpu="H100-SXM", tokens=2_000_000_000, fixes=False)
    per_estimate = (time.perf_counter() - start) / n
    # the same estimate with its fixes, for the jobs that do not fit (make-it-fit's search)
    misses = [Job(model="llama-3.1-8b", batch_size=b, seq_len=2048) for b in range(64, 64 + (
        3 if QUICK else 20))]
    start = time.perf_counter()
    for job in misses:
        estimate(job, gpu="H100-SXM", tokens=2_000_000_000)
    per_fixed = (time.perf_counter() - start) / len(misses)
    result = {"machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores "
                         f"(shared), Python {platform.python_version()}",
              "plan": rows, "estimate_with_performance_ms": 1000 * per_estimate,
              "first_estimate_ms": 1000 * first,
              "estimate_with_fixes_ms": 1000 * per_fixed}
    out = results_dir()
    (out / "plan_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Planner speed", "", f"Machine: {result['machine']}.", "",
             "| case | median s | max s | memory checks | status | recommended |",
             "|---|---:|---:|---:|---|---|"]
    lines += [f"| {r['case']} | {r['seconds_median']:.2f} | {r['seconds_max']:.2f} | "
              f"{r['memory_checks']} | {r['status']} | {r['recommended']} |" for r in rows]
    lines += ["", f"estimate() with performance (llama-3.1-8b on H100-SXM, 2B tokens): "
              f"{result['estimate_with_performance_ms']:.3f} ms per call after a first one "
              f"({result['first_estimate_ms']:.0f} ms, after the plans above); with the fixes of a "
              f"job that does not fit (make-it-fit): {result['estimate_with_fixes_ms']:.0f} ms."]
    (out / "plan_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
