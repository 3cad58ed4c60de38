"""GPU validation: predicted (formula, trace) against measured memory on a real CUDA GPU.

One command on a machine with a CUDA GPU runs each job below for real (warm-up plus timed
steps with the measure engine) and records torch.cuda.max_memory_allocated(),
max_memory_reserved(), NVML's used memory and the context overhead beside the trace and
formula predictions. The set is sized to finish in under 8 minutes on one H200.

    PYTHONPATH=. python benchmarks/gpu_validation.py --out benchmarks/results
    PYTHONPATH=. python benchmarks/gpu_validation.py --quick     # two jobs, a smoke test

Writes gpu_validation.json and gpu_validation.md (with the GPU's name, driver, CUDA and
torch versions). The lent H200 has torch and transformers but no pydantic: carry its wheel
(see the device tool's README) and install it before running.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

from vramplan import Job
from vramplan.engines.formula import estimate

# Jobs that fit an 80 GB GPU with room to spare, across families and techniques.
JOBS: list[dict] = [
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048),
    dict(model="llama-3.2-1b", batch_size=8, seq_len=2048, precision="bf16-pure",
         checkpointing="full"),
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, attention="eager"),
    dict(model="qwen2.5-0.5b", batch_size=8, seq_len=2048, optimizer="adamw",
         optimizer_impl="fused"),
    dict(model="llama-3.2-3b", batch_size=2, seq_len=2048, precision="bf16-pure"),
    dict(model="llama-3.1-8b", batch_size=4, seq_len=2048, peft={"rank": 16},
         checkpointing="full"),
    dict(model="llama-3.1-8b", batch_size=2, seq_len=4096, peft={"rank": 16}),
    dict(model="gpt2-medium", batch_size=8, seq_len=1024),
    dict(model="bert-base-uncased", batch_size=32, seq_len=512),
    dict(model="vit-base-patch16-224", batch_size=64),
    dict(model="whisper-small", batch_size=8, seq_len=128),
    dict(model="t5-base", batch_size=8, seq_len=512, precision="bf16-pure"),
]


def gpu_facts() -> dict:
    import torch

    facts = {"torch": torch.__version__, "cuda": torch.version.cuda,
             "gpu": torch.cuda.get_device_name(0),
             "total_bytes": torch.cuda.get_device_properties(0).total_memory,
             "python": platform.python_version(), "platform": platform.platform()}
    try:
        import pynvml

        pynvml.nvmlInit()
        facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        facts["nvml_total_bytes"] = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    except Exception as error:  # NVML missing: say so, keep going
        facts["driver"] = f"unknown ({error})"
    return facts


def validate(fields: dict, steps: int, warmup: int) -> dict:
    from vramplan.engines.measure import measure
    from vramplan.engines.trace import trace

    job = Job.model_validate(fields)
    row: dict = {"job": fields}
    try:
        row["formula"] = _figures(estimate(job))
    except Exception as error:
        row["formula_error"] = f"{type(error).__name__}: {error}"
    try:
        row["trace"] = _figures(trace(job))
    except Exception as error:
        row["trace_error"] = f"{type(error).__name__}: {error}"
    start = time.perf_counter()
    try:
        report = measure(job, steps=steps, warmup=warmup)
        row["measured"] = {**_figures(report), **{
            k: report.measured.get(k) for k in (
                "peak_reserved", "nvml_used_max", "context_overhead", "step_time_median_s",
                "tokens_per_s", "samples_per_s", "gpu_util_mean")}}
    except Exception as error:
        row["measure_error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    row["seconds"] = time.perf_counter() - start
    _free()
    return row


def _figures(report) -> dict:
    return {"peak_allocated": report.peak_allocated, "peak_reserved": report.peak_reserved,
            "device_total": report.device_total, "categories": report.categories}


def _free() -> None:
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _error(row: dict, engine: str) -> float | None:
    if engine not in row or "measured" not in row:
        return None
    real = row["measured"]["peak_allocated"]
    return (row[engine]["peak_allocated"] - real) / real


def markdown(facts: dict, rows: list[dict]) -> str:
    lines = [f"# GPU validation on {facts['gpu']}", "",
             f"driver {facts.get('driver')}, CUDA {facts['cuda']}, torch {facts['torch']}, "
             f"{facts['platform']}", "",
             "| job | measured alloc GiB | reserved GiB | NVML used GiB | context MiB | "
             "trace error | formula error |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        job = ", ".join(f"{k}={v}" for k, v in row["job"].items())
        m = row.get("measured")
        if not m:
            lines.append(f"| {job} | failed: {row.get('measure_error', '')[:80]} | | | | | |")
            continue
        errs = [_error(row, e) for e in ("trace", "formula")]
        lines.append(
            f"| {job} | {m['peak_allocated'] / 2**30:.2f} | {m['peak_reserved'] / 2**30:.2f} | "
            f"{(m['nvml_used_max'] or 0) / 2**30:.2f} | {(m['context_overhead'] or 0) / 2**20:.0f} "
            "| " + " | ".join("-" if e is None else f"{100 * e:+.1f}%" for e in errs) + " |")
    for engine in ("trace", "formula"):
        errs = [abs(e) for e in (_error(r, engine) for r in rows) if e is not None]
        if errs:
            lines.append(f"\n{engine}: median |error| {100 * statistics.median(errs):.2f}%, "
                         f"max {100 * max(errs):.2f}% over {len(errs)} jobs")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true", help="two jobs only")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_validation needs a CUDA GPU; none is visible to torch")
    facts = gpu_facts()
    rows = []
    for fields in JOBS[:2] if args.quick else JOBS:
        rows.append(validate(fields, args.steps, args.warmup))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "trace"}, default=str),
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_validation.json").write_text(
        json.dumps({"machine": facts, "rows": rows}, indent=2, default=str) + "\n")
    (args.out / "gpu_validation.md").write_text(markdown(facts, rows))
    print(markdown(facts, rows))


if __name__ == "__main__":
    main()
