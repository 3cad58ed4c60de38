"""The attention-shape curves (efficiency.toml [attention_shape], from the FlashAttention-3
paper's figures) against fused attention rates measured elsewhere
(benchmarks/data/attention_shape_check.csv: pytorch/benchmark's flash_attention operator).

Each series is one kernel at one head size and mask over sequence lengths. Its rate at each
length over its own rate at its longest is set beside the same ratio of the curves
(planning/attention_shape.py shape_rates): the shape of the curve is checked, not its level
(the level is each kernel's `flash` x the fitted attention share). Nothing is fitted here.

    PYTHONPATH=. python benchmarks/attention_shape_check.py
    PYTHONPATH=. python benchmarks/attention_shape_check.py --microbench OUT/microbench.json
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, write_results  # noqa: E402

from vramplan.hardware import get_gpu  # noqa: E402
from vramplan.planning.attention_shape import shape_rates  # noqa: E402
from vramplan.planning.efficiency import CUDNN, FLASH_2, attention_kernel  # noqa: E402

DATA = Path(__file__).parent / "data" / "attention_shape_check.csv"


def rows() -> list[dict]:
    lines = [line for line in DATA.read_text().splitlines() if not line.startswith("#")]
    out = []
    for r in csv.DictReader(lines):
        out.append({**r, "head_dim": int(r["head_dim"]), "seq": int(r["seq"]),
                    "causal": r["causal"] == "true", "tflops": float(r["tflops"])})
    return out


def _curve(row: dict, seq: int) -> float:
    rates = shape_rates(row["kernel"], seq, row["head_dim"], row["causal"])
    if row["direction"] == "forward+backward":  # the backward does 2.5x the forward's FLOPs
        return 3.5 / (1 / rates.forward + 2.5 / rates.backward)
    return getattr(rates, row["direction"])


# gpu_microbench.py's backends: SDPA's own choice is the kernel attention_kernel names
MICROBENCH_KERNELS = {"FLASH_ATTENTION": FLASH_2, "CUDNN_ATTENTION": CUDNN}


def microbench_rows(path: Path) -> list[dict]:
    """gpu_microbench.py's attention rows (forward + backward) as series: one per backend,
    head size and mask, over its sequence lengths."""
    data = json.loads(path.read_text())
    gpu = data["machine"].get("gpu", "")
    default = attention_kernel("sdpa", get_gpu(gpu)).name if gpu else FLASH_2
    out = []
    for r in data["attention"]:
        if "tflops" not in r:  # a kernel the GPU lacks
            continue
        kernel = MICROBENCH_KERNELS.get(r["backend"], default)
        mask = "causal" if r.get("causal", True) else "none"
        out.append({"series": f"{gpu or 'microbench'} {r['backend']} d{r['head_dim']} {mask}",
                    "kernel": kernel, "direction": "forward+backward",
                    "head_dim": r["head_dim"], "causal": r.get("causal", True),
                    "seq": r["seq"], "tflops": r["tflops"]})
    return out


def compare(data: list[dict]) -> list[dict]:
    """Each row's rate over its series' longest, measured and from the curves."""
    out = []
    for name in dict.fromkeys(r["series"] for r in data):
        series = [r for r in data if r["series"] == name]
        longest = max(series, key=lambda r: r["seq"])
        for r in series:
            if r is longest:
                continue
            measured = r["tflops"] / longest["tflops"]
            curve = _curve(r, r["seq"]) / _curve(r, longest["seq"])
            out.append({"series": name, "kernel": r["kernel"], "direction": r["direction"],
                        "head_dim": r["head_dim"], "causal": r["causal"], "seq": r["seq"],
                        "of_longest": longest["seq"], "measured": measured, "curve": curve,
                        "error": curve / measured - 1})
    return out


def markdown(result: dict) -> str:
    lines = ["# Attention shape curves against independent measurements", "",
             f"Scored on {result['machine']} (nothing runs on a GPU here: the rates were "
             "measured by their sources). Source: benchmarks/data/attention_shape_check.csv "
             "(its header names the commits). Error = the curves' ratio / the measured ratio "
             "- 1, each a rate at the sequence length over the series' rate at its longest.",
             "",
             f"Median \\|error\\| {result['median_abs_error']:.1%}, max "
             f"{result['max_abs_error']:.1%} over {len(result['rows'])} ratios.", "",
             "| series | kernel | pass | head | mask | tokens | measured | curves | error |",
             "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['series']} | {r['kernel']} | {r['direction']} | {r['head_dim']} | "
                     f"{'causal' if r['causal'] else 'none'} | {r['seq']} / {r['of_longest']} | "
                     f"{r['measured']:.3f} | {r['curve']:.3f} | {r['error']:+.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbench", type=Path, help="a gpu_microbench.py microbench.json "
                        "whose attention rows join the published series")
    args = parser.parse_args()
    data = rows() + (microbench_rows(args.microbench) if args.microbench else [])
    compared = compare(data)
    errors = [abs(r["error"]) for r in compared]
    result = {"machine": machine_line(), "rows": compared,
              "median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}
    write_results("attention_shape_check", result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
