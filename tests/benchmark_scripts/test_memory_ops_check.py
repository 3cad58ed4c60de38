"""benchmarks/memory_ops_check.py: the bytes each HF op moves by vramplan's count, and the
bandwidth share a measured time implies."""

import pytest

from benchmarks import memory_ops_check as moc


def _row(kernel, mode, x, config, gpu="NVIDIA A100-SXM4-80GB", ms=1.0):
    import json
    return {"kernel_name": kernel, "kernel_operation_mode": mode, "x_value": str(x),
            "extra_benchmark_config_str": json.dumps(config), "gpu_name": gpu,
            "y_value_50": str(ms)}


def test_rms_norm_counts_the_fp32_passes_of_llama_rms_norm():
    # bf16 input: read 2, seven fp32 passes of 4, write 2 x 2 -> 34 bytes an element;
    # backward twice that
    cfg = {"M": 2048, "dtype": "torch.bfloat16"}
    assert moc.op_bytes(_row("rms_norm", "forward", 1024, cfg)) == 2048 * 1024 * 34
    assert moc.op_bytes(_row("rms_norm", "full", 1024, cfg)) == 3 * 2048 * 1024 * 34


def test_an_fp32_add_rms_norm_runs_no_casts():
    # add 12, pow 8, mean 4, rsqrt-mul 8, weight-mul 8 = 40 bytes; in bf16 the four casts
    # add 2 x (2 + 4) + 2 x (4 + 2) = 24 and the weight-mul is 4
    assert moc.op_bytes(_row("fused_add_rms_norm", "forward", 8, {
        "M": 2, "dtype": "torch.float32"})) == 2 * 8 * 40
    assert moc.op_bytes(_row("fused_add_rms_norm", "forward", 8, {
        "M": 2, "dtype": "torch.bfloat16"})) == 2 * 8 * (12 + 8 + 4 + 8 + 4 + 24)


def test_rope_rotates_q_and_k_in_twelve_passes():
    # hidden 8192 over 32 q heads: head 256; 2048 tokens x 256 x (32 + 8) elements
    cfg = {"dtype": "torch.bfloat16", "hidden_size": 8192, "num_q_heads": 32,
           "num_kv_heads": 8}
    assert moc.op_bytes(_row("rope", "forward", 2048, cfg)) == 12 * 2 * 2048 * 256 * 40


def test_an_mlp_row_is_timed_not_counted_and_the_share_is_bytes_over_time():
    cfg = {"B": 4, "hidden_size": 4096, "intermediate_size": 11008,
           "dtype": "torch.bfloat16"}
    assert moc.op_bytes(_row("swiglu", "forward", 1024, cfg)) is None
    from vramplan.hardware import get_gpu
    gpu = get_gpu("A100-80GB")
    forward = moc.mlp_seconds(_row("swiglu", "forward", 1024, cfg), gpu)
    full = moc.mlp_seconds(_row("swiglu", "full", 1024, cfg), gpu)
    # backward: two GEMMs per forward GEMM and twice the activation's bytes
    assert full == pytest.approx(3 * forward, rel=0.02)
    # 2 * 4096 tokens x 3 GEMMs of 4096 x 11008 at no more than the bf16 peak
    assert forward > 2 * 4096 * 3 * 4096 * 11008 / (gpu.tflops["bf16"] * 1e12)


def test_the_committed_rows_all_score():
    result = moc.score()
    assert len(result["rows"]) == 143
    assert all(0 < r.get("implied_share", r.get("measured_over_predicted", 0)) < 3
               for r in result["rows"])
