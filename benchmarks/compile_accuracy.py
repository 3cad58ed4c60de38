"""torch.compile: the trace's peak of a compiled step vs the same step compiled by Inductor
and run for real on this CPU (issue 10, section 2).

Three numbers per job, all for step 2 of the same job on tiny Hugging Face models:
  eager       the trace, compile off (itself within 0.00% median of the CPU: trace_accuracy)
  traced      the trace, compile on: AOTAutograd with Inductor's partitioner on fake
              tensors, the results Inductor fuses away not counted (training/compiled.py)
  inductor    the real thing: torch.compile with Inductor (C++ kernels on the CPU), the peak
              from torch.profiler's allocator events (benchmarks/ground_truth.py)
Inductor on the CPU and on a GPU share the partitioner and the scheduler's fusion rules;
their kernels differ, which the GPU run of benchmarks/gpu_validation.py checks.

    nice .venv/bin/python benchmarks/compile_accuracy.py   # writes results/compile_accuracy.*
    nice .venv/bin/python benchmarks/compile_accuracy.py --llm   # + 128k vocabulary x 4096
    nice .venv/bin/python benchmarks/compile_accuracy.py --llm-only  # those two, merged into
                                                                     # the committed results
    nice .venv/bin/python benchmarks/compile_accuracy.py --only fp8  # the jobs whose name
                                                     # holds "fp8", merged likewise
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time

import torch
from common import QUICK, machine_line, results_dir  # noqa: E402 (benchmarks/common.py)
from ground_truth import cpu_profiler_peak  # noqa: E402 (benchmarks/ground_truth.py)

from vramplan.engines.trace import run_trace
from vramplan.job import Job, Peft

OUT = results_dir()

LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
QWEN2 = dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
GPT2 = dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=256)

CASES = [  # (name, model config, job fields)
    ("llama bf16-mixed", LLAMA, dict()),
    ("llama fp32", LLAMA, dict(precision="fp32")),
    ("llama bf16-pure", LLAMA, dict(precision="bf16-pure")),
    ("llama bf16-mixed lora", LLAMA, dict(peft=Peft(rank=8, dropout=0.0))),
    ("llama bf16-mixed full checkpointing", LLAMA, dict(checkpointing="full")),
    ("llama fp32 full checkpointing", LLAMA, dict(precision="fp32", checkpointing="full")),
    ("llama bf16-pure lora all-linear", LLAMA, dict(precision="bf16-pure", peft=Peft(
        rank=8, dropout=0.0, target_modules=("all-linear",)))),
    ("llama bf16-mixed batch 4 x 256", LLAMA, dict(batch_size=4, seq_len=256)),
    ("qwen2 bf16-mixed", QWEN2, dict()),
    # torchao's Float8Linear (tensorwise and rowwise recipes), as torchtitan compiles it;
    # a batch whose activations make the peak
    ("llama fp8 torchao tensorwise batch 4 x 256", LLAMA,
     dict(precision="fp8", batch_size=4, seq_len=256)),
    ("llama fp8 torchao rowwise batch 4 x 256", LLAMA,
     dict(precision="fp8", fp8={"recipe": "rowwise"}, batch_size=4, seq_len=256)),
    ("llama fp8 torchao rowwise_with_gw_hp batch 4 x 256", LLAMA,
     dict(precision="fp8", fp8={"recipe": "rowwise_with_gw_hp"}, batch_size=4, seq_len=256)),
    ("gpt2 fp32", GPT2, dict(precision="fp32")),
    ("gpt2 bf16-mixed", GPT2, dict()),
]
# LLM-sized vocabulary and sequence on a narrow model: the loss decides the peak, and
# whether it is compiled (compile_components) moves it by gigabytes. Only with --llm (or
# --llm-only): about a minute per case on the 2-core VM in fp32
# (tests/engines/test_compile_formula.py checks both engines at 128k x 2048)
LLAMA_128K = dict(LLAMA, vocab_size=128256, max_position_embeddings=4096)
# fp32: the real CPU step runs with oneDNN off (cpu_profiler_peak), where bf16 GEMMs of a
# 4096 x 128k head are naive loops (a bf16-mixed case ran past 25 minutes), fp32 ones BLAS
LLM_CASES = [
    ("llama 128k vocab, 4096 tokens, fp32, blocks+loss", LLAMA_128K,
     dict(batch_size=1, seq_len=4096, precision="fp32")),
    ("llama 128k vocab, 4096 tokens, fp32, blocks only", LLAMA_128K,
     dict(batch_size=1, seq_len=4096, precision="fp32", compile_components="blocks")),
]
ORDER = [name for name, _, _ in CASES + LLM_CASES]  # the table's order
LLM_ONLY = "--llm-only" in sys.argv
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
MERGE = LLM_ONLY or bool(ONLY)  # rerun some jobs, keep the committed rows of the others
if LLM_ONLY:
    CASES = list(LLM_CASES)
elif ONLY:
    CASES = [case for case in CASES + LLM_CASES if ONLY in case[0]]
elif "--llm" in sys.argv:
    CASES += LLM_CASES
if QUICK:
    CASES = CASES[:1]


def main() -> None:
    if not (shutil.which("g++") or shutil.which("c++")):
        # Inductor needs a C++ compiler for CPU kernels: no ground truth without one
        print("compile_accuracy: no C++ compiler (g++) on this machine, skipped")
        return
    rows = []
    for name, config, fields in CASES:
        base = dict(model="x", batch_size=2, seq_len=128, precision="bf16-mixed") | fields
        eager = run_trace(Job(**base), model_config=dict(config)).peak(rounded=False)[0]
        components = base.pop("compile_components", "blocks+loss")
        job = Job(**base, compile=True, compile_components=components)
        start = time.perf_counter()
        traced = run_trace(job, model_config=dict(config)).peak(rounded=False)[0]
        trace_s = time.perf_counter() - start
        torch._dynamo.reset()
        real = cpu_profiler_peak(job, model_config=dict(config))
        rows.append(dict(name=name, eager=eager, traced=traced, inductor=real,
                         error_pct=100 * (traced - real) / real,
                         saving_pct=100 * (eager - real) / eager, trace_s=trace_s))
        print(f"{name:38s} eager {eager:>9,} traced {traced:>9,} inductor {real:>9,} "
              f"({rows[-1]['error_pct']:+.2f}%)", flush=True)
        write(rows)  # after every row: the 128k cases take many minutes each


def write(rows: list[dict]) -> None:
    if MERGE and (OUT / "compile_accuracy.json").exists():  # keep the other jobs' rows
        ran = {r["name"] for r in rows}
        kept = json.loads((OUT / "compile_accuracy.json").read_text())["rows"]
        rows = sorted([r for r in kept if r["name"] not in ran] + rows,
                      key=lambda r: ORDER.index(r["name"]) if r["name"] in ORDER else len(ORDER))
    errors = [abs(r["error_pct"]) for r in rows]
    summary = dict(machine=machine_line(), torch=torch.__version__, jobs=len(rows),
                   median_abs_error_pct=statistics.median(errors),
                   max_abs_error_pct=max(errors), rows=rows)
    (OUT / "compile_accuracy.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = ["# torch.compile: trace vs Inductor on the CPU\n",
             f"Machine: {summary['machine']}, torch {summary['torch']}. Command: "
             "`nice .venv/bin/python benchmarks/compile_accuracy.py"
             + (" --llm" if any("128k" in r["name"] for r in rows) else "")
             + "`. Peaks of step 2 in bytes, unrounded; nothing is fitted.\n",
             f"Median |error| {summary['median_abs_error_pct']:.2f}%, max "
             f"{summary['max_abs_error_pct']:.2f}% over {len(rows)} jobs.\n",
             "| job | eager (trace) | compiled (trace) | compiled (Inductor, CPU) | error | "
             "saved by compile |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['eager']:,} | {r['traced']:,} | {r['inductor']:,} | "
              f"{r['error_pct']:+.2f}% | {r['saving_pct']:.1f}% |" for r in rows]
    lines += ["", "Where it can miss: under full checkpointing Inductor recomputes the whole "
              "block inside the compiled backward, and its horizontal fusion may compute "
              "several recomputed results in one kernel, so more of them are alive at once "
              "than when the trace runs the same graph op by op: the fp32 full-checkpointing "
              "row, whose peak is in that backward. The fp8 rows: on the CPU, _scaled_mm "
              "copies its second float8 operand into a contiguous layout and allocates a "
              "workspace beside it (torch.profiler shows both): temporaries of the CPU "
              "kernel, which the trace does not model (a GPU run of gpu_validation.py, whose "
              "last job is compiled fp8, checks the CUDA kernels)."]
    (OUT / "compile_accuracy.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
