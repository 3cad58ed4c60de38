"""FSDP without gradient sync between micro-batches (parallel.fsdp_no_sync): who turns it
on, what it costs in time, and what it refuses. Its memory is checked against the trace in
tests/engines/test_formula_vs_trace.py."""

import json

import pytest

from vramplan import Job
from vramplan.errors import JobError
from vramplan.frameworks.configs.read import read_config_text
from vramplan.hardware import get_gpu
from vramplan.models import load_architecture
from vramplan.planning.comm import collectives
from vramplan.planning.performance import predict


def _job(**parallel) -> Job:
    return Job(model="llama-3.1-8b", batch_size=2, seq_len=2048, grad_accum=4,
               checkpointing="full",
               parallel={"strategy": "fsdp", "num_gpus": 16, "gpus_per_node": 8, **parallel})


def test_the_gradients_are_reduce_scattered_once_per_step_and_the_step_is_shorter():
    gpu = get_gpu("H100-SXM")
    arch = load_architecture("llama-3.1-8b")

    def by_name(job):
        return {c.name: c for c in collectives(job, arch, gpu)}
    synced, held = by_name(_job()), by_name(_job(fsdp_no_sync=True))
    scatter = "gradient reduce-scatter (fsdp)"
    assert (synced[scatter].per, held[scatter].per) == ("micro-batch", "step")
    assert synced[scatter].bytes_per_gpu == held[scatter].bytes_per_gpu
    gathers = [n for n in synced if "all-gather" in n]
    assert gathers and all(held[n] == synced[n] for n in gathers)  # still every micro-batch
    assert predict(_job(fsdp_no_sync=True), gpu).step_time_s < predict(_job(), gpu).step_time_s


def test_the_hf_trainer_and_accelerate_hold_whole_gradients_under_fsdp_torchtitan_does_not():
    def held(framework, strategy):
        return Job(model="gpt2", framework=framework, grad_accum=2,
                   parallel={"strategy": strategy, "num_gpus": 4}).parallel.fsdp_no_sync
    for framework in ("hf-trainer", "accelerate"):
        assert all(held(framework, s) for s in ("fsdp", "zero3", "zero2", "hybrid-shard"))
        assert not held(framework, "ddp")
    assert not held("torchtitan", "fsdp") and not held("plain", "fsdp")


def test_sync_each_batch_and_deepspeed_turn_it_off_in_a_trainer_config():
    base = {"output_dir": "o", "model_name_or_path": "gpt2", "gradient_accumulation_steps": 2,
            "fsdp": "full_shard auto_wrap"}

    def held(**extra):
        read = read_config_text(json.dumps({**base, **extra}), path=__import__(
            "pathlib").Path("args.json"), local_files=False)
        return read.job(parallel={"num_gpus": 4}).parallel.fsdp_no_sync
    assert held()
    assert not held(accelerator_config={"gradient_accumulation_kwargs": {
        "sync_each_batch": True}})
    ds = {k: v for k, v in base.items() if k != "fsdp"}
    read = read_config_text(json.dumps({**ds, "deepspeed": {"zero_optimization": {"stage": 3}}}),
                            path=__import__("pathlib").Path("args.json"), local_files=False)
    job = read.job(parallel={"num_gpus": 4})
    assert job.parallel.strategy == "zero3" and not job.parallel.fsdp_no_sync


def test_it_is_refused_where_there_is_no_fsdp():
    with pytest.raises(JobError, match="fsdp_no_sync is FSDP's: strategy ddp"):
        Job(model="gpt2", parallel={"strategy": "ddp", "num_gpus": 2, "fsdp_no_sync": True})


@pytest.mark.parametrize("framework", ["torchtune", "torchtitan"])
def test_torchtune_and_torchtitan_sync_every_micro_batch_and_refuse_it(framework):
    """Their training loops reduce-scatter each micro-batch's gradients (profiles.toml cites
    the code): their FSDP jobs never hold whole gradients, and asking for it is refused."""
    fsdp = {"strategy": "fsdp", "num_gpus": 4}
    assert not Job(model="gpt2", framework=framework, grad_accum=2,
                   parallel=fsdp).parallel.fsdp_no_sync
    with pytest.raises(JobError, match=f"{framework} does not support "
                       "parallel.fsdp_no_sync=True"):
        Job(model="gpt2", framework=framework, grad_accum=2,
            parallel={**fsdp, "fsdp_no_sync": True})


def test_make_it_fit_shards_the_gradients_and_writes_the_trainers_own_key():
    """Llama 3.1 8B under the Trainer's FSDP on 8 A100-40GB with 8 micro-batches holds its
    whole fp32 gradients (32 GB per GPU) and does not fit; reduce-scattering every
    micro-batch does, and the fix is written as accelerate's sync_each_batch."""
    from pathlib import Path

    from vramplan.frameworks.configs.write import config_changes, override_line
    from vramplan.planning.make_fit import make_it_fit

    text = json.dumps({"output_dir": "o", "model_name_or_path": "meta-llama/Llama-3.1-8B",
                       "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8,
                       "bf16": True, "fsdp": "full_shard auto_wrap", "max_length": 2048,
                       "gradient_checkpointing": True})
    read = read_config_text(text, path=Path("args.json"), local_files=False)
    job = read.job(gpu="A100-40GB", parallel={"num_gpus": 8})
    assert job.parallel.fsdp_no_sync
    fixes = make_it_fit(job, get_gpu("A100-40GB"), allow=(), limit=10)
    fix = next(f for f in fixes if f.job.parallel.fsdp_no_sync is False)
    assert fix.job.with_changes(parallel={**fix.job.parallel.model_dump(),
                                          "fsdp_no_sync": True}) == job
    changes, missing = config_changes(read, job, fix.job)
    key = "accelerator_config.gradient_accumulation_kwargs.sync_each_batch"
    assert changes == {key: True} and not missing
    assert override_line(read, changes).endswith(
        """--accelerator_config '{"gradient_accumulation_kwargs": {"sync_each_batch": true}}'""")


def test_a_fix_that_switches_to_fsdp_lets_the_framework_decide_again():
    """A Trainer job on DDP has fsdp_no_sync false (DDP has no such switch); make-it-fit's
    FSDP fix must not carry that false over: under FSDP the Trainer holds whole gradients.
    A plain job's FSDP fix does not; a switch asked for explicitly is kept."""
    from vramplan.planning.techniques import technique

    def ddp(framework):
        return Job(model="gpt2", framework=framework, grad_accum=4,
                   parallel={"strategy": "ddp", "num_gpus": 8})
    fsdp = technique("FSDP / ZeRO-3")
    assert fsdp.applied(ddp("hf-trainer")).parallel.fsdp_no_sync
    assert not fsdp.applied(ddp("plain")).parallel.fsdp_no_sync
    held = Job(model="gpt2", grad_accum=4,
               parallel={"strategy": "fsdp", "num_gpus": 8, "fsdp_no_sync": True})
    assert Job.model_validate({**held.model_dump(), "parallel": held.parallel.changed(
        num_gpus=16)}).parallel.fsdp_no_sync


def test_search_num_gpus_keeps_the_trainers_no_sync_as_the_planner_does():
    """`search num-gpus` builds fresh layouts; what they leave unset the framework decides,
    as in the planner: a Trainer FSDP job keeps holding whole gradients, and the flags do
    not turn it off (they did: --no-fsdp-no-sync)."""
    from vramplan.planning.gpu_count import search_gpu_count
    from vramplan.planning.planner import plan

    job = Job(model="llama-3.1-8b", framework="hf-trainer", grad_accum=4,
              parallel={"strategy": "fsdp", "num_gpus": 2})
    found = search_gpu_count(job, get_gpu("A100-40GB"))
    assert found.job.parallel.strategy == "fsdp" and found.job.parallel.fsdp_no_sync
    assert "fsdp-no-sync" not in found.flags
    planned = [c.job for c in plan(job, tokens=1e8).candidates
               if c.job.parallel.strategy == "fsdp"]
    assert planned and all(j.parallel.fsdp_no_sync for j in planned)
