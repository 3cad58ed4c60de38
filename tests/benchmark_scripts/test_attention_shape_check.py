"""benchmarks/attention_shape_check.py: a measured series' ratios beside the curves'."""

import json

import pytest

from benchmarks import attention_shape_check as check
from vramplan.planning.attention_shape import shape_rates
from vramplan.planning.efficiency import CUDNN, FLASH_2


def test_a_series_is_compared_with_its_own_longest_point():
    series = [{"series": "s", "kernel": "FlashAttention-2", "direction": "backward",
               "head_dim": 64, "causal": True, "seq": seq, "tflops": tflops}
              for seq, tflops in ((1024, 150.0), (4096, 200.0))]
    (row,) = check.compare(series)
    curve = (shape_rates("FlashAttention-2", 1024, 64, True).backward
             / shape_rates("FlashAttention-2", 4096, 64, True).backward)
    assert (row["seq"], row["of_longest"]) == (1024, 4096)
    assert row["measured"] == pytest.approx(0.75)
    assert row["curve"] == pytest.approx(curve)
    assert row["error"] == pytest.approx(curve / 0.75 - 1)


def test_the_committed_data_reads_and_each_series_has_a_longest_point():
    data = check.rows()
    assert {r["kernel"] for r in data} <= {"FlashAttention-2", "FlashAttention-3",
                                           "cuDNN's fused attention"}
    compared = check.compare(data)
    assert len(compared) == len(data) - len({r["series"] for r in data})
    assert all(0 < r["measured"] <= 1.0 for r in compared if r["series"] == "ff65cb67")


def test_a_microbench_file_joins_as_forward_plus_backward_series(tmp_path):
    """gpu_microbench.py's attention rows: SDPA's own choice is the kernel the model says SDPA
    runs on that GPU (cuDNN's on an H200); forward + backward blend the two curves by their
    FLOPs (the backward 2.5x the forward)."""
    rows = [{"head_dim": 128, "seq": seq, "heads": 16, "batch": 16384 // seq, "causal": True,
             "backend": backend, "seconds": 1.0, "tflops": tflops}
            for backend in ("default", "FLASH_ATTENTION")
            for seq, tflops in ((2048, 300.0), (8192, 400.0))]
    rows.append({"head_dim": 128, "seq": 2048, "causal": True, "backend": "CUDNN_ATTENTION",
                 "error": "No available kernel"})
    path = tmp_path / "microbench.json"
    path.write_text(json.dumps({"machine": {"gpu": "NVIDIA H200"}, "attention": rows}))
    series = check.microbench_rows(path)
    assert {r["kernel"] for r in series} == {CUDNN, FLASH_2}  # the refused kernel left out
    (default, flash) = [r for r in check.compare(series)]
    assert default["kernel"] == CUDNN and flash["kernel"] == FLASH_2
    assert default["measured"] == pytest.approx(0.75)

    def blend(seq):
        r = shape_rates(CUDNN, seq, 128, True)
        return 3.5 / (1 / r.forward + 2.5 / r.backward)
    assert default["curve"] == pytest.approx(blend(2048) / blend(8192))
