"""Run every CPU benchmark: `make bench` rewrites benchmarks/results/; `--quick` (CI) runs
a few cases of each into a temporary folder, so a benchmark that breaks fails CI.

GPU benchmarks (gpu_validation.py, gpu_runtime_probe.py, gpu_cli_check.sh) need a CUDA
machine; here only gpu_validation's --rescore runs (new predictions beside the committed
GPU measurements)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent

# (script and arguments, also in quick mode?)
BENCHMARKS: list[tuple[list[str], bool]] = [
    (["formula_speed.py"], True),
    (["formula_vs_trace.py"], True),
    (["formula_vs_trace.py", "--catalog"], False),  # traces every catalog model at full size
    (["search_trials.py"], True),
    (["trace_accuracy.py"], True),
    (["trace_speed.py"], True),
    (["gpu_validation.py", "--rescore"], False),    # traces 19 real-size jobs
    (["frameworks_vs_trace.py"], True),
    (["mla_vs_trace.py"], True),                    # DeepSeek-style tiny models
    (["compile_accuracy.py"], True),                # quick: 1 job, Inductor on the CPU
    (["float8_vs_trace.py"], True),                 # quick: 2 jobs
    (["float8_codegen.py"], True),                  # one compiled block, Inductor on the CPU
    (["formula_vs_trace_random.py"], True),         # quick: 4 random jobs
    (["mutation_check.py"], True),                  # quick: 1 mutant
    (["time_accuracy.py"], True),                   # quick: 2 leave-one-out folds
    (["published_accuracy.py"], True),              # quick: a subsample per fold
    (["gemm_shape_fit.py"], True),                  # 6 s: a grid over two constants
    (["memory_ops_check.py"], True),                # under 1 s: 143 published kernel times
    (["nccl_vs_model.py"], True),                   # 2 s: 340 published nccl-tests rows
    (["attention_shape_check.py"], True),           # under 1 s: 11 published kernel rates
    (["host_ops.py"], True),                        # quick: 2 models, tiny shapes on the CPU
    (["traffic_vs_dispatch.py"], True),             # quick: 4 of 15 jobs, shrunk, 8 s
    (["cpu_adam.py"], True),                        # quick: 8 Mi parameters, a second
    (["nf4_dequantise.py"], True),                  # quick: 2 weights, torchao on the CPU
    (["optimizer_ops.py"], True),                   # quick: a 1/16-width layer, 5 s
    (["plan_speed.py"], True),
    (["web_fuzz.py"], True),                        # schemathesis against the web API
    (["web_load.py"], True),                        # 20 clients x 5000 estimates
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few cases each, results to a "
                        "temporary folder")
    parser.add_argument("--only", help="run only benchmarks whose file name contains this")
    args = parser.parse_args()
    env = dict(os.environ)
    out = None
    if args.quick:
        out = Path(tempfile.mkdtemp(prefix="vramplan-bench-"))
        env.update(VRAMPLAN_BENCH_QUICK="1", VRAMPLAN_BENCH_OUT=str(out))
        shutil.copy(HERE / "results" / "gpu_validation.json", out)  # for --rescore
    failed = []
    for command, in_quick in BENCHMARKS:
        if (args.quick and not in_quick) or (args.only and args.only not in command[0]):
            continue
        start = time.perf_counter()
        extra = ["--out", str(out)] if out and command[0].startswith("gpu_") else []
        done = subprocess.run([sys.executable, str(HERE / command[0]), *command[1:], *extra],
                              env=env, cwd=HERE.parent, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        status = "ok" if done.returncode == 0 else f"FAILED ({done.returncode})"
        print(f"{status:>12}  {seconds:6.1f} s  {' '.join(command)}", flush=True)
        if done.returncode:
            failed.append(command[0])
            sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
    if out:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
