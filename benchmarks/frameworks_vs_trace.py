"""The formula against the trace on the framework behaviours of issue 10: named selective
checkpointing policies, gradients kept between steps, adapter dtypes, torchao low-bit
optimizer states, the hf-trainer / torchtitan / torchtune profiles, CPU offload (activations,
optimizer, parameters), paged optimizer states and torch.compile (docs/frameworks.md).

The trace runs the real Hugging Face step on fake tensors with the same policies
(vramplan/training/checkpointing.py), so it is the reference. Besides the peak, the
forward's peak is compared: the peak of these jobs is often the optimizer step, where the
policies' saved tensors are gone. Writes benchmarks/results/frameworks_vs_trace.{json,md}.

    python benchmarks/frameworks_vs_trace.py      # about 20-25 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

from common import QUICK, results_dir  # noqa: E402 (benchmarks/common.py)

sys.path.insert(0, str(Path(__file__).parent))
from formula_vs_trace import compare  # noqa: E402

from vramplan import Job  # noqa: E402
from vramplan.engines.formula import estimate  # noqa: E402
from vramplan.engines.trace import trace  # noqa: E402

RESULTS = results_dir()
LLAMA = dict(model="llama-3.2-1b", batch_size=2, seq_len=2048)
QWEN = dict(model="qwen2.5-0.5b", batch_size=4, seq_len=1024)

CASES: list[dict] = [
    dict(LLAMA, checkpointing="selective:torchtitan-op"),
    dict(LLAMA, checkpointing="selective:every-2nd-layer"),
    dict(QWEN, checkpointing="selective:torchtitan-op"),
    dict(QWEN, checkpointing="selective:torchtitan-op", peft={"rank": 16}),
    dict(LLAMA, keep_grads_between_steps=True),
    dict(LLAMA, precision="bf16-pure", peft={"rank": 16, "adapter_dtype": "fp32"}),
    dict(LLAMA, precision="bf16-pure", peft={"rank": 16, "adapter_dtype": "model"}),
    dict(LLAMA, precision="bf16-pure", optimizer="adamw-4bit"),
    dict(LLAMA, precision="bf16-pure", optimizer="adamw-fp8"),
    dict(LLAMA, framework="hf-trainer"),
    dict(LLAMA, framework="hf-trainer", peft={"rank": 16}),
    dict(LLAMA, framework="torchtitan"),
    dict(LLAMA, framework="torchtune"),
    dict(LLAMA, framework="torchtune", peft={"rank": 16}),
    dict(LLAMA, framework="torchtune", loss="chunked:torchtune-output"),
    dict(LLAMA, framework="torchtune", checkpointing="none"),
    # CPU offload and paged optimizer states (training/offload.py, training/placement.py)
    dict(LLAMA, framework="torchtune", activation_offload=True),
    dict(LLAMA, checkpointing="full", activation_offload=True),
    dict(LLAMA, checkpointing="selective", activation_offload=True),
    dict(LLAMA, checkpointing="full", activation_offload=True, peft={"rank": 16}),
    dict(QWEN, activation_offload=True, peft={"rank": 16}),
    dict(LLAMA, offload={"optimizer": True}),
    dict(LLAMA, checkpointing="full", parallel={"strategy": "fsdp", "num_gpus": 4},
         offload={"optimizer": True, "params": True}),
    dict(LLAMA, precision="bf16-pure", optimizer="paged-adamw-8bit"),
    dict(LLAMA, precision="bf16-pure", optimizer="paged-adamw"),
    # torch.compile (training/compiled.py; activations.compiled_block_saved_tensors)
    dict(LLAMA, compile=True, batch_size=8),
    dict(QWEN, compile=True),
    dict(LLAMA, compile=True, checkpointing="full"),
    dict(LLAMA, compile=True, peft={"rank": 16, "dropout": 0.0}),
    dict(LLAMA, framework="torchtitan", compile=True),
    dict(LLAMA, framework="torchtitan", compile=True, precision="fp8"),  # torchao Float8Linear
    dict(LLAMA, compile=True, precision="fp8"),  # no checkpointing: the partitioner's choice
    dict(LLAMA, compile=True, precision="fp8", fp8={"recipe": "rowwise_with_gw_hp"}),
    dict(LLAMA, framework="torchtune", compile=True),
    dict(LLAMA, framework="torchtune", compile=True, loss="chunked:torchtune-output"),
]


def compare_with_forward(fields: dict) -> dict:
    row = compare(fields)
    job = Job.model_validate(fields)
    traced, predicted = trace(job), estimate(job)
    row["trace_forward"] = traced.phase_peaks["forward"]
    row["formula_forward"] = predicted.phase_peaks["forward"]
    row["forward_difference"] = (predicted.phase_peaks["forward"]
                                 - traced.phase_peaks["forward"]) / traced.phase_peaks["forward"]
    # paged optimizer states, outside the peak (CUDA unified memory)
    row["trace_unified"] = traced.unified_memory_bytes
    row["formula_unified"] = predicted.unified_memory_bytes
    return row


def markdown(rows: list[dict], summary: dict) -> str:
    lines = ["# Formula vs trace: framework behaviours (issue 10)", "",
             f"Machine: {summary['machine']}. Date: {summary['date']}.", "",
             f"Peak allocated: median |difference| {100 * summary['median_abs']:.2f}%, max "
             f"{100 * summary['max_abs']:.2f}%. Forward peak: median "
             f"{100 * summary['forward_median_abs']:.2f}%, max "
             f"{100 * summary['forward_max_abs']:.2f}% over {len(rows)} jobs.", "",
             "| job | trace GiB | formula GiB | difference | forward trace GiB | "
             "forward formula GiB | forward difference | unified memory trace / formula GiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        job = ", ".join(f"{k}={v}" for k, v in r["job"].items())
        lines.append(f"| {job} | {r['trace_peak'] / 2**30:.3f} | {r['formula_peak'] / 2**30:.3f}"
                     f" | {100 * r['difference']:+.2f}% | {r['trace_forward'] / 2**30:.3f} | "
                     f"{r['formula_forward'] / 2**30:.3f} | "
                     f"{100 * r['forward_difference']:+.2f}% | "
                     f"{r['trace_unified'] / 2**30:.3f} / {r['formula_unified'] / 2**30:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    rows = []
    for fields in (CASES[:2] if QUICK else CASES):
        rows.append(compare_with_forward(fields))
        print(f"{rows[-1]['difference']:+.3%} fwd {rows[-1]['forward_difference']:+.3%}  "
              f"{fields}", flush=True)
    diffs = [abs(r["difference"]) for r in rows]
    forward = [abs(r["forward_difference"]) for r in rows]
    summary = {"machine": f"{platform.platform()}, {__import__('os').cpu_count()} CPUs, "
                          f"Python {platform.python_version()}, "
                          f"torch {__import__('torch').__version__}",
               "date": time.strftime("%Y-%m-%d"),
               "median_abs": statistics.median(diffs), "max_abs": max(diffs),
               "forward_median_abs": statistics.median(forward),
               "forward_max_abs": max(forward)}
    (RESULTS / "frameworks_vs_trace.json").write_text(
        json.dumps({"summary": summary, "rows": rows}, indent=2, default=str) + "\n")
    (RESULTS / "frameworks_vs_trace.md").write_text(markdown(rows, summary))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
