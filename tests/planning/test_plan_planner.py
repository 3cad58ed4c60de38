"""Planner invariants, make-it-fit, and the techniques table."""

from __future__ import annotations

import pytest

from vramplan.engines.formula import estimate as formula
from vramplan.errors import JobError, UnknownNameError
from vramplan.hardware import get_gpu
from vramplan.job import Job, Parallel
from vramplan.planning.flops import step_flops
from vramplan.planning.make_fit import make_it_fit
from vramplan.planning.planner import plan
from vramplan.planning.techniques import ALLOW_NAMES, TECHNIQUES, allowed

JOB = Job(model="llama-3.2-1b", seq_len=2048)
GPUS = ["L4", "A100-80GB", "H100-SXM", "RTX-4090"]


@pytest.fixture(scope="module")
def result():
    return plan(JOB, tokens=1_000_000_000, gpus=GPUS, max_gpus=16, top=50)


def test_every_row_fits_its_gpu_with_the_margin(result):
    assert result.status == "ok" and result.candidates
    for c in result.candidates:
        fit = formula(c.job, gpus=[get_gpu(c.gpu)]).fits[0]
        assert fit.required_bytes == c.device_total_bytes
        assert fit.required_bytes <= 0.95 * fit.usable_bytes


def test_no_row_on_the_front_is_dominated(result):
    for c in result.front:
        assert not any(o.cost_usd <= c.cost_usd and o.training_time_s <= c.training_time_s
                       and (o.cost_usd < c.cost_usd or o.training_time_s < c.training_time_s)
                       for o in result.candidates)
    costs = [c.cost_usd for c in result.front]
    assert costs == sorted(costs)


def test_picks_and_reasons(result):
    assert result.fastest.candidate.training_time_s == min(
        c.training_time_s for c in result.candidates)
    assert result.cheapest.candidate.cost_usd == min(c.cost_usd for c in result.candidates)
    assert result.recommended.candidate in result.front
    for choice in (result.cheapest, result.fastest, result.recommended):
        assert choice.reason and choice.candidate.gpu in choice.reason


def test_by_default_only_changes_that_keep_the_maths(result):
    for c in result.candidates:
        assert c.job.peft is None and c.job.precision == JOB.precision
        assert c.job.optimizer == JOB.optimizer and not c.job.offload.optimizer


def test_more_gpus_never_fewer_total_flops():
    job = JOB.with_changes(batch_size=4)
    totals = [step_flops(job).total * n for n in (1, 2, 4, 8)]
    sharded = [step_flops(job.with_changes(parallel=Parallel(strategy="fsdp", num_gpus=n)))
               .total * n for n in (1, 2, 4, 8)]
    assert totals == sorted(totals) and sharded == totals


def test_global_batch_is_kept():
    result = plan(JOB, tokens=10**9, gpus=["H100-SXM"], max_gpus=8, global_batch=32)
    for c in result.candidates:
        assert c.job.effective_batch == 32


def test_nothing_fits_is_an_answer_with_the_closest_miss_and_a_way_to_fit():
    result = plan(Job(model="llama-3.1-70b", seq_len=2048), tokens=10**9, gpus=["L4"],
                  max_gpus=4)
    assert result.status == "nothing-fits" and not result.candidates
    assert result.closest_miss.startswith("L4:")
    assert result.ruled_out[0].gpu == "L4" and "does not fit" in result.ruled_out[0].reason
    assert result.to_fit  # e.g. QLoRA or offloading, which were not allowed


def test_a_gpu_without_the_jobs_precision_is_ruled_out_for_that_not_for_memory():
    # a bf16 LoRA of a 1B model fits a V100-32GB's memory many times over; it was ruled out
    # as "does not fit ... needs 5 GiB of its 32 GiB (-85%)"
    job = Job(model="llama-3.2-1b", seq_len=512, peft={"method": "lora"})
    result = plan(job, tokens=10**8, gpus=["V100-32GB", "L4"], max_gpus=1)
    (v100,) = [r for r in result.ruled_out if r.gpu == "V100-32GB"]
    assert "has no bf16 tensor cores" in v100.reason and "fit" not in v100.reason
    assert [c.gpu for c in result.candidates] == ["L4"]
    # a 70B model is too large for it as well: both reasons
    big = plan(job.with_changes(model="llama-3.1-70b"), tokens=10**8, gpus=["V100-16GB"],
               max_gpus=1).ruled_out[0].reason
    assert "has no bf16 tensor cores" in big and "nor does it fit" in big


def test_constraints_nobody_meets():
    result = plan(JOB, tokens=10**9, gpus=["H100-SXM"], max_gpus=8, max_cost=0.01)
    assert result.status == "constraints-unmet" and "fastest" in result.closest_miss


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(tokens=0), JobError, "tokens"),
    (dict(tokens=10, allow=("lora", "magic")), JobError, "magic"),
    (dict(tokens=10, gpus=["H1OO"]), UnknownNameError, "H1OO"),
    (dict(tokens=10, margin=0.9), JobError, "margin"),
    (dict(tokens=10, deadline_s=-1), JobError, "deadline"),
])
def test_bad_input(kwargs, error, message):
    with pytest.raises(error, match=message):
        plan(JOB, **kwargs)


def test_make_it_fit_keeps_the_maths_first_and_gives_numbers():
    job = Job(model="llama-3.2-1b", batch_size=8, seq_len=2048)
    l4 = get_gpu("L4")
    assert not formula(job, gpus=[l4]).fits[0].fits
    fixes = make_it_fit(job, l4)
    assert fixes
    for fix in fixes:
        fit = formula(fix.job, gpus=[l4]).fits[0]
        assert fit.required_bytes <= 0.95 * fit.usable_bytes
        assert not fix.changes_maths and "GiB" in fix.summary and fix.flags.startswith("--")


def test_techniques_table():
    names = [t.name for t in TECHNIQUES]
    assert len(names) == len(set(names))
    assert set(ALLOW_NAMES) == {"8bit", "bf16-pure", "fp8", "lora", "offload", "qlora"}
    assert all(not t.changes_maths for t in allowed(()))
    assert {t.name for t in TECHNIQUES if t.changes_maths} == {
        "LoRA", "QLoRA", "8-bit AdamW", "bf16 weights", "fp8 training"}


def test_min_gpus_is_the_smallest_count_that_fits():
    from vramplan.planning.gpu_count import search_gpu_count

    def min_gpus(job, gpu, **options):
        return search_gpu_count(job, gpu, **options).job

    h100 = get_gpu("H100-SXM")
    job = Job(model="llama-3.1-8b", seq_len=2048, checkpointing="full")
    found = min_gpus(job, h100)
    n = found.parallel.num_gpus
    assert n > 1 and found.parallel.strategy in ("zero2", "fsdp")
    fit = formula(found, gpus=[h100]).fits[0]
    assert fit.required_bytes <= 0.95 * fit.usable_bytes
    for strategy in ("zero2", "fsdp"):  # half as many GPUs fit with neither strategy
        half = job.with_changes(parallel=Parallel(strategy=strategy, num_gpus=n // 2))
        fit = formula(half, gpus=[h100]).fits[0]
        assert fit.required_bytes > 0.95 * fit.usable_bytes
    assert min_gpus(Job(model="llama-3.1-405b"), get_gpu("L4"), max_gpus=4) is None


# --- the global batch: the planner keeps the maths of training -------------------------------


def test_default_keeps_the_jobs_own_global_batch(result):
    # JOB: batch_size 1 x grad_accum 1 x 1 GPU = 1 sample per step; every candidate keeps it
    assert result.global_batch == 1
    assert all(c.job.effective_batch == 1 for c in result.candidates)
    assert any("own global batch is 1 sample" in n and "--global-batch" in n
               for n in result.notes)


def test_the_jobs_own_global_batch_with_accumulation_and_gpus():
    # 2 per micro-batch x 4 accumulation x 2 data-parallel GPUs = 16 samples per step
    job = JOB.with_changes(batch_size=2, grad_accum=4,
                           parallel=Parallel(strategy="ddp", num_gpus=2))
    found = plan(job, tokens=10**9, gpus=["H100-SXM"], max_gpus=64)
    assert found.global_batch == 16 and found.candidates
    assert {c.job.effective_batch for c in found.candidates} == {16}
    # up to 16 data-parallel ranks x tp 8 = 128 GPUs can share 16 samples: every count up
    # to 64 has a layout, none is reported unusable
    assert max(c.num_gpus for c in found.candidates) <= 64
    assert not any("GPUs not used" in n for n in found.notes)


def test_global_batch_tokens_is_samples_of_the_sequence():
    # 65,536 tokens / 2048 tokens per sample = 32 samples
    found = plan(JOB, tokens=10**9, gpus=["H100-SXM"], max_gpus=8, global_batch_tokens=65_536)
    assert found.global_batch == 32
    assert {c.job.effective_batch for c in found.candidates} == {32}


def test_global_batch_tokens_rounds_to_a_splittable_count():
    from vramplan.planning.planner import _round_samples

    # 4,000,000 / 2048 = 1953.125 samples: 2048 (a multiple of 1024) is 4.9% away
    assert _round_samples(4_000_000 / 2048) == 2048
    assert _round_samples(3.0) == 3          # 2 (a multiple of 2) is 33% away: keep 3
    found = plan(JOB, tokens=10**9, gpus=["H100-SXM"], max_gpus=8,
                 global_batch_tokens=4_000_000)
    assert found.global_batch == 2048 and any("+4.9%" in n for n in found.notes)


def test_512_gpus_cannot_share_a_global_batch_of_64():
    # BERT-base has 12 heads: tensor parallelism 1, 2 or 4 (12 % 8 != 0); it is an encoder,
    # so no pipeline or context parallelism. 512 GPUs / tp 4 = 128 data-parallel ranks > 64
    # samples: ruled out. 256 GPUs = tp 4 x 64 ranks of 1 sample is the largest usable.
    job = Job(model="bert-base-uncased", seq_len=512)
    found = plan(job, tokens=10**9, gpus=["H100-SXM"], max_gpus=512, global_batch=64, top=50)
    counts = {c.num_gpus for c in found.candidates}
    assert 512 not in counts and max(counts) <= 256
    assert {c.job.effective_batch for c in found.candidates} == {64}
    assert all(64 % c.job.parallel.data_parallel == 0 for c in found.candidates)
    assert any(n.startswith("512 GPUs not used") for n in found.notes)


def test_allow_global_batch_frees_it():
    found = plan(JOB, tokens=10**9, gpus=["H100-SXM"], max_gpus=8, allow=("global-batch",))
    assert found.global_batch is None
    assert all(c.job.grad_accum == 1 for c in found.candidates)
    assert len({c.job.effective_batch for c in found.candidates}) > 1


def test_global_batch_bad_input():
    with pytest.raises(JobError, match="not both"):
        plan(JOB, tokens=10, global_batch=8, global_batch_tokens=8192)
    with pytest.raises(JobError, match="global_batch_tokens"):
        plan(JOB, tokens=10, global_batch_tokens=0)


def test_gpu_count_search_records_every_trial_and_prefers_zero2():
    from vramplan.planning.gpu_count import search_gpu_count

    h100 = get_gpu("H100-SXM")
    job = Job(model="llama-3.1-8b", seq_len=2048, checkpointing="full")
    result = search_gpu_count(job, h100)
    assert result.fits and result.job.parallel.num_gpus == result.best
    last = result.trials[-1]
    assert last.fits and last.num_gpus == result.best and last.strategy == result.strategy
    assert all(not t.fits for t in result.trials[:-1])
    assert [t.num_gpus for t in result.trials][0] == 1 and result.trials[0].strategy == "none"
    # at the answer's count, ZeRO-2 is tried first; FSDP only when ZeRO-2 did not fit
    at_best = [t.strategy for t in result.trials if t.num_gpus == result.best]
    assert at_best[0] == "zero2"
    # a job that names its strategy keeps it
    fsdp = search_gpu_count(job.with_changes(parallel=Parallel(strategy="fsdp")), h100)
    assert {t.strategy for t in fsdp.trials if t.num_gpus > 1} == {"fsdp"}
    assert fsdp.best <= result.best


def test_gpu_count_search_says_what_more_gpus_cannot_shrink():
    from vramplan.planning.gpu_count import search_gpu_count

    # 70B at 2048 tokens without checkpointing: activations outgrow 8 H100s
    job = Job(model="llama-3.1-70b", seq_len=2048)
    result = search_gpu_count(job, get_gpu("H100-SXM"), max_gpus=8)
    assert not result.fits and result.best is None and result.job is None
    assert max(t.num_gpus for t in result.trials) == 8
    assert "--checkpointing full" in result.hint
    # 16 fit once tensor parallelism splits the activations too (tp 4 x FSDP 4, fused)
    found = search_gpu_count(job, get_gpu("H100-SXM"), max_gpus=16)
    assert found.best == 16 and found.job.parallel.tensor_parallel == 4


def test_make_it_fit_skips_changes_the_model_refuses():
    # the default LoRA targets (q/k/v/o_proj) match no MPT linear: the stacked search
    # raised that JobError, so `estimate mpt-7b --gpu L4` exited 2 (T5 now takes its
    # family's targets, models/lora_targets.py, so its LoRA fixes name q and v)
    from vramplan import Job
    from vramplan.engines.formula import estimate
    from vramplan.planning.make_fit import with_fixes
    job = Job(model="mpt-7b", gpu="L4")
    fixed = with_fixes(estimate(job), job)
    assert fixed.to_fit and all("lora" not in f.flags for f in fixed.to_fit)
    t5 = Job(model="t5-3b", gpu="L4")
    assert with_fixes(estimate(t5), t5).to_fit
