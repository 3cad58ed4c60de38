"""Performance model: communication volumes, rates per dtype, training time and cost."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vramplan.api import estimate
from vramplan.errors import JobError
from vramplan.hardware import get_gpu
from vramplan.job import Job, Parallel, Peft
from vramplan.models import load_architecture
from vramplan.planning.amount import TrainingAmount
from vramplan.planning.comm import collectives, ring_bytes
from vramplan.planning.efficiency import factors_for
from vramplan.planning.flops import step_flops
from vramplan.planning.options import PlanOptions
from vramplan.planning.performance import phase_times, predict, step_terms

LLAMA_1B_PARAMS = 1_235_814_400  # llama-3.2-1b with its tied head (tests/models/test_models.py)
H100 = get_gpu("H100-SXM")


def _job(**changes) -> Job:
    return Job(**{"model": "llama-3.2-1b", "batch_size": 4, "seq_len": 2048, **changes})


def test_ring_collective_bytes():
    # a ring all-reduce sends 2 (n-1)/n of the buffer; reduce-scatter / all-gather (n-1)/n
    assert ring_bytes("all-reduce", 800, 8) == 2 * 7 / 8 * 800
    assert ring_bytes("all-gather", 800, 8) == 7 / 8 * 800
    assert ring_bytes("all-reduce", 800, 1) == 0


def test_ddp_all_reduces_fp32_gradients_once_per_step_inside_a_node():
    job = _job(grad_accum=4, parallel=Parallel(strategy="ddp", num_gpus=8))
    (c,) = collectives(job, load_architecture(job.model), H100)
    assert c.bytes_per_gpu == 2 * 7 / 8 * 4 * LLAMA_1B_PARAMS
    assert (c.per, c.overlaps, c.link, c.group) == ("step", "backward", "interconnect", 8)
    # 16 GPUs do not fit one 8-GPU node: the ring runs over the network
    (c16,) = collectives(job.with_changes(parallel=Parallel(strategy="ddp", num_gpus=16)),
                         load_architecture(job.model), H100)
    assert c16.link == "network"


def test_fsdp_gathers_16bit_weights_twice_and_reduce_scatters_per_micro_batch():
    job = _job(parallel=Parallel(strategy="fsdp", num_gpus=4))
    gathers = [c for c in collectives(job, load_architecture(job.model), H100)]
    assert [c.name for c in gathers] == ["parameter all-gather, forward (fsdp)",
                                         "parameter all-gather, backward (fsdp)",
                                         "gradient reduce-scatter (fsdp)"]
    assert gathers[0].bytes_per_gpu == 3 / 4 * 2 * LLAMA_1B_PARAMS   # bf16 under autocast
    assert gathers[2].bytes_per_gpu == 3 / 4 * 4 * LLAMA_1B_PARAMS   # fp32 gradients
    assert all(c.per == "micro-batch" for c in gathers)


def test_tensor_parallel_all_reduces_activations_four_times_per_block():
    job = _job(batch_size=1, parallel=Parallel(tensor_parallel=2, num_gpus=2))
    (c,) = collectives(job, load_architecture(job.model), H100)
    # 16 blocks x 4 all-reduces (2 forward, 2 backward) of b*s*h bf16 = 1*2048*2048*2 bytes
    assert c.bytes_per_gpu == 2 * 1 / 2 * 16 * 4 * 2048 * 2048 * 2
    # sequence parallelism (the default) makes each an all-gather and a reduce-scatter: the
    # same bytes in twice the NCCL calls
    assert (c.kind, c.calls) == ("all-gather", 2 * 4 * 16)
    plain = job.with_changes(parallel=job.parallel.model_copy(
        update={"sequence_parallel": False}))
    (p,) = collectives(plain, load_architecture(job.model), H100)
    assert (p.kind, p.calls, p.bytes_per_gpu) == ("all-reduce", 4 * 16, c.bytes_per_gpu)


def test_a_switchless_4_gpu_nvlink_node_gives_a_pair_a_third_of_the_links():
    # H200 on 4-GPU boards (no NVSwitch): each GPU's NVLink is split among 3 peers, so TP 2
    # reaches 1/3 of 450 GB/s; TP 4 uses every link; the catalog's 8-GPU NVSwitch node 1
    arch, h200 = load_architecture("llama-3.2-1b"), get_gpu("H200")
    pair = _job(batch_size=1, parallel=Parallel(tensor_parallel=2, num_gpus=2, gpus_per_node=4))
    (c,) = collectives(pair, arch, h200)
    assert (c.link, c.link_share) == ("interconnect", 1 / 3)
    (terms,) = step_terms(pair, h200, arch).collectives
    assert terms.link_s == c.bytes_per_gpu / (450e9 / 3)
    quad = pair.with_changes(parallel=Parallel(tensor_parallel=4, num_gpus=4, gpus_per_node=4))
    assert collectives(quad, arch, h200)[0].link_share == 1.0
    switched = pair.with_changes(parallel=Parallel(tensor_parallel=2, num_gpus=2))
    # behind the 8-GPU node's NVSwitch every link: sequence parallelism's all-gathers and
    # reduce-scatters at the ring's rate, plain TP's all-reduces at NVLS's 1.30x it
    assert collectives(switched, arch, h200)[0].link_share == 1.0
    plain = pair.with_changes(parallel=Parallel(tensor_parallel=2, num_gpus=2,
                                                sequence_parallel=False))
    assert collectives(plain, arch, h200)[0].link_share == 1.30


def test_nvls_speeds_up_an_all_reduce_inside_a_switched_hopper_or_blackwell_node():
    # NVLS: 480 of a ring's 370 GB/s on 8 H100 (efficiency.toml [nvls_all_reduce]); the
    # ring's rate for gathers and scatters, across nodes, before Hopper and without a switch
    arch = load_architecture("llama-3.2-1b")
    ddp = _job(parallel=Parallel(strategy="ddp", num_gpus=8))
    fsdp = _job(parallel=Parallel(strategy="fsdp", num_gpus=8))

    def shares(job, gpu):
        return {c.kind: c.link_share for c in collectives(job, arch, gpu)}
    assert shares(ddp, H100) == {"all-reduce": 1.30}
    assert shares(ddp, get_gpu("B200")) == {"all-reduce": 1.13}
    assert shares(ddp, get_gpu("A100-80GB")) == {"all-reduce": 1.0}
    assert shares(fsdp, H100) == {"all-gather": 1.0, "reduce-scatter": 1.0}
    two_nodes = ddp.with_changes(parallel=Parallel(strategy="ddp", num_gpus=16))
    assert shares(two_nodes, H100) == {"all-reduce": 1.0}  # across nodes: runs_nvls_tree's
    boards = ddp.with_changes(parallel=Parallel(strategy="ddp", num_gpus=4, gpus_per_node=4))
    assert shares(boards, H100) == {"all-reduce": 1.0}
    terms = step_terms(ddp, H100, arch)
    (c,) = collectives(ddp, arch, H100)
    assert terms.collectives[0].link_s == pytest.approx(c.bytes_per_gpu / (450e9 * 1.30))
    assert any("NVLS" in n and "1.3x" in n for n in terms.notes)


def test_an_all_reduce_over_two_nvls_nodes_runs_nccls_nvls_tree():
    # 16 H100 in two nodes: a ring's 8 NICs x 50 GB/s = 400 GB/s; NCCL's NVLS tree twice
    # that over the network (800), capped by NVLS inside the node (450 x 1.30 = 585)
    arch = load_architecture("llama-3.2-1b")

    def rate(gpus, gpu=H100, **parallel):
        job = _job(parallel=Parallel(strategy="ddp", num_gpus=gpus, **parallel))
        (c,) = collectives(job, arch, gpu)
        (terms,) = step_terms(job, gpu, arch).collectives
        return c.bytes_per_gpu / terms.link_s, terms, job
    assert rate(16)[0] == pytest.approx(450e9 * 1.30)
    # a slower network binds it at twice the ring's rate: 8 x 25 GB/s x 2
    assert rate(16, network_gb_s=25)[0] == pytest.approx(2 * 8 * 25e9)
    # four nodes keep the ring; so do two without NVLS (A100) and two nodes of one GPU each
    assert rate(32)[0] == pytest.approx(8 * 50e9)
    assert rate(16, get_gpu("A100-80GB"))[0] == pytest.approx(8 * 25e9)
    assert rate(2, gpus_per_node=1)[0] == pytest.approx(50e9)
    terms = step_terms(rate(16)[2], H100, arch)
    assert any("NVLS tree over two nodes" in n for n in terms.notes)


def test_an_infinity_fabric_mesh_gives_a_pair_one_link_of_seven():
    # MI300X: 7 links of 64 GB/s one direction, one to each peer; TP 2 uses its one link
    # to its partner (1/7 of 448 GB/s), TP 4 three of them, a ring of 8 every link
    arch, mi = load_architecture("llama-3.2-1b"), get_gpu("MI300X")
    for tp, share in ((2, 1 / 7), (4, 3 / 7), (8, 1.0)):
        job = _job(batch_size=1, parallel=Parallel(tensor_parallel=tp, num_gpus=tp))
        (c,) = collectives(job, arch, mi)
        assert c.link_share == pytest.approx(share)
        assert step_terms(job, mi, arch).collectives[0].link_s == pytest.approx(
            c.bytes_per_gpu / (448e9 * share))


def test_bridged_pairs_exchange_over_their_bridge_and_everything_else_over_pcie():
    # H100 NVL: NVLink-bridged pairs (300 GB/s one direction), PCIe 5.0 (63) to the rest
    arch, nvl = load_architecture("llama-3.2-1b"), get_gpu("H100-NVL")
    assert (nvl.pair_link_bytes_s, nvl.interconnect_bytes_s) == (300e9, 63e9)
    tp2 = _job(batch_size=1, parallel=Parallel(tensor_parallel=2, num_gpus=2))
    (c,) = collectives(tp2, arch, nvl)
    terms = step_terms(tp2, nvl, arch)
    assert terms.collectives[0].link_s == pytest.approx(c.bytes_per_gpu / 300e9)
    assert any("bridged pair" in n for n in terms.notes)
    # a ring of 4 crosses PCIe; so does a 2-way data-parallel group over TP 2 (stride 2)
    tp4 = _job(batch_size=1, parallel=Parallel(tensor_parallel=4, num_gpus=4))
    assert step_terms(tp4, nvl, arch).collectives[0].link_s == pytest.approx(
        collectives(tp4, arch, nvl)[0].bytes_per_gpu / 63e9)
    dp_over_tp = _job(batch_size=1, parallel=Parallel(strategy="ddp", tensor_parallel=2,
                                                      num_gpus=4))
    reduce = [c for c in collectives(dp_over_tp, arch, nvl) if "ddp" in c.name][0]
    assert (reduce.stride, reduce.link_share, reduce.nvls) == (2, 1.0, False)


def test_geforce_cards_exchange_through_host_memory():
    """No P2P between GeForce cards: NCCL's collectives run through host memory at the
    catalog's 5 GB/s (measured bus bandwidth 4 / the collective factor 0.8), not PCIe's 32."""
    arch, rtx = load_architecture("llama-3.2-1b"), get_gpu("RTX-4090")
    assert not rtx.p2p and rtx.interconnect_bytes_s == 5e9
    job = _job(batch_size=1, parallel=Parallel(strategy="fsdp", num_gpus=2))
    terms = step_terms(job, rtx, arch)
    for c, t in zip(collectives(job, arch, rtx), terms.collectives):
        # the whole link: PCIe is no switchless NVLink mesh ("no NVLink" names NVLink)
        assert (c.link, c.link_share) == ("interconnect", 1.0)
        assert t.link_s == c.bytes_per_gpu / 5e9
    assert any("no peer-to-peer access" in n for n in terms.notes)
    # a pro card of the same chip keeps PCIe (P2P), and says nothing of it
    ada = get_gpu("RTX-6000-Ada")
    assert ada.p2p and not any("peer-to-peer" in n for n in step_terms(job, ada, arch).notes)
    assert ada.gpus_per_node == 4 and collectives(job, arch, ada)[0].link_share == 1.0


def test_the_jobs_own_node_size_decides_what_crosses_the_network():
    # 8 FSDP ranks: one node of the catalog's 8 H200, but two of the job's 4-GPU nodes
    arch, h200 = load_architecture("llama-3.2-1b"), get_gpu("H200")
    job = _job(parallel=Parallel(strategy="fsdp", num_gpus=8))
    assert {c.link for c in collectives(job, arch, h200)} == {"interconnect"}
    four = job.with_changes(parallel=Parallel(strategy="fsdp", num_gpus=8, gpus_per_node=4))
    assert {c.link for c in collectives(four, arch, h200)} == {"network"}


def test_a_ring_across_nodes_uses_the_nics_of_its_gpus_in_each_node():
    # FSDP over 16 H100 (2 nodes of 8): each of NCCL's rings crosses a node through another
    # GPU's NIC, so the 8 GPUs of a node move the ring at 8 x 50 = 400 GB/s (under NVLink's 450)
    arch = load_architecture("llama-3.2-1b")
    job = _job(parallel=Parallel(strategy="fsdp", num_gpus=16))
    gather = collectives(job, arch, H100)[0]
    assert (gather.link, gather.nics) == ("network", 8)
    assert step_terms(job, H100, arch).collectives[0].link_s == gather.bytes_per_gpu / 400e9
    # with TP 4 inside each node, a data-parallel group has 2 ranks per node: 2 x 50 GB/s
    tp4 = job.with_changes(parallel=Parallel(strategy="fsdp", num_gpus=16, tensor_parallel=4))
    gather4 = collectives(tp4, arch, H100)[0]
    assert gather4.nics == 2
    assert step_terms(tp4, H100, arch).collectives[0].link_s == gather4.bytes_per_gpu / 100e9
    # a pipeline's point-to-point send uses one GPU's NIC
    pp = job.with_changes(parallel=Parallel(num_gpus=16, pipeline_parallel=2,
                                            strategy="fsdp"), grad_accum=4)
    send = [c for c in collectives(pp, arch, H100) if "pipeline" in c.name][0]
    assert (send.link, send.nics) == ("network", 1)
    # between two switchless 4-GPU nodes the send goes out through the NIC at its full rate
    # (inside such a node it would have the links to one peer only: 1/3 of NVLink)
    mesh = pp.with_changes(parallel=pp.parallel.model_copy(
        update={"num_gpus": 8, "gpus_per_node": 4}))
    send = [c for c in collectives(mesh, arch, H100) if "pipeline" in c.name][0]
    assert (send.link, send.link_share) == ("network", 1.0)
    inside = mesh.with_changes(parallel=mesh.parallel.model_copy(update={"num_gpus": 4}))
    send = [c for c in collectives(inside, arch, H100) if "pipeline" in c.name][0]
    assert (send.link, send.link_share) == ("interconnect", 1 / 3)


def test_the_jobs_own_network_times_what_crosses_nodes():
    # the same 16-GPU FSDP ring as above on a cluster of 4 x 100 Gb/s per 8 GPUs: 6.25 GB/s
    # per GPU, so 8 x 6.25 = 50 GB/s for the ring, 8x slower than the catalog's H100 node
    arch = load_architecture("llama-3.2-1b")
    par = Parallel(strategy="fsdp", num_gpus=16)
    slow = _job(parallel=par.model_copy(update={"network_gb_s": 6.25}))
    gather = collectives(slow, arch, H100)[0]
    terms = step_terms(slow, H100, arch)
    assert terms.collectives[0].link_s == gather.bytes_per_gpu / 50e9
    assert any("crosses nodes: 6.25 GB/s per GPU (parallel.network_gb_s)" in n
               for n in terms.notes)
    # the catalog's network says so, and how to give the cluster's own
    hint = "--set parallel.network_gb_s=GB/s per GPU for your cluster's"
    assert any(hint in n for n in step_terms(_job(parallel=par), H100, arch).notes)
    assert not any(hint in n for n in terms.notes)
    # inside one node the network is not used: the same step either way
    one_node = Parallel(strategy="fsdp", num_gpus=8)
    assert predict(_job(parallel=one_node), H100).step_time_s == predict(
        _job(parallel=one_node.model_copy(update={"network_gb_s": 6.25})), H100).step_time_s
    # a fresh layout of the planner keeps it (a setting of the job's own)
    from vramplan.planning.layouts import own_settings
    assert own_settings(slow.with_changes(parallel=Parallel(strategy="fsdp", num_gpus=16,
                                                            network_gb_s=6.25)),
                        "ddp") == {"network_gb_s": 6.25}


def test_a_network_of_zero_is_refused():
    with pytest.raises(ValueError, match="network_gb_s"):
        Parallel(strategy="fsdp", num_gpus=16, network_gb_s=0)


def test_async_tensor_parallel_hides_its_collectives_behind_compute():
    arch = load_architecture("llama-3.2-1b")
    job = _job(parallel=Parallel(tensor_parallel=2, num_gpus=2))
    assert collectives(job, arch, H100)[0].overlaps == ""        # on the critical path
    overlapped = job.with_changes(parallel=Parallel(tensor_parallel=2, num_gpus=2,
                                                    async_tp=True))
    assert collectives(overlapped, arch, H100)[0].overlaps == "both"
    assert predict(overlapped, H100).step_time_s < predict(job, H100).step_time_s


def test_gradient_reduction_after_the_backward_is_exposed_whole():
    # DeepSpeed ZeRO 0-2's default, Megatron-LM without --overlap-grad-reduce: the gradient
    # collective waits for the backward, so all of its time adds to the step
    arch = load_architecture("llama-3.2-1b")
    for strategy in ("ddp", "zero1", "zero2", "fsdp", "hybrid-shard"):
        job = _job(parallel=Parallel(strategy=strategy, num_gpus=16))
        after = job.with_changes(parallel=job.parallel.model_copy(
            update={"overlap_grad_reduce": False}))
        grads = [(a.overlaps, b.overlaps) for a, b in zip(collectives(job, arch, H100),
                                                          collectives(after, arch, H100))
                 if "gradient" in a.name]
        assert grads and all(old == "backward" and new == "" for old, new in grads), strategy
        terms = step_terms(after, H100, arch)
        factors = factors_for(H100, num_gpus=16)
        _, exposed = phase_times(terms, factors)
        hidden = sum(c.times * (c.link_s / factors.collective + c.latency_s)
                     for c in terms.collectives if c.overlaps == "")
        if strategy in ("ddp", "zero1", "zero2"):  # nothing else to hide: exposed = all
            assert exposed == pytest.approx(hidden, rel=1e-12)
        slow = predict(after, H100)
        assert slow.step_time_s > predict(job, H100).step_time_s
        waiting = sum(c.times * (c.link_s / factors.collective + c.latency_s)
                      for c in terms.collectives if c.name.startswith("gradient"))
        assert any(n.startswith(f"the gradient reduction runs after the backward "
                                f"(parallel.overlap_grad_reduce false): {waiting:.3g} s")
                   for n in slow.notes), slow.notes
        assert not any("overlap_grad_reduce" in n for n in predict(job, H100).notes)


def test_fp8_attention_runs_at_the_16_bit_rate():
    # float8 converts the linears; flash attention stays bf16: its time is FLOPs / bf16 peak
    arch = load_architecture("llama-3.2-1b")
    bf16 = {p.phase: p for p in step_terms(_job(), H100, arch).phases}
    fp8 = {p.phase: p for p in step_terms(_job(precision="fp8"), H100, arch).phases}
    assert fp8["forward"].attention_s == bf16["forward"].attention_s > 0
    assert fp8["forward"].matmul_s < bf16["forward"].matmul_s


def test_fp8_times_the_head_at_the_16_bit_rate():
    # float8 converts the block linears: the output head's matmuls stay at the bf16 rate
    from vramplan.planning import performance
    from vramplan.planning.efficiency import fp8_ratio
    arch = load_architecture("llama-3.2-1b")
    job = _job(precision="fp8")
    flops = step_flops(job, arch).by_class
    peak8, peak16 = H100.tflops["fp8"] * 1e12, H100.tflops["bf16"] * 1e12
    shape = performance._shape(job, arch, performance._work(job, arch), H100, peak8)
    head, blocks = flops["head"].forward, flops["linear"].forward
    forward = {p.phase: p for p in step_terms(job, H100, arch).phases}["forward"]
    assert head > 0
    assert forward.matmul_s == pytest.approx(
        blocks / (peak8 * shape * fp8_ratio(H100)) + head / (peak16 * shape))


@pytest.mark.parametrize("peft", [None, Peft(rank=8)])
def test_rowwise_with_gw_hp_runs_the_weight_gradients_at_the_16_bit_rate(peft):
    # torchao's rowwise_with_gw_hp keeps grad_weight = input^T @ grad_output in bf16: the
    # block linears' backward loses the fp8 rate on as many FLOPs as their forward has;
    # frozen weights (adapters) compute no weight gradient, so nothing changes
    from vramplan.planning import performance
    from vramplan.planning.efficiency import fp8_ratio
    arch = load_architecture("llama-3.2-1b")
    rowwise = _job(precision="fp8", compile=True, fp8={"recipe": "rowwise"}, peft=peft)
    gw_hp = _job(precision="fp8", compile=True, fp8={"recipe": "rowwise_with_gw_hp"}, peft=peft)
    peak8, peak16 = H100.tflops["fp8"] * 1e12, H100.tflops["bf16"] * 1e12
    shape = performance._shape(rowwise, arch, performance._work(rowwise, arch), H100, peak8)
    wgrad = step_flops(rowwise, arch).by_class["linear"].forward if peft is None else 0.0
    a = {p.phase: p for p in step_terms(rowwise, H100, arch).phases}
    b = {p.phase: p for p in step_terms(gw_hp, H100, arch).phases}
    assert b["forward"].matmul_s == a["forward"].matmul_s
    assert b["backward"].matmul_s - a["backward"].matmul_s == pytest.approx(
        wgrad / (peak16 * shape) - wgrad / (peak8 * shape * fp8_ratio(H100)), abs=1e-12)
    assert (b["backward"].matmul_s > a["backward"].matmul_s) == (peft is None)


def test_fp8_runs_at_the_fp8_rate_only_where_the_gpu_has_fp8():
    # compiled, as torchao's float8 is meant to run: eager, its casts (6 kernels each) cost
    # more than the fp8 matmuls save on a 1B model (traffic._float8_casts)
    bf16, fp8 = _job(compile=True), _job(precision="fp8", compile=True)
    assert predict(fp8, H100).compute_dtype == "fp8"
    assert predict(fp8, H100).step_time_s < predict(bf16, H100).step_time_s
    eager = predict(_job(precision="fp8"), H100)
    assert eager.step_time_s > predict(_job(), H100).step_time_s
    assert any(n.startswith("fp8 without --compile") for n in eager.notes)
    assert not any(n.startswith("fp8 without") for n in predict(fp8, H100).notes)
    a100 = get_gpu("A100-80GB")
    slow = predict(fp8, a100)
    assert slow.compute_dtype == "bf16"
    assert any("no fp8 tensor cores" in n for n in slow.notes)


def test_mfu_tokens_and_flops_are_consistent():
    job = _job(grad_accum=2)
    perf = predict(job, H100)
    flops = step_flops(job)
    assert perf.tokens_per_step == 4 * 2048 * 2
    assert perf.tokens_per_s == pytest.approx(perf.tokens_per_step / perf.step_time_s)
    assert perf.mfu == pytest.approx(2 * flops.model_flops / (perf.step_time_s * 989.4e12),
                                     rel=1e-3)
    assert 0 < perf.mfu < 1
    assert sum(p.time_s * p.per_step for p in perf.phases) == pytest.approx(perf.step_time_s)


def test_more_data_parallel_gpus_train_faster_with_the_same_work_per_gpu():
    one = predict(_job(), H100)
    eight = predict(_job(parallel=Parallel(strategy="ddp", num_gpus=8)), H100)
    assert eight.tokens_per_s > 6 * one.tokens_per_s
    assert eight.tokens_per_s_per_gpu <= one.tokens_per_s_per_gpu
    assert eight.flops_per_step == pytest.approx(8 * one.flops_per_step)


def test_training_time_and_cost_follow_from_the_step():
    job = _job(parallel=Parallel(strategy="ddp", num_gpus=2))
    perf = predict(job, H100, TrainingAmount(tokens=10**9))
    steps = 10**9 / (4 * 2048 * 2)
    assert perf.steps == pytest.approx(steps)
    assert perf.training_time_s == pytest.approx(steps * perf.step_time_s)
    assert perf.gpu_hours == pytest.approx(perf.training_time_s * 2 / 3600)
    assert perf.cost_usd == pytest.approx(perf.gpu_hours * H100.price_per_hour)
    cheap = predict(job, H100, TrainingAmount(tokens=10**9, price_per_hour=1.0))
    assert cheap.cost_usd == pytest.approx(perf.gpu_hours)
    epochs = predict(job, H100, TrainingAmount(epochs=2, dataset_samples=1000))
    assert epochs.steps == pytest.approx(2 * 1000 / 8)
    # no price in the catalog and none given: no cost, the time still
    unpriced = predict(job, get_gpu("MI250X"), TrainingAmount(tokens=10**9))
    assert unpriced.cost_usd is None and unpriced.training_time_s > 0
    assert predict(job, H100).training_time_s is None


def test_a_million_tokens_cost_follows_from_the_price_and_speed():
    """Without an amount the cost of a million tokens, one figure every surface shows: two
    GPUs at 1 USD an hour each, 2 x 4 x 2048 tokens a step."""
    job = _job(parallel=Parallel(strategy="ddp", num_gpus=2))
    perf = predict(job, H100, TrainingAmount(price_per_hour=1.0))
    seconds = perf.step_time_s * 10**6 / (2 * 4 * 2048)
    assert perf.cost_per_million_tokens_usd == pytest.approx(2 * 1.0 * seconds / 3600)
    assert perf.cost_usd is None
    assert predict(job, get_gpu("MI250X")).cost_per_million_tokens_usd is None


def test_a_count_may_be_written_as_the_cli_takes_it():
    """The Python API, the web API and the planner read '2B' as `--tokens 2B` does."""
    assert TrainingAmount(tokens="2B").tokens == 2 * 10**9
    assert TrainingAmount(samples="1.5k", dataset_tokens="1e9").samples == 1500
    assert PlanOptions(tokens="500M", global_batch_tokens="4M").global_batch_tokens == 4 * 10**6


@pytest.mark.parametrize("amount,message", [
    (dict(tokens=0), "tokens: .*greater than or equal to 1"),
    (dict(tokens="2x"), "tokens: '2x' is not a positive count; write e.g. 2B"),
    (dict(tokens=10, samples=10), "not tokens and samples"),
    (dict(epochs=1), "dataset_samples"),
    # a price this large made every cost inf; the bound is the API's and the planner's
    (dict(tokens=10**12, price_per_hour=1e308), "price_per_hour: .*less than or equal to 10000"),
    (dict(tokens=10**15 + 1), "tokens: .*less than or equal"),
])
def test_bad_amounts_are_refused_clearly(amount, message):
    with pytest.raises(JobError, match=message):
        estimate(_job(), gpu="H100-SXM", **amount)


@pytest.mark.parametrize("amount,message", [
    (dict(price_per_hour=-3.0), "price_per_hour: Input should be greater than 0 (got -3.0); "
                                "e.g. 2.49"),
    (dict(epochs=float("inf"), dataset_samples=10),
     "epochs: Input should be a finite number (got inf); e.g. 3"),
    (dict(epochs=2), "epochs needs the dataset's size: dataset_samples (--dataset-samples) or "
                     "dataset_tokens"),
])
def test_the_estimate_and_the_planner_refuse_a_bad_amount_in_the_same_words(amount, message):
    """One wording of a bad amount (errors.validation_message): the value given and a good
    one. Before, the estimate's message left out the value and the planner's was its own."""
    from vramplan.planning.planner import plan

    with pytest.raises(JobError) as by_estimate:
        estimate(_job(), gpu="H100-SXM", **amount)
    with pytest.raises(JobError) as by_plan:
        plan(_job(), **amount)
    assert str(by_estimate.value) == str(by_plan.value) == message


def test_estimate_fills_performance_only_with_a_gpu():
    assert estimate(_job()).performance is None
    report = estimate(_job(peft=Peft(rank=8)), gpu="L4", tokens=10**8)
    assert report.performance.gpu == "L4" and report.performance.cost_usd > 0
    assert report.to_json_dict()["performance"]["step_time_s"] > 0
    assert estimate(Job(model="resnet-50"), gpu="L4").performance is None  # not modelled


def test_performance_imports_no_torch():
    code = ("import sys; from vramplan.api import estimate; from vramplan import Job; "
            "estimate(Job(model='llama-3.2-1b'), gpu='H100-SXM', tokens=10**9); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_a_host_bound_step_says_its_time_is_the_cpus():
    """A step that mostly waits on kernel launches gets a note with the host share; one that
    does not, none; calibrated factors say the host time is the user's own."""
    from vramplan.planning.efficiency import factors_for
    from vramplan.planning.performance import HOST_BOUND_SHARE

    gpu = get_gpu("RTX-4090")
    small = Job(model="gpt2", batch_size=1, seq_len=256)
    perf = predict(small, gpu)
    host = sum(p.time_s * p.per_step for p in perf.phases if p.bound == "host")
    assert host > HOST_BOUND_SHARE * perf.step_time_s
    (note,) = [n for n in perf.notes if n.startswith("host-bound")]
    assert f"{host / perf.step_time_s:.0%} of the step" in note
    assert "vramplan calibrate measures yours" in note
    big = predict(_job(model="llama-3.1-8b", peft=Peft(rank=16)), H100)
    assert not [n for n in big.notes if n.startswith("host-bound")]
    own = factors_for(gpu, num_gpus=1).model_copy(update={"calibrated": True})
    (mine,) = [n for n in predict(small, gpu, factors=own).notes if n.startswith("host-bound")]
    assert "calibrated on your runs" in mine and "slower CPU" not in mine


def test_a_selective_checkpointing_policy_scales_the_host_time_of_forward_and_recompute():
    # torch's SAC policy runs in Python on every op of the forward and the recompute
    # (efficiency.toml [selective_checkpointing], measured by benchmarks/host_ops.py)
    from vramplan.planning.efficiency import sac_host_scale

    arch, scale = load_architecture("llama-3.2-1b"), sac_host_scale()
    assert scale == 1.65

    def host_scales(**changes):
        terms = step_terms(_job(**changes), H100, arch)
        return {p.phase: p.host_scale for p in terms.phases}, terms.notes
    for policy in ("selective", "selective:torchtitan-op"):
        scales, notes = host_scales(checkpointing=policy)
        assert scales == {"forward": scale, "backward": 1.0, "recompute": scale,
                          "optimizer": 1.0}
        assert any("policy runs in Python" in n for n in notes)
    # full checkpointing, every second block fully checkpointed, and compiled blocks: none
    for changes in ({"checkpointing": "full"}, {"checkpointing": "selective:every-2nd-layer"},
                    {"checkpointing": "selective", "compile": True}):
        scales, notes = host_scales(**changes)
        assert set(scales.values()) == {1.0}
        assert not any("policy runs in Python" in n for n in notes)
    # a host-bound phase takes the scale: its launches x kernel_us x 1.65
    terms = step_terms(_job(batch_size=1, seq_len=64, checkpointing="selective"), H100, arch)
    factors = factors_for(H100, num_gpus=1)
    forward = next(p for p in terms.phases if p.phase == "forward")
    (timed, *_), _ = phase_times(terms, factors)
    assert timed.bound == "host"
    assert timed.time_s == pytest.approx(forward.kernels * factors.kernel_us * 1e-6 * scale)
