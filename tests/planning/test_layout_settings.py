"""A changed job keeps what it left unset unset, and fresh layouts (the planner's, `search
num-gpus`') keep the job's own parallel settings: one answer for one job, whichever surface
built it."""

from vramplan import Job
from vramplan.hardware import get_gpu
from vramplan.job import FSDP_STRATEGIES, Parallel
from vramplan.models import load_architecture
from vramplan.planning.comm import collectives, node_size
from vramplan.planning.layouts import parallel_layouts
from vramplan.planning.performance import predict

RTX_4090 = get_gpu("RTX-4090")  # the catalog's 4090 servers hold 4 GPUs


def test_a_changed_job_takes_its_node_size_from_the_catalog_as_before():
    """with_changes used to pin every unset field: the node size became 8, so 8 RTX 4090s
    were one node (PCIe) instead of two (the network) after any change."""
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024,
              parallel=Parallel(strategy="ddp", num_gpus=8))
    changed = job.with_changes(batch_size=4)
    assert RTX_4090.gpus_per_node == 4
    assert node_size(job, RTX_4090) == node_size(changed, RTX_4090) == 4
    arch = load_architecture(job.model)
    assert [c.link for c in collectives(changed, arch, RTX_4090)] == ["network"]
    built = Job(model="llama-3.2-1b", batch_size=4, seq_len=1024,
                parallel=Parallel(strategy="ddp", num_gpus=8))
    assert predict(changed, RTX_4090).step_time_s == predict(built, RTX_4090).step_time_s


def test_a_node_size_the_job_sets_stays_through_changes_and_layouts():
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024,
              parallel=Parallel(strategy="ddp", num_gpus=8, gpus_per_node=8))
    assert node_size(job.with_changes(batch_size=4), RTX_4090) == 8
    layouts = parallel_layouts(job, load_architecture(job.model), 8)
    assert layouts and all(p.gpus_per_node == 8 for p in layouts)


def test_fresh_layouts_keep_the_jobs_own_switches():
    job = Job(model="llama-3.1-8b", batch_size=1, seq_len=2048, grad_accum=4,
              parallel=Parallel(strategy="fsdp", num_gpus=8, overlap_grad_reduce=False,
                                async_tp=True, fsdp_no_sync=True))
    layouts = parallel_layouts(job, load_architecture(job.model), 16)
    # 16 GPUs: data-parallel layouts, and "none" where tensor x pipeline fill them all
    assert {p.strategy for p in layouts} == {"none", "ddp", "zero2", "fsdp", "hybrid-shard"}
    assert all(not p.overlap_grad_reduce and p.async_tp for p in layouts)
    # FSDP's switch only where there is FSDP (DDP and "none" refuse it)
    assert all(p.fsdp_no_sync == (p.strategy in FSDP_STRATEGIES) for p in layouts)
    # what the job left unset stays unset, for its framework (or the catalog) to decide
    assert all("gpus_per_node" not in p.model_fields_set for p in layouts)


def test_search_num_gpus_and_the_planner_keep_a_gradient_reduce_after_the_backward():
    """A job whose gradient reduction waits for the backward (DeepSpeed's default, Megatron
    without --overlap-grad-reduce) kept it in `plan` only when its own layout was tried."""
    from vramplan.planning.gpu_count import search_gpu_count
    from vramplan.planning.planner import plan

    job = Job(model="llama-3.1-8b", grad_accum=4,
              parallel={"strategy": "fsdp", "num_gpus": 2, "overlap_grad_reduce": False})
    found = search_gpu_count(job, get_gpu("A100-40GB"))
    assert found.job is not None and not found.job.parallel.overlap_grad_reduce
    planned = [c.job for c in plan(job, tokens=1e8).candidates if c.job.parallel.num_gpus > 1]
    assert planned and not any(j.parallel.overlap_grad_reduce for j in planned)
