"""Fit the GEMM shape model's constants (planning/gemm.py, efficiency.toml [gemm]) on
measured H100 bf16 GEMM rates by shape (benchmarks/data/gemm_sm90_xla.csv, from OpenXLA's
matmul table).

The model times an m x k @ k x n GEMM (b of them in one launch) at the H100's best matmul
rate (its dense bf16 peak x Hopper's MAMF, efficiency.toml) lowered by tile and wave
quantisation over the 132 SMs and the reduction ramp K / (K + k0), plus `overhead_us` per
launch. This script searches k0 and overhead_us on a grid for the smallest median |log
error| over the shapes, prints the error of the fitted and of the shipped constants, and
writes benchmarks/results/gemm_shape_fit.md and .json.

    PYTHONPATH=. python benchmarks/gemm_shape_fit.py
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, write_results  # noqa: E402

from vramplan.hardware import get_gpu  # noqa: E402
from vramplan.planning.efficiency import _table, gemm_model, sm_count  # noqa: E402
from vramplan.planning.gemm import GemmModel, gemm_seconds  # noqa: E402

DATA = Path(__file__).parent / "data" / "gemm_sm90_xla.csv"
K0_GRID = [8.0 * i for i in range(0, 126)]           # 0 .. 1000 reduction steps
OVERHEAD_GRID = [0.25 * i for i in range(0, 41)]     # 0 .. 10 us per launch


def shapes() -> list[dict]:
    lines = [line for line in DATA.read_text().splitlines() if not line.startswith("#")]
    return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(lines)]


def predicted_tflops(row: dict, model: GemmModel, rate: float, sms: int) -> float:
    """The model's rate for `row`: b GEMMs in one launch are one GEMM of b x the tiles,
    i.e. b x m rows (whole tiles per GEMM) with one launch cost."""
    b, m, n, k = int(row["b"]), int(row["m"]), int(row["n"]), int(row["k"])
    seconds = gemm_seconds(b * m, n, k, rate, model, sms)
    return 2.0 * b * m * n * k / seconds / 1e12


def errors(rows: list[dict], model: GemmModel, rate: float, sms: int) -> list[float]:
    """predicted / measured - 1 for every shape."""
    return [predicted_tflops(r, model, rate, sms) / r["tflops"] - 1 for r in rows]


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def fit(rows: list[dict], rate: float, sms: int) -> GemmModel:
    """The grid point with the smallest median |log error| (ties: the smaller constants)."""
    best, best_loss = None, math.inf
    for k0 in K0_GRID:
        for overhead in OVERHEAD_GRID:
            model = GemmModel(k0=k0, overhead_us=overhead)
            loss = statistics.median(abs(math.log1p(e)) for e in errors(rows, model, rate, sms))
            if loss < best_loss - 1e-12:
                best, best_loss = model, loss
    return best


def summary(errs: list[float]) -> dict:
    return {"median_abs": statistics.median(abs(e) for e in errs),
            "p90_abs": _p90([abs(e) for e in errs]),
            "median_signed": statistics.median(errs)}


def main() -> None:
    gpu = get_gpu("H100-SXM")
    sms = sm_count(gpu)
    # the measured best rate (MAMF): what a microbenchmark GEMM reaches, no training share
    rate = gpu.tflops["bf16"] * 1e12 * _table()["hopper"]["mamf"]
    rows = shapes()
    fitted = fit(rows, rate, sms)
    shipped = gemm_model()
    result = {
        "machine": machine_line(),
        "data": str(DATA.relative_to(Path(__file__).parent.parent)),
        "shapes": len(rows),
        "reference_rate_tflops": rate / 1e12, "sm_count": sms,
        "fitted": {"k0": fitted.k0, "overhead_us": fitted.overhead_us},
        "shipped": {"k0": shipped.k0, "overhead_us": shipped.overhead_us},
        "fitted_error": summary(errors(rows, fitted, rate, sms)),
        "shipped_error": summary(errors(rows, shipped, rate, sms)),
        "rows": [{**r, "shipped_tflops": predicted_tflops(r, shipped, rate, sms)} for r in rows],
    }
    write_results("gemm_shape_fit", result, markdown(result))
    print(markdown(result).split("\n| b |")[0])


def markdown(result: dict) -> str:
    f, s = result["fitted_error"], result["shipped_error"]
    lines = [
        "# GEMM shape model fit (planning/gemm.py)", "",
        f"Run on {result['machine']}. Data: `{result['data']}`, {result['shapes']} measured "
        f"H100 bf16 GEMM shapes. Reference rate {result['reference_rate_tflops']:.1f} TFLOP/s "
        f"(dense bf16 peak x Hopper's MAMF), "
        f"{result['sm_count']} SMs. Error = predicted / measured TFLOP/s - 1. In sample: the "
        "constants are fitted on these shapes.", "",
        "| constants | k0 | overhead (us) | median abs error | p90 abs error | median signed |",
        "|---|---:|---:|---:|---:|---:|",
        f"| fitted here | {result['fitted']['k0']:g} | {result['fitted']['overhead_us']:g} | "
        f"{100 * f['median_abs']:.1f}% | {100 * f['p90_abs']:.1f}% | "
        f"{100 * f['median_signed']:+.1f}% |",
        f"| shipped (efficiency.toml) | {result['shipped']['k0']:g} | "
        f"{result['shipped']['overhead_us']:g} | {100 * s['median_abs']:.1f}% | "
        f"{100 * s['p90_abs']:.1f}% | {100 * s['median_signed']:+.1f}% |", "",
        "| b | m | n | k | measured TFLOP/s | shipped model | error |",
        "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['b']:.0f} | {r['m']:.0f} | {r['n']:.0f} | {r['k']:.0f} | "
                     f"{r['tflops']:.1f} | {r['shipped_tflops']:.1f} | "
                     f"{100 * (r['shipped_tflops'] / r['tflops'] - 1):+.1f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
