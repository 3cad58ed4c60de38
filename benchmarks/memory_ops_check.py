"""What HF's eager elementwise kernels reach of HBM bandwidth, from published kernel
microbenchmarks, beside the memory share the step-time model uses (efficiency.toml).

The data (benchmarks/data/liger_hf_ops.csv) are the `huggingface` baselines of Liger-Kernel's
benchmark table: median times (triton's do_bench) of HF's LlamaRMSNorm, torch's LayerNorm
and cross-entropy, HF's apply_rotary_pos_emb and HF's LlamaMLP, forward, backward and both,
on an A100 80GB SXM, an H100 80GB SXM and an RTX 4090. For each row this script counts the
bytes the op moves as vramplan's traffic model counts them (planning/traffic.py: RMSNorm
r + 7 x 4 + 2c per element, LayerNorm r + c, rotary 12c over q and k, gated activation 5c,
log_softmax 12 forward and 16 backward; backward twice the forward for the block's ops) and
reports the share of the datasheet bandwidth that moving them in the measured time implies.
That share is what efficiency.toml's `memory` stands for ("fraction of HBM bandwidth reached
by elementwise kernels"); here it is measured op by op, never fitted.

LlamaMLP rows (three GEMMs and the activation) are timed by the model itself: the GEMMs at
the GPU's measured matmul ceiling (efficiency.toml) through planning/gemm.py's shape model,
the activation at the single-GPU memory share; the ratio measured / predicted is reported.

    PYTHONPATH=. python benchmarks/memory_ops_check.py
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, write_results  # noqa: E402

from vramplan.hardware import get_gpu  # noqa: E402
from vramplan.planning.efficiency import (  # noqa: E402
    architecture_of,
    gemm_model,
    shipped_factors,
    sm_count,
)
from vramplan.planning.gemm import gemm_seconds  # noqa: E402
from vramplan.planning.traffic import (  # noqa: E402
    BACKWARD_OVER_FORWARD,
    GATED_ACTIVATION_PASSES,
    LOG_SOFTMAX_BYTES,
    NLL_GRAD_BYTES,
    ROTARY_PASSES,
    eager_norm_bytes,
)

DATA = Path(__file__).parent / "data" / "liger_hf_ops.csv"
GPUS = {"NVIDIA A100-SXM4-80GB": "A100-80GB", "NVIDIA H100 80GB HBM3": "H100-SXM",
        "NVIDIA GeForce RTX 4090": "RTX-4090"}
WIDTH = {"torch.bfloat16": 2, "torch.float32": 4, "torch.float16": 2}
MLP_KERNELS = ("swiglu", "geglu", "tiled_swiglu", "tiled_geglu")
# the modes' multiples of the forward bytes (backward: BACKWARD_OVER_FORWARD)
MODE = {"forward": 1.0, "backward": BACKWARD_OVER_FORWARD, "full": 1.0 + BACKWARD_OVER_FORWARD}


def rows() -> list[dict]:
    lines = [line for line in DATA.read_text().splitlines() if not line.startswith("#")]
    return list(csv.DictReader(lines))


def _config(row: dict) -> dict:
    return json.loads(row["extra_benchmark_config_str"])


def op_bytes(row: dict) -> float | None:
    """Bytes the op moves by vramplan's count (None for an MLP row: timed apart)."""
    kernel, cfg, x = row["kernel_name"], _config(row), int(float(row["x_value"]))
    mode = MODE[row["kernel_operation_mode"]]
    if kernel == "rms_norm":  # LlamaRMSNorm on a 16-bit input: r = c
        c = WIDTH[cfg["dtype"]]
        return mode * cfg["M"] * x * eager_norm_bytes("rmsnorm", c, c)
    if kernel == "layer_norm":  # one fused kernel: read x, write y
        c = WIDTH[cfg["dtype"]]
        return mode * cfg["M"] * x * eager_norm_bytes("layernorm", c, c)
    if kernel == "fused_add_rms_norm":  # Liger's NaiveAddRMSNorm, counted from its code
        c = WIDTH[cfg["dtype"]]
        # add (r 4 x2 w 4), pow (r 4 w 4), mean (r 4), rsqrt-mul (r 4 w 4), weight-mul
        # (r c w c); on a 16-bit input two upcasts (r c w 4) and two downcasts (r 4 w c),
        # which an fp32 input does not run (.to() of its own dtype copies nothing)
        casts = 0 if c == 4 else 2 * (c + 4) + 2 * (4 + c)
        per = 12 + 8 + 4 + 8 + 2 * c + casts
        return mode * cfg["M"] * x * per
    if kernel == "rope":  # q and k rotated, head_dim = hidden / q heads
        c = WIDTH[cfg["dtype"]]
        hidden = cfg.get("hidden_size", x)
        seq = cfg.get("seq_len", x)
        head = hidden // cfg["num_q_heads"]
        elements = seq * head * (cfg["num_q_heads"] + cfg["num_kv_heads"])
        return mode * ROTARY_PASSES * c * elements
    if kernel == "cross_entropy":  # fp32 logits: no upcast, log_softmax and nll's gradient
        backward = NLL_GRAD_BYTES + LOG_SOFTMAX_BYTES
        per = {"forward": LOG_SOFTMAX_BYTES, "backward": backward,
               "full": LOG_SOFTMAX_BYTES + backward}[row["kernel_operation_mode"]]
        return per * cfg["B"] * cfg["T"] * x
    return None


def mlp_seconds(row: dict, gpu) -> float:
    """vramplan's time of one LlamaMLP call: gate, up and down GEMMs (backward: input and
    weight gradients) at the GPU's matmul rate, the activation (act(gate) * up: 5c per
    intermediate element; backward twice) at the single-GPU memory share."""
    cfg, seq = _config(row), int(float(row["x_value"]))
    c = WIDTH[cfg["dtype"]]
    tokens = cfg.get("B", cfg.get("bsz")) * seq
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    factors = shipped_factors(architecture_of(gpu), single_gpu=True, gpu=gpu.name)
    rate = gpu.tflops["bf16"] * 1e12 * factors.matmul
    sms = sm_count(gpu)
    model = gemm_model(gpu.tflops["bf16"] * 1e12 / sms)  # as performance.py times them
    forward = [(tokens, i, h), (tokens, i, h), (tokens, h, i)]
    backward = [shape for m, n, k in forward for shape in ((m, k, n), (k, n, m))]
    gemms = {"forward": forward, "backward": backward, "full": forward + backward}
    matmul = sum(gemm_seconds(m, n, k, rate, model, sms)
                 for m, n, k in gemms[row["kernel_operation_mode"]])
    activation = MODE[row["kernel_operation_mode"]] * GATED_ACTIVATION_PASSES * c * tokens * i
    return matmul + activation / (gpu.bandwidth_bytes_s * factors.memory)


def score() -> dict:
    out = []
    for row in rows():
        gpu = get_gpu(GPUS[row["gpu_name"]])
        measured = float(row["y_value_50"]) * 1e-3
        item = {"kernel": row["kernel_name"], "gpu": gpu.name,
                "mode": row["kernel_operation_mode"], "x_name": row["x_name"],
                "x": int(float(row["x_value"])), "measured_ms": measured * 1e3,
                "config": _config(row)}
        nbytes = op_bytes(row)
        if nbytes is None:
            predicted = mlp_seconds(row, gpu)
            item.update(predicted_ms=predicted * 1e3, measured_over_predicted=measured / predicted)
        else:
            item.update(bytes=nbytes, implied_share=nbytes / (measured * gpu.bandwidth_bytes_s))
        out.append(item)
    groups: dict[tuple, list[dict]] = {}
    for item in out:
        groups.setdefault((item["kernel"], item["gpu"], item["mode"]), []).append(item)
    summary = []
    for (kernel, gpu, mode), items in sorted(groups.items()):
        largest = max(items, key=lambda i: i["x"])  # launch costs least
        key = "implied_share" if "implied_share" in largest else "measured_over_predicted"
        summary.append({"kernel": kernel, "gpu": gpu, "mode": mode, "rows": len(items),
                        "metric": key, "median": statistics.median(i[key] for i in items),
                        "at_largest": largest[key], "largest_x": largest["x"]})
    shares = [s["at_largest"] for s in summary if s["metric"] == "implied_share"]
    return {"machine": machine_line() + " (the CPU side; the kernels were timed by Liger-Kernel)",
            "source": rows_source(), "memory_share_shipped": {
                "training": shipped_factors("ampere").memory,
                "training_single_gpu": shipped_factors("ampere", single_gpu=True).memory},
            "implied_share_at_largest_median": statistics.median(shares),
            "implied_share_at_largest_range": [min(shares), max(shares)],
            "summary": summary, "rows": out}


def rows_source() -> str:
    return next(line[1:].strip() for line in DATA.read_text().splitlines()
                if line.startswith("# source"))


def markdown(result: dict) -> str:
    shipped = result["memory_share_shipped"]
    lines = ["# HF eager kernels: bandwidth reached, from published microbenchmarks", "",
             f"Scored on {result['machine']}. {result['source']}", "",
             "Implied share = the bytes vramplan counts for the op / (measured time x the "
             "datasheet bandwidth): what efficiency.toml's `memory` stands for, measured op by "
             "op (shipped, fitted on whole steps: "
             f"{shipped['training']:.3f} for several GPUs, {shipped['training_single_gpu']:.3f}"
             " for one). LlamaMLP rows: measured / predicted time of the whole MLP (GEMMs at "
             "the GPU's matmul ceiling and shape model, activation at the single-GPU share).",
             "", f"Median implied share at each group's largest size: "
             f"{result['implied_share_at_largest_median']:.2f} (range "
             f"{result['implied_share_at_largest_range'][0]:.2f}-"
             f"{result['implied_share_at_largest_range'][1]:.2f}).", "",
             "| kernel | GPU | mode | rows | metric | median | at the largest size |",
             "|---|---|---|---:|---|---:|---:|"]
    for s in result["summary"]:
        lines.append(f"| {s['kernel']} | {s['gpu']} | {s['mode']} | {s['rows']} | "
                     f"{s['metric'].replace('_', ' ')} | {s['median']:.2f} | "
                     f"{s['at_largest']:.2f} ({s['largest_x']}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    result = score()
    write_results("memory_ops_check", result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
