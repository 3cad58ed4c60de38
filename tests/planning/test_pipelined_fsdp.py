"""FSDP kept gathered after forward (parallel.reshard_after_forward false) and FSDP under a
pipeline (torch's schedules defer its gradient sync and resharding to a schedule's last
micro-batch): the gathered parameters held, the whole fp32 gradients kept, and the
collectives left, in memory and time; torchtitan's fsdp_reshard_after_forward."""

from pathlib import Path

import pytest

from vramplan import Job, estimate
from vramplan.engines.formula.per_gpu import per_gpu_params
from vramplan.engines.step import describe_step
from vramplan.errors import JobError
from vramplan.frameworks.configs import ConfigError
from vramplan.frameworks.configs.read import read_config_text
from vramplan.hardware import get_gpu
from vramplan.models import load_architecture
from vramplan.planning.comm import collectives
from vramplan.planning.performance import step_terms

ARCH = load_architecture("llama-3.2-1b")
H100 = get_gpu("H100-SXM")
# Llama 3.2 1B: 16 blocks of 60,821,504 parameters (q, o 2048^2; k, v 2048 x 512; gate, up,
# down 2048 x 8192; two norms), 262,670,336 outside them (the tied embedding, the final norm)
BLOCK, OUTSIDE = 60_821_504, 262_670_336
TOTAL = 16 * BLOCK + OUTSIDE


def _fsdp(**parallel) -> Job:
    return Job(model="llama-3.2-1b", batch_size=2, seq_len=2048, grad_accum=4,
               checkpointing="full",
               parallel={"strategy": "fsdp", "num_gpus": 8, **parallel})


def _gathered(job: Job) -> tuple[float, float]:
    params = describe_step(job, ARCH).params
    *_, gathered, root, _comm, _notes, _end = per_gpu_params(job, params)
    return gathered, root


def test_kept_gathered_the_forward_ends_holding_every_parameter_in_bf16():
    # fp32 weights under bf16 autocast gather in bf16: two blocks (current and prefetched)
    # and the root while resharding, all of them when not
    assert _gathered(_fsdp()) == (2 * (2 * BLOCK + OUTSIDE), 2 * OUTSIDE)
    assert _gathered(_fsdp(reshard_after_forward=False)) == (2 * TOTAL, 0.0)
    held = estimate(_fsdp(reshard_after_forward=False)).categories["temporary"]
    assert held - estimate(_fsdp()).categories["temporary"] == 2 * TOTAL - 2 * (
        2 * BLOCK + OUTSIDE)


def test_kept_gathered_the_backward_gathers_nothing():
    def gathers(job):
        return {c.name: c.per for c in collectives(job, ARCH, H100) if "all-gather" in c.name}
    assert gathers(_fsdp()) == {"parameter all-gather, forward (fsdp)": "micro-batch",
                                "parameter all-gather, backward (fsdp)": "micro-batch"}
    assert gathers(_fsdp(reshard_after_forward=False)) == {
        "parameter all-gather, forward (fsdp)": "micro-batch"}


def test_under_a_pipeline_fsdp_gathers_and_reduces_once_per_schedule():
    job = _fsdp(num_gpus=16, pipeline_parallel=2, reshard_after_forward=False,
                pipeline_flushes=2)
    assert job.parallel.defers_gradient_sync and job.parallel.gathers_once_per_schedule
    per = {c.name: c.per for c in collectives(job, ARCH, H100)
           if "fsdp" in c.name}
    assert per == {"parameter all-gather, forward (fsdp)": "schedule",
                   "gradient reduce-scatter (fsdp)": "schedule"}
    times = {c.name: c.times for c in step_terms(job, H100).collectives if "fsdp" in c.name}
    assert set(times.values()) == {2}  # one per schedule: 2 flushes of 2 micro-batches
    # resharding after forward, each micro-batch still gathers twice; the sync stays deferred
    resharding = _fsdp(num_gpus=16, pipeline_parallel=2)
    per = {c.name: c.per for c in collectives(resharding, ARCH, H100) if "fsdp" in c.name}
    assert per["parameter all-gather, backward (fsdp)"] == "micro-batch"
    assert per["gradient reduce-scatter (fsdp)"] == "schedule"


def test_under_a_pipeline_fsdp_holds_whole_fp32_gradients_between_micro_batches():
    job = _fsdp(num_gpus=16, pipeline_parallel=2)
    report = estimate(job)
    stage = describe_step(job, ARCH)
    trainable = max(stage.stage_params(s).trainable for s in stage.stages)
    assert report.categories["gradients"] == pytest.approx(4 * trainable, abs=2)
    assert any("torch's pipeline schedules turn FSDP's gradient sync off" in n
               for n in report.notes)
    sharded = estimate(_fsdp(num_gpus=16, pipeline_parallel=2, strategy="ddp"))
    assert not any("gradient sync off" in n for n in sharded.notes)


def test_torchtitan_keeps_fsdp_gathered_under_a_pipeline_by_default():
    def job(parallel: str) -> Job:
        text = f'[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\n{parallel}'
        return read_config_text(text, path=Path("job.toml"), format="torchtitan",
                                model="llama-3.2-1b").job()
    assert job("data_parallel_shard_degree = 2").parallel.reshard_after_forward
    pipelined = "data_parallel_shard_degree = 2\npipeline_parallel_degree = 2\n"
    assert not job(pipelined).parallel.reshard_after_forward
    always = job(pipelined + 'fsdp_reshard_after_forward = "always"')
    assert always.parallel.reshard_after_forward
    assert not job('data_parallel_shard_degree = 2\nfsdp_reshard_after_forward = "never"'
                   ).parallel.reshard_after_forward
    with pytest.raises(ConfigError, match="takes always, never, default"):
        job('data_parallel_shard_degree = 2\nfsdp_reshard_after_forward = "sometimes"')
    # a job given by hand takes torchtitan's default from its profile
    by_hand = Job(model="llama-3.2-1b", framework="torchtitan",
                  parallel={"strategy": "fsdp", "num_gpus": 4, "pipeline_parallel": 2})
    assert not by_hand.parallel.reshard_after_forward
    assert Job(model="llama-3.2-1b", framework="torchtitan",
               parallel={"strategy": "ddp", "num_gpus": 4, "pipeline_parallel": 2}
               ).parallel.reshard_after_forward


def test_reshard_after_forward_is_fsdps_own():
    with pytest.raises(JobError, match="reshard_after_forward is FSDP's"):
        Job(model="llama-3.2-1b", parallel={"strategy": "ddp", "num_gpus": 2,
                                            "reshard_after_forward": False})


def test_a_kept_gathered_job_plans_other_strategies_without_the_setting():
    """The planner's layouts keep reshard_after_forward only where parameters are sharded:
    a SHARD_GRAD_OP job's DDP and ZeRO-2 layouts drop it (they were refused)."""
    from vramplan.planning.layouts import parallel_layouts

    job = _fsdp(reshard_after_forward=False)
    layouts = parallel_layouts(job, ARCH, 8)
    by = {p.strategy: p for p in layouts if p.tensor_parallel == 1 and p.pipeline_parallel == 1}
    assert not by["fsdp"].reshard_after_forward
    assert by["ddp"].reshard_after_forward and by["zero2"].reshard_after_forward
    assert "reshard_after_forward" not in by["zero2"].model_fields_set
    moved = job.with_changes(parallel=job.parallel.changed(strategy="ddp"))
    assert moved.parallel.reshard_after_forward
