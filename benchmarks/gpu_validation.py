"""GPU validation: predicted (formula, trace) against measured memory on a real CUDA GPU.

One command on a machine with a CUDA GPU runs each job below for real (warm-up plus timed
steps with the measure engine, which runs the real bitsandbytes / torchao kernels on CUDA)
and records torch.cuda.max_memory_allocated(), max_memory_reserved(), NVML's used memory,
the context overhead and the step times (for the performance model) beside the trace and
formula predictions, with the versions of the libraries each job used.

v2: the first 19 jobs are v1's (so old results stay comparable); then the framework
profiles, real QLoRA / 8-bit / paged / 4-bit / fp8 kernels, checkpointing policies, chunked
losses, activation offload, dense and MoE, long sequences and compile on and off (a job the
engines refuse, e.g. compile before it is modelled, is recorded as skipped). Each job is
guarded: one failure does not stop the rest. No job starts after --budget-s (default 540 s),
so a run ends within 10 minutes on one H200.

    PYTHONPATH=. python benchmarks/gpu_validation.py             # writes to $OUT if set,
                                                                 # else benchmarks/results
    PYTHONPATH=. python benchmarks/gpu_validation.py --quick     # two jobs, a smoke test

The predictions need no GPU, so GPU time can be saved by making them first on any machine
and handing them over (benchmarks/results/gpu_validation_v2_predictions.json holds them for
the v2 jobs, made on the 2-core VM):

    PYTHONPATH=. python benchmarks/gpu_validation.py --predict-only predictions.json
    PYTHONPATH=. python benchmarks/gpu_validation.py --predictions predictions.json

After a fix to an engine, --rescore recomputes the predictions beside the committed GPU
measurements, on any machine (the measurements do not change):

    PYTHONPATH=. python benchmarks/gpu_validation.py --rescore

Writes gpu_validation.json and gpu_validation.md (with the GPU's name, driver, CUDA and
torch versions, and per job the versions of the libraries measure used) after every job, so
a run cut short still leaves its rows. The lent H200 has torch and transformers but no
pydantic, bitsandbytes or torchao and no network: carry their wheels and install them with
`pip install --no-deps` (see the device tool's README); without bitsandbytes / torchao the
jobs that need them fail with a one-line error naming the package, and the rest run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

from common import host_cpu  # benchmarks/common.py

from vramplan import Job
from vramplan.engines.formula import estimate

# Jobs that fit one H200 with room to spare, across families and techniques; the riskier
# code paths (fp8 kernels) come last so a failure there cannot spoil the others.
JOBS: list[dict] = [
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048),
    dict(model="llama-3.2-1b", batch_size=8, seq_len=2048, precision="bf16-pure",
         checkpointing="full"),
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, attention="eager"),
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, checkpointing="selective"),
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, optimizer="adamw-8bit"),
    dict(model="qwen2.5-0.5b", batch_size=8, seq_len=2048, optimizer_impl="fused"),
    dict(model="qwen2.5-0.5b", batch_size=8, seq_len=2048, loss="chunked", grad_accum=2),
    dict(model="llama-3.2-3b", batch_size=2, seq_len=2048, precision="bf16-pure"),
    dict(model="llama-3.1-8b", batch_size=4, seq_len=2048, peft={"rank": 16},
         checkpointing="full"),
    dict(model="llama-3.1-8b", batch_size=2, seq_len=4096, peft={"rank": 16}),
    # the built-in default job (QLoRA, 8-bit paged AdamW) with fewer micro-steps
    dict(model="llama-3.1-8b", batch_size=2, grad_accum=2, seq_len=2048,
         optimizer="paged-adamw-8bit", checkpointing="full",
         peft={"method": "qlora", "rank": 16, "alpha": 32, "dropout": 0.05}),
    dict(model="gemma-2-2b", batch_size=2, seq_len=2048, attention="eager"),
    dict(model="gpt2-medium", batch_size=8, seq_len=1024),
    dict(model="gpt2-medium", batch_size=8, seq_len=1024, precision="fp16-mixed"),
    dict(model="bert-base-uncased", batch_size=32, seq_len=512),
    dict(model="vit-base-patch16-224", batch_size=64),
    dict(model="whisper-small", batch_size=8, seq_len=128),
    dict(model="t5-base", batch_size=8, seq_len=512, precision="bf16-pure"),
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, precision="fp8"),
    # --- v2 (2026-11-30) -----------------------------------------------------------------
    # framework profiles (profiles.toml): their defaults, with measurable losses
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, framework="hf-trainer",
         precision="bf16-mixed"),
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, framework="torchtitan"),
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, framework="torchtitan",
         checkpointing="selective:every-2nd-layer"),
    dict(model="llama-3.2-3b", batch_size=4, seq_len=2048, framework="torchtune", loss="chunked"),
    dict(model="llama-3.1-8b", batch_size=4, seq_len=2048, framework="torchtune", loss="chunked",
         peft={"rank": 16}),
    dict(model="llama-3.1-8b", batch_size=4, seq_len=2048, framework="torchtune", loss="chunked",
         peft={"rank": 16}, activation_offload=True),
    dict(model="qwen2.5-1.5b", batch_size=4, seq_len=2048, framework="lightning",
         precision="bf16-mixed"),
    dict(model="qwen2.5-0.5b", batch_size=8, seq_len=2048, framework="accelerate",
         precision="bf16-mixed", keep_grads_between_steps=True),
    dict(model="llama-3.2-3b", batch_size=2, seq_len=2048, precision="bf16-pure",
         optimizer_in_backward=True),
    # low-bit optimizers, real kernels: bitsandbytes 8-bit / paged, torchao 4-bit / fp8
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, optimizer="paged-adamw"),
    dict(model="llama-3.2-3b", batch_size=2, seq_len=2048, optimizer="paged-adamw-8bit"),
    dict(model="qwen2.5-1.5b", batch_size=4, seq_len=2048, optimizer="adamw-4bit"),
    dict(model="qwen2.5-1.5b", batch_size=4, seq_len=2048, optimizer="adamw-fp8"),
    # QLoRA with bitsandbytes Linear4bit, quantised layer by layer
    dict(model="llama-3.2-3b", batch_size=4, seq_len=2048, peft={"method": "qlora", "rank": 16}),
    dict(model="llama-3.1-8b", batch_size=4, seq_len=2048, checkpointing="full",
         peft={"method": "qlora", "rank": 16, "double_quant": False}),
    # fp8 training (torchao Float8Linear)
    dict(model="llama-3.2-3b", batch_size=2, seq_len=2048, precision="fp8"),
    dict(model="llama-3.2-1b", batch_size=8, seq_len=2048, precision="fp8",
         checkpointing="full"),
    # checkpointing policies and chunked loss
    dict(model="llama-3.2-3b", batch_size=4, seq_len=2048, checkpointing="selective:torchtitan-op"),
    dict(model="qwen2.5-7b", batch_size=2, seq_len=2048, peft={"rank": 16},
         checkpointing="selective", loss="chunked"),
    # mixture of experts: a small Mixtral (benchmarks/configs/mixtral-mini.json: the catalog's
    # mixtral-8x7b shape, narrower). transformers keeps experts as 3-D parameters, which
    # QLoRA (bitsandbytes swaps nn.Linear only) leaves in 16 bits: hence no Mixtral-8x7B here
    dict(model="benchmarks/configs/mixtral-mini.json", batch_size=4, seq_len=2048),
    dict(model="benchmarks/configs/mixtral-mini.json", batch_size=4, seq_len=2048,
         peft={"rank": 16}, checkpointing="full"),
    dict(model="benchmarks/configs/mixtral-mini.json", batch_size=4, seq_len=2048,
         peft={"method": "qlora", "rank": 16}),
    # long sequences
    dict(model="llama-3.2-1b", batch_size=1, seq_len=16384, checkpointing="full"),
    dict(model="llama-3.1-8b", batch_size=1, seq_len=16384, checkpointing="full",
         peft={"rank": 16}, loss="chunked"),
    # torch.compile on (its eager twins are jobs 0, 5 and 9 above)
    dict(model="llama-3.2-1b", batch_size=4, seq_len=2048, compile=True),
    dict(model="qwen2.5-0.5b", batch_size=8, seq_len=2048, optimizer_impl="fused", compile=True),
    dict(model="llama-3.1-8b", batch_size=2, seq_len=4096, peft={"rank": 16}, compile=True),
    # compiled torchao Float8Linear, as torchtitan runs it (its eager twin: the 3B fp8 job)
    dict(model="llama-3.2-3b", batch_size=2, seq_len=2048, precision="fp8", compile=True),
]
V1_JOBS = 19  # JOBS[:19] are the jobs of the v1 results
BUDGET_S = 540  # no job starts after this; v1's longest job took 57 s (stand-in kernels)


def gpu_facts() -> dict:
    import torch

    facts = {"torch": torch.__version__, "cuda": torch.version.cuda,
             "gpu": torch.cuda.get_device_name(0),
             "total_bytes": torch.cuda.get_device_properties(0).total_memory,
             "python": platform.python_version(), "platform": platform.platform(),
             "host_cpu": host_cpu()}
    try:
        import pynvml

        pynvml.nvmlInit()
        facts["driver"] = pynvml.nvmlSystemGetDriverVersion()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        facts["nvml_total_bytes"] = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    except Exception as error:  # NVML missing: say so, keep going
        facts["driver"] = f"unknown ({error})"
    return facts


def predict(fields: dict) -> dict:
    """The formula's and the trace's figures for one job (no GPU needed)."""
    from vramplan.engines.trace import trace

    job = Job.model_validate(fields)
    row: dict = {"job": fields}
    for engine, run in (("formula", estimate), ("trace", trace)):
        start = time.perf_counter()
        try:
            row[engine] = _figures(run(job))
        except Exception as error:
            row[f"{engine}_error"] = f"{type(error).__name__}: {error}"
        row[f"{engine}_seconds"] = time.perf_counter() - start
    return row


def validate(row: dict, steps: int, warmup: int) -> dict:
    """Run the job for real on the GPU and add what the device saw to its predictions."""
    import torch

    from vramplan.engines.measure import measure
    from vramplan.errors import VramplanError

    job = Job.model_validate(row["job"])
    row = dict(row, allocated_before=torch.cuda.memory_allocated())
    start = time.perf_counter()
    try:
        report = measure(job, steps=steps, warmup=warmup)
        row["measured"] = {**_figures(report), **{
            k: getattr(report.measured, k) for k in (
                "peak_reserved", "nvml_used_max", "context_overhead", "step_time_median_s",
                "step_time_p90_s", "step_times_s", "tokens_per_s", "samples_per_s",
                "gpu_util_mean", "complete", "stopped", "losses", "libraries", "kernels")},
            "unified_memory_bytes": report.unified_memory_bytes,
            "tokens_per_step": report.tokens_per_step, "notes": report.notes}
    except VramplanError as error:  # the engine refuses the job (e.g. compile): not a failure
        row["skipped"] = f"{type(error).__name__}: {error}"
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


# predicted figure -> the measured figure it is compared with
COMPARED = {"peak_allocated": "peak_allocated", "peak_reserved": "peak_reserved",
            "device_total": "nvml_used_max"}


def _error(row: dict, engine: str, figure: str = "peak_allocated") -> float | None:
    measured = (row.get("measured") or {}).get(COMPARED[figure])
    if engine not in row or not measured:
        return None
    return (row[engine][figure] - measured) / measured


def _percent(error: float | None) -> str:
    return "-" if error is None else f"{100 * error:+.1f}%"


def markdown(facts: dict, rows: list[dict]) -> str:
    gib = 2**30
    lines = [f"# GPU validation on {facts['gpu']}", "",
             f"driver {facts.get('driver')}, CUDA {facts['cuda']}, torch {facts['torch']}, "
             f"Python {facts['python']}, {facts['platform']}", "",
             f"Predictions: {facts.get('predictions_from', 'made in the same run')}.", "",
             "Errors are (predicted - measured) / measured. Allocated: "
             "torch.cuda.max_memory_allocated(); reserved: max_memory_reserved(); device: "
             "NVML's used memory (the whole GPU) against the predicted device total.", "",
             "| job | allocated GiB | trace | formula | reserved GiB | trace | formula | "
             "NVML used GiB | trace | formula | context MiB | step s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        job = ", ".join(f"{k}={v}" for k, v in row["job"].items())
        m = row.get("measured")
        if not m:
            why = (row.get("measure_error") or (f"skipped: {row['skipped']}" if "skipped" in row
                                                 else "not run"))[:100].replace("|", "/")
            lines.append(f"| {job} | failed: {why} |" + " |" * 10)
            continue
        cells = [job]
        for figure, key in COMPARED.items():
            cells.append(f"{(m[key] or 0) / gib:.2f}")
            cells += [_percent(_error(row, e, figure)) for e in ("trace", "formula")]
        cells.append(f"{(m['context_overhead'] or 0) / 2**20:.0f}")
        step = m.get("step_time_median_s")
        cells.append(f"{step:.3f}" if step else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for figure in COMPARED:
        for engine in ("trace", "formula"):
            errs = [abs(e) for e in (_error(r, engine, figure) for r in rows) if e is not None]
            if errs:
                lines.append(f"* {engine} {figure}: median |error| "
                             f"{100 * statistics.median(errs):.2f}%, max {100 * max(errs):.2f}% "
                             f"over {len(errs)} jobs")
    failed = [r for r in rows if "measure_error" in r or not r.get("measured", {}).get(
        "complete", True)]
    for row in failed:
        lines.append(f"* failed or partial: {row['job']}: "
                     f"{row.get('measure_error') or row['measured'].get('stopped')}")
    return "\n".join(lines) + "\n"


def _write(out: Path, facts: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_validation.json").write_text(
        json.dumps({"machine": facts, "rows": rows}, indent=2, default=str) + "\n")
    (out / "gpu_validation.md").write_text(markdown(facts, rows))


MEASURED_KEYS = ("measured", "measure_error", "skipped", "seconds", "allocated_before")


def rescore(out: Path) -> None:
    """New predictions (this code, this machine) beside the GPU measurements saved in out."""
    import subprocess

    saved = json.loads((out / "gpu_validation.json").read_text())
    rows = [{**predict(old["job"]), **{k: old[k] for k in MEASURED_KEYS if k in old}}
            for old in saved["rows"]]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    facts = {**saved["machine"], "predictions_from": f"--rescore on {time.strftime('%Y-%m-%d')}"
             f" at commit {commit} (measurements unchanged)"}
    _write(out, facts, rows)
    print(markdown(facts, rows))


def default_out() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else (
        Path(__file__).parent / "results")


def run_jobs(predicted: list[dict], validate_row, budget_s: float, write=lambda rows: None,
             clock=time.monotonic, predict_row=None) -> list[dict]:
    """Measure each job in turn (predicting it first when predict_row is given); none starts
    after budget_s seconds: those rows say so. validate_row guards its own errors; anything
    that still escapes is recorded on the row, and the next job runs."""
    start, rows = clock(), []
    for row in predicted:
        if clock() - start >= budget_s:
            row = {**row, "skipped": f"time budget: not started after {budget_s:.0f} s"}
        else:
            try:
                row = predict_row(row["job"]) if predict_row else row
                row = validate_row(row)
            except Exception as error:  # a job must not stop the others
                row = {**row, "measure_error": f"{type(error).__name__}: {error}"}
        rows.append(row)
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in (
            "formula", "trace")}, default=str), flush=True)
        write(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out(),
                        help="where results go: $OUT when set (the device machine), else "
                        "benchmarks/results")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="start no job after this many seconds")
    parser.add_argument("--quick", action="store_true", help="two jobs only")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--predict-only", type=Path, metavar="FILE",
                        help="write the formula and trace predictions to FILE and stop")
    parser.add_argument("--predictions", type=Path, metavar="FILE",
                        help="predictions made earlier with --predict-only")
    parser.add_argument("--rescore", action="store_true",
                        help="recompute the predictions of the run saved in --out (no GPU)")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    os.chdir(Path(__file__).resolve().parent.parent)  # job paths are relative to the repo
    jobs = JOBS[:2] if args.quick else JOBS

    if args.rescore:
        rescore(args.out)
        return

    if args.predict_only:
        rows = []
        for fields in jobs:
            rows.append(predict(fields))
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in (
                "formula", "trace")} | {e: rows[-1].get(e, {}).get("peak_allocated")
                                        for e in ("formula", "trace")}), flush=True)
        args.predict_only.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
        return

    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_validation needs a CUDA GPU; none is visible to torch")
    facts = gpu_facts()
    saved = {}
    if args.predictions:
        saved = {json.dumps(r["job"], sort_keys=True): r
                 for r in json.loads(args.predictions.read_text())["rows"]}
        facts["predictions_from"] = ("--predictions (made before the GPU run; jobs missing "
                                     "from the file are predicted in the run)")

    def predict_row(fields: dict) -> dict:  # job by job, inside the time budget
        return saved.get(json.dumps(fields, sort_keys=True)) or predict(fields)

    rows = run_jobs([{"job": fields} for fields in jobs],
                    lambda row: validate(row, args.steps, args.warmup), args.budget_s,
                    write=lambda rows: _write(args.out, facts, rows), predict_row=predict_row)
    print(markdown(facts, rows))


if __name__ == "__main__":
    main()
