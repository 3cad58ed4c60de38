"""benchmarks/attention_shape_check.py: a measured series' ratios beside the curves'."""

import pytest

from benchmarks import attention_shape_check as check
from vramplan.planning.attention_shape import shape_rates


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
