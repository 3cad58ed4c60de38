"""NCCL's latency per collective call (planning/comm.py collective_latency_s), from NCCL's
tuning model as efficiency.toml [nccl] gives it, and how many calls a strategy makes."""

from __future__ import annotations

import math

import pytest

from vramplan.hardware import get_gpu
from vramplan.job import Job, Parallel
from vramplan.models import load_architecture
from vramplan.planning.comm import Collective, collective_latency_s, collectives, nvls_node
from vramplan.planning.performance import step_terms

H100, A100, RTX4090 = get_gpu("H100-SXM"), get_gpu("A100-80GB"), get_gpu("RTX-4090")
US = 1e-6


def _coll(kind, group, per_node, link="network", gpu=H100):
    # in the catalog's 8-GPU node of `gpu` (NVLS on Hopper, as comm.collectives decides)
    return Collective("c", 1.0, "step", "", link, group, nics=per_node, kind=kind,
                      nvls=nvls_node(gpu, 8))


@pytest.mark.parametrize("gpu, kind, group, per_node, link, expected_us", [
    # ring all-gather over 2 nodes of 8: 15 steps, 1 of them between nodes
    (A100, "all-gather", 16, 8, "network", 8.4 + 14 * 3.4 + 1 * 14.0),
    # the same on H100s: NVLS only inside a node, so the ring still
    (H100, "all-gather", 16, 8, "network", 8.4 + 14 * 3.4 + 1 * 14.0),
    # inside one node: the ring's 7 NVLink steps on A100, NVLS's one latency on H100
    (A100, "reduce-scatter", 8, 8, "interconnect", 8.4 + 7 * 3.4),
    (H100, "reduce-scatter", 8, 8, "interconnect", 23.0),
    # all-reduce over 2 nodes: ring 30 steps, 4 between nodes; tree 2 (7 + 1) x 28 us;
    # H100's NVLS tree 23 + 2 x 1 x 14 us
    (A100, "all-reduce", 16, 8, "network", 8.4 + 26 * 3.4 + 4 * 14.0),
    (H100, "all-reduce", 16, 8, "network", 23.0 + 2 * 14.0),
    # 128 nodes: the tree's 2 (7 + 7) x 28 us beats the ring's 2046 steps
    (A100, "all-reduce", 1024, 8, "network", 2 * (7 + 7) * 28.0),
    # two GeForce cards over PCIe (no NVLink, no P2P): 2 ring steps at PCIe's hop
    (RTX4090, "all-reduce", 2, 2, "interconnect", 8.4 + 2 * 5.7),
])
def test_latency_follows_nccls_tuning_model(gpu, kind, group, per_node, link, expected_us):
    assert collective_latency_s(_coll(kind, group, per_node, link, gpu), gpu) == pytest.approx(
        expected_us * US, rel=1e-9)


def test_sends_and_single_ranks_have_no_latency():
    assert collective_latency_s(_coll("p2p", 8, 8), H100) == 0.0
    assert collective_latency_s(_coll("all-reduce", 1, 1), H100) == 0.0


def test_fsdp_calls_once_per_block_and_root_ddp_once_per_bucket():
    arch = load_architecture("llama-3.2-1b")  # 16 blocks
    fsdp = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024,
               parallel=Parallel(strategy="fsdp", num_gpus=16))
    assert {c.calls for c in collectives(fsdp, arch, A100)} == {16 + 1}
    ddp = fsdp.with_changes(parallel=Parallel(strategy="ddp", num_gpus=16))
    (reduce,) = collectives(ddp, arch, A100)
    grads = reduce.bytes_per_gpu / (2 * 15 / 16)  # the ring sends 2 (n - 1) / n of them
    assert reduce.calls == math.ceil(grads / (25 * 2**20))


def test_each_occurrence_carries_its_calls_latency():
    arch = load_architecture("llama-3.2-1b")
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024,
              parallel=Parallel(strategy="fsdp", num_gpus=16))
    terms = step_terms(job, A100, arch)
    for c, t in zip(collectives(job, arch, A100), terms.collectives):
        assert t.latency_s == pytest.approx(c.calls * collective_latency_s(c, A100))
        assert t.latency_s > 0


def test_a_step_whose_latency_shows_says_so():
    from vramplan.planning.performance import predict
    job = Job(model="llama-3.1-8b", batch_size=1, seq_len=2048,
              parallel=Parallel(strategy="fsdp", num_gpus=512))
    perf, terms = predict(job, H100), step_terms(job, H100)
    latency = sum(c.times * c.latency_s for c in terms.collectives)
    assert latency > 0.05 * perf.step_time_s
    assert f"NCCL's per-call latency adds up to {latency:.3g} s" in " ".join(perf.notes)
    one_node = job.with_changes(parallel=Parallel(strategy="fsdp", num_gpus=8))
    assert not any("per-call latency" in n for n in predict(one_node, H100).notes)
