"""The formula against the trace on torchao's float8 training (docs/frameworks.md, "Float8
(torchao)"): the recipes tensorwise / rowwise / rowwise_with_gw_hp, MXFP8, and FSDP2's
float8 all-gather, at real sizes. The trace runs the real Hugging Face step on fake tensors
with vramplan's stand-ins for torchao's linears (training/emulate/lowbit.py) and for its
float8 all-gather weights (training/emulate/float8_gather.py), FSDP2 over a fake process
group. Where the formula refuses a job (MXFP8 on fp32 weights under autocast) only the
trace is reported. Writes benchmarks/results/float8_vs_trace.{json,md}.

    python benchmarks/float8_vs_trace.py      # a few minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import statistics
import time

from common import QUICK, machine_line, results_dir

from vramplan import Job
from vramplan.engines.formula import estimate
from vramplan.engines.trace import trace
from vramplan.errors import EngineError

RESULTS = results_dir()
LLAMA = dict(model="llama-3.2-1b", batch_size=2, seq_len=2048, precision="fp8")
FSDP8 = {"strategy": "fsdp", "num_gpus": 8}

CASES: list[dict] = [
    dict(LLAMA),
    dict(LLAMA, fp8={"recipe": "rowwise"}),
    dict(LLAMA, fp8={"recipe": "rowwise_with_gw_hp"}),
    dict(LLAMA, fp8={"recipe": "mxfp8"}),
    dict(LLAMA, parallel=FSDP8),
    dict(LLAMA, parallel=FSDP8, fp8={"fsdp_float8_all_gather": True}),
    dict(LLAMA, parallel=FSDP8, fp8={"recipe": "mxfp8"}),
    dict(LLAMA, framework="torchtitan", parallel=FSDP8),
]


def compare(fields: dict) -> dict:
    job = Job.model_validate(fields)
    start = time.perf_counter()
    traced = trace(job)
    row = {"job": fields, "trace_peak": traced.peak_allocated,
           "trace_forward": traced.phase_peaks["forward"],
           "trace_seconds": time.perf_counter() - start}
    try:
        predicted = estimate(job)
    except EngineError as error:
        return {**row, "formula_refused": str(error)}
    return {**row, "formula_peak": predicted.peak_allocated,
            "formula_forward": predicted.phase_peaks["forward"],
            "difference": (predicted.peak_allocated - traced.peak_allocated)
            / traced.peak_allocated,
            "forward_difference": (predicted.phase_peaks["forward"]
                                   - traced.phase_peaks["forward"])
            / traced.phase_peaks["forward"]}


def markdown(rows: list[dict], summary: dict) -> str:
    lines = ["# Formula vs trace: float8 training (torchao recipes, MXFP8, FSDP2 float8 "
             "all-gather)", "", f"Machine: {summary['machine']}. Date: {summary['date']}.", "",
             f"Peak allocated: median |difference| {100 * summary['median_abs']:.2f}%, max "
             f"{100 * summary['max_abs']:.2f}% over {summary['compared']} jobs the formula "
             "models.", "",
             "| job | trace GiB | formula GiB | difference | forward trace GiB | "
             "forward formula GiB | forward difference |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        job = ", ".join(f"{k}={v}" for k, v in r["job"].items())
        if "formula_refused" in r:
            lines.append(f"| {job} | {r['trace_peak'] / 2**30:.3f} | refused | | "
                         f"{r['trace_forward'] / 2**30:.3f} | | |")
            continue
        lines.append(f"| {job} | {r['trace_peak'] / 2**30:.3f} | {r['formula_peak'] / 2**30:.3f}"
                     f" | {100 * r['difference']:+.2f}% | {r['trace_forward'] / 2**30:.3f} | "
                     f"{r['formula_forward'] / 2**30:.3f} | "
                     f"{100 * r['forward_difference']:+.2f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    rows = []
    for fields in (CASES[:2] if QUICK else CASES):
        rows.append(compare(fields))
        print(f"{rows[-1].get('difference', float('nan')):+.3%}  {fields}", flush=True)
    diffs = [abs(r["difference"]) for r in rows if "difference" in r]
    summary = {"machine": f"{machine_line()}, torch {__import__('torch').__version__}",
               "date": time.strftime("%Y-%m-%d"), "compared": len(diffs),
               "median_abs": statistics.median(diffs), "max_abs": max(diffs)}
    (RESULTS / "float8_vs_trace.json").write_text(
        json.dumps({"summary": summary, "rows": rows}, indent=2, default=str) + "\n")
    (RESULTS / "float8_vs_trace.md").write_text(markdown(rows, summary))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
