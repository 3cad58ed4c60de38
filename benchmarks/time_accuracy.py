"""Time accuracy: predicted against measured step time on our own GPU runs.

The runs are the H200 jobs of benchmarks/results/gpu_validation.json (benchmarks/
gpu_validation.py: the measure engine's median step of 3 timed steps after 1 warm-up, each
step = synthetic batch, forward, backward, clip_grad_norm, optimizer step, zero_grad, and
a device sync for the loss).

Three errors are reported:

  * out of sample: leave-one-out, each run predicted with the factors (matmul, memory,
    host time per kernel) `vramplan calibrate` fits on the others;
  * in sample: every run predicted with the factors fitted on all of them (what
    `vramplan calibrate` would store for this GPU);
  * shipped: efficiency.toml's factors for a job on this many GPUs, what a user gets
    without calibrating. They are fitted on published runs and on these (with this VM's
    own host time per kernel, which is not shipped: benchmarks/published_accuracy.py), so
    they are in sample too.

Runs whose measured time is that of a CPU-side stand-in kernel, not of the real one, are
listed but not scored (the memory engines emulate bitsandbytes and float8 kernels with
plain torch code of the same memory, and the stand-ins' speed says nothing about the real
kernels): the 8-bit AdamW runs and the fp8 run.

    PYTHONPATH=. python benchmarks/time_accuracy.py            # score, write results
    PYTHONPATH=. python benchmarks/time_accuracy.py --fit      # also print the fit to ship
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from common import QUICK, results_dir  # benchmarks/common.py

from vramplan.hardware import get_gpu
from vramplan.job import Job
from vramplan.planning.calibrate import fit
from vramplan.planning.efficiency import factors_for
from vramplan.planning.performance import step_terms, step_time

RESULTS = Path(__file__).parent / "results"


def stand_in(job: dict) -> str:
    """Why a run's measured time is not the real kernels' (empty when it is)."""
    if job.get("optimizer") in ("adamw-8bit", "paged-adamw-8bit"):
        return "8-bit AdamW stand-in (vramplan/training/emulate/), not bitsandbytes"
    if job.get("precision") == "fp8":
        return "fp8 stand-in: casts to float8 and back, bf16 matmuls (not fp8 kernels)"
    return ""


def load_runs(path: Path) -> tuple[dict, list[dict]]:
    data = json.loads(path.read_text())
    runs = []
    for row in data["rows"]:
        measured = (row.get("measured") or {}).get("step_time_median_s")
        if measured:
            runs.append({"job": row["job"], "measured_s": measured,
                         "excluded": stand_in(row["job"])})
    return data["machine"], runs


def _summary(errors: list[float]) -> dict:
    ordered = sorted(abs(e) for e in errors)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return {"median_abs": statistics.median(ordered), "p90_abs": p90, "max_abs": ordered[-1],
            "runs": len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RESULTS / "gpu_validation.json")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--fit", action="store_true", help="print the all-runs fit to ship")
    parser.add_argument("--module-us", default=None,
                        help="host us per nn.Module call to try, e.g. 0,10,20,40 (fitted "
                             "with the other factors, in every fold); default: the shipped")
    args = parser.parse_args()
    args.out = args.out or results_dir()
    machine, runs = load_runs(args.runs)
    gpu = get_gpu(machine["gpu"])
    for run in runs:
        job = Job.model_validate(run["job"])
        run["terms"] = step_terms(job, gpu)
        # efficiency.toml's for the job's GPU count, not a user's calibration
        run["shipped"] = factors_for(gpu, calibrated=False, num_gpus=job.parallel.num_gpus)
    shipped = runs[0]["shipped"]  # where the fits start
    scored = [r for r in runs if not r["excluded"]]
    started = time.perf_counter()

    # in sample: factors fitted on every scored run
    grid = tuple(float(v) for v in args.module_us.split(",")) if args.module_us else None
    all_fit = fit(shipped, [r["terms"] for r in scored], [r["measured_s"] for r in scored],
                  module_us=grid)
    # out of sample: leave one out
    for i, run in enumerate(scored):
        if QUICK and i >= 2:  # CI: two folds show the script works
            break
        others = scored[:i] + scored[i + 1:]
        factors = fit(shipped, [r["terms"] for r in others], [r["measured_s"] for r in others],
                      module_us=grid)
        run["loo_factors"] = [factors.matmul, factors.memory, factors.kernel_us,
                              factors.module_us]
        run["loo_s"] = step_time(run["terms"], factors)
    for run in runs:
        run["in_sample_s"] = step_time(run["terms"], all_fit)
        run["shipped_s"] = step_time(run["terms"], run["shipped"])

    def err(run, key):
        return run[key] / run["measured_s"] - 1 if key in run else 0.0

    result = {
        "machine": {"runs_measured_on": machine, "scored_on": f"{platform.machine()} "
                    f"{platform.system()}, Python {platform.python_version()}, "
                    "2-core VM (the CPU side; the runs were measured on the GPU above)"},
        "fit_all_runs": all_fit.model_dump(include={"matmul", "attention", "memory",
                                                    "kernel_us", "module_us"}),
        "module_us_tried": list(grid) if grid else None,
        "shipped_factors": shipped.model_dump(),
        "out_of_sample_leave_one_out": _summary([err(r, "loo_s") for r in scored
                                                 if "loo_s" in r]),
        "in_sample_fit_all_runs": _summary([err(r, "in_sample_s") for r in scored]),
        "in_sample_shipped_factors": _summary([err(r, "shipped_s") for r in scored]),
        "fit_seconds": time.perf_counter() - started,
        "rows": [{k: v for k, v in r.items() if k not in ("terms", "shipped")} for r in runs],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "time_accuracy.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (args.out / "time_accuracy.md").write_text(markdown(result))
    print(markdown(result))
    if args.fit:
        print("fit on all runs (ship in efficiency.toml):", result["fit_all_runs"])


def markdown(result: dict) -> str:
    m = result["machine"]["runs_measured_on"]
    lines = [f"# Step-time accuracy on {m['gpu']}", "",
             f"Runs: benchmarks/results/gpu_validation.json, measured on one {m['gpu']} "
             f"(driver {m.get('driver')}, CUDA {m['cuda']}, torch {m['torch']}). Scored on "
             f"{result['machine']['scored_on']}.", "",
             "Error = predicted / measured - 1. **Out of sample** = leave-one-out (factors "
             "fitted on the other runs); **in sample** = factors fitted on all scored runs "
             "(what `vramplan calibrate` would store for this GPU). **Shipped** = "
             "vramplan/planning/efficiency.toml's factors for the job's GPU count, what a user "
             "gets without calibrating: fitted on published runs and on these (with this "
             "machine's own host time per kernel, not shipped; "
             "benchmarks/published_accuracy.py), so in sample too.", ""]
    for key, label in (("out_of_sample_leave_one_out", "out of sample (leave-one-out)"),
                       ("in_sample_fit_all_runs", "in sample (fit on all runs)"),
                       ("in_sample_shipped_factors", "in sample (shipped efficiency.toml)")):
        s = result[key]
        lines.append(f"* {label}: median |error| {100 * s['median_abs']:.1f}%, p90 "
                     f"{100 * s['p90_abs']:.1f}%, max {100 * s['max_abs']:.1f}% over "
                     f"{s['runs']} runs")
    f = result["fit_all_runs"]
    lines += ["", f"Fit on all runs: matmul {f['matmul']:.3f}, attention {f['attention']:.3f}, "
              f"memory {f['memory']:.3f}, host {f['kernel_us']:.1f} us per kernel"
              + (f" + {f['module_us']:.1f} us per module call (tried: "
                 f"{', '.join(f'{v:g}' for v in result['module_us_tried'])})"
                 if result.get("module_us_tried") else "") + ".", "",
              "| job | measured s | out of sample s | error | in sample s | error | "
              "shipped s | error | note |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        job = ", ".join(f"{k}={v}" for k, v in r["job"].items())
        loo = r.get("loo_s")
        cells = [job, f"{r['measured_s']:.3f}",
                 f"{loo:.3f}" if loo else "-",
                 f"{100 * (loo / r['measured_s'] - 1):+.1f}%" if loo else "-",
                 f"{r['in_sample_s']:.3f}",
                 f"{100 * (r['in_sample_s'] / r['measured_s'] - 1):+.1f}%",
                 f"{r['shipped_s']:.3f}",
                 f"{100 * (r['shipped_s'] / r['measured_s'] - 1):+.1f}%",
                 f"not scored: {r['excluded']}" if r["excluded"] else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
