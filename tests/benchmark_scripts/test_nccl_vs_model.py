"""benchmarks/nccl_vs_model.py: published nccl-tests rows timed by the communication model."""

import math

import pytest

from benchmarks import nccl_vs_model as nvm
from vramplan.hardware import get_gpu


def _row(**changes):
    row = {"source": "S0", "gpu": "H100-SXM", "nodes": "1", "gpus_per_node": "8",
           "intra": "nvswitch", "network_gbps_per_gpu": "", "collective": "all_reduce",
           "dtype": "float", "size_bytes": str(2**30), "time_us": "5000.0",
           "algbw_gb_s": "214.75", "busbw_gb_s": "375.81", "ring_forced": False}
    return {**row, **changes}


def test_a_one_node_all_reduce_is_its_ring_bytes_over_nvlink_plus_nccls_latency():
    # 8 H100 behind NVSwitch: 2 x 7/8 of 1 GiB at 450 GB/s x NVLS's 1.30 x 0.8; the latency
    # is NVLS's 23 us (below the ring's 8.4 + 14 x 3.4 = 56 us and the tree's)
    seconds = nvm.predicted_s(_row(), 0.8)
    assert seconds == pytest.approx(2 * 7 / 8 * 2**30 / (450e9 * 1.30 * 0.8) + 23e-6)
    assert nvm.reached(_row()) == pytest.approx(375.81 / (450 * 1.30))
    # an A100 node: no NVLS, the ring at 300 GB/s and its 8.4 + 14 x 3.4 us
    a100 = _row(gpu="A100-80GB")
    assert nvm.predicted_s(a100, 0.8) == pytest.approx(
        2 * 7 / 8 * 2**30 / (300e9 * 0.8) + (8.4 + 14 * 3.4) * 1e-6)


def test_across_nodes_the_ring_moves_at_its_gpus_nics_per_node():
    # 4 nodes x 8 H100 on 400 Gb/s per GPU: 8 x 50 GB/s = 400 GB/s (under NVLink's 450)
    row = _row(nodes="4", network_gbps_per_gpu="400", busbw_gb_s="360")
    assert nvm.reached(row) == pytest.approx(360 / 400)
    # a source that prints no NIC rate takes the catalog node's (50 GB/s per H100)
    assert nvm.reached(_row(nodes="4", busbw_gb_s="360")) == pytest.approx(
        360 / (8 * get_gpu("H100-SXM").network_bytes_s / 1e9))
    # over two nodes NCCL's NVLS tree: twice the ring's 400, at most NVLS's 450 x 1.30;
    # a run that forces the ring (NCCL_ALGO=Ring) gets the ring's
    two = _row(nodes="2", network_gbps_per_gpu="400", busbw_gb_s="360")
    assert nvm.reached(two) == pytest.approx(360 / (450 * 1.30))
    assert nvm.reached({**two, "ring_forced": True}) == pytest.approx(360 / 400)


def test_an_all_gather_sends_seven_eighths_of_the_gathered_buffer():
    row = _row(collective="all_gather")
    c, _ = nvm.collective(row, nvm.machine(row))
    assert (c.kind, c.bytes_per_gpu) == ("all-gather", 7 / 8 * 2**30)


def test_the_fit_picks_the_efficiency_that_times_a_setup_exactly():
    # a made-up setup measured at exactly the model's time for 0.62: the fit finds 0.62
    rows = [_row(size_bytes=str(2**k)) for k in (26, 28, 30)]
    rows = [{**r, "time_us": str(nvm.predicted_s(r, 0.62) * 1e6)} for r in rows]
    assert nvm.fit([rows]) == pytest.approx(0.62, abs=0.0026)
    assert nvm.fit([[_row(size_bytes="1024")]]) is None  # no large message: nothing to fit


def test_the_published_tables_agree_with_nccl_tests_own_bandwidths():
    # nccl-tests prints algbw = size / time and busbw = algbw x 2(n-1)/n (all-reduce) or
    # (n-1)/n: a row typed in wrong, or with the wrong GPU count, fails here
    rows, sources = nvm.load()
    assert len(sources) >= 10 and len(rows) >= 200
    # the sources that pin the ring (NCCL_ALGO=Ring in their settings) are found as such
    assert {r["source"] for r in rows if r["ring_forced"]} == {"S3", "S14"}
    for r in rows:
        n = int(r["nodes"]) * int(r["gpus_per_node"])
        factor = 2 * (n - 1) / n if r["collective"] == "all_reduce" else (n - 1) / n
        algbw = float(r["size_bytes"]) / (float(r["time_us"]) * 1e-6) / 1e9
        if algbw >= 1:  # printed with 2 decimals: small ones round away
            assert float(r["algbw_gb_s"]) == pytest.approx(algbw, rel=0.01), r
            assert float(r["busbw_gb_s"]) == pytest.approx(
                float(r["algbw_gb_s"]) * factor, rel=0.01), r
        assert r["source"] in sources and math.isfinite(float(r["time_us"]))
