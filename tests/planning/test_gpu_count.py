"""`search num-gpus` is the planner's fewest GPUs: same counts, layouts, implementations."""

from __future__ import annotations

import itertools

import pytest

from vramplan.engines.formula import estimate as formula
from vramplan.fit import fits_within
from vramplan.hardware import get_gpu
from vramplan.job import Job, Parallel
from vramplan.planning.gpu_count import search_gpu_count
from vramplan.planning.planner import plan

MAX_GPUS = 64
GRID = list(itertools.product(
    ("llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-14b"),
    ("L4", "A100-80GB", "H100-SXM"),
    ("none", "fsdp"),
    (2048, 32768)))


def _planner_fewest(job: Job, gpu: str) -> int | None:
    # the global batch free (micro-batch 1 is the planner's first try at every layout), so
    # the planner may use any data-parallel degree, as num-gpus does
    found = plan(job, gpus=[gpu], max_gpus=MAX_GPUS, allow=("global-batch",), top=50)
    return min((c.num_gpus for c in found.candidates), default=None)


@pytest.mark.parametrize(("model", "gpu", "strategy", "seq"), GRID)
def test_num_gpus_equals_the_planners_fewest(model, gpu, strategy, seq):
    job = Job(model=model, seq_len=seq, checkpointing="full",
              parallel=Parallel(strategy=strategy))
    found = search_gpu_count(job, get_gpu(gpu), max_gpus=MAX_GPUS)
    assert found.best == _planner_fewest(job, gpu)


def test_70b_fsdp_on_h100_needs_16_not_32():
    # the example: powers of two with foreach only said 32
    h100 = get_gpu("H100-SXM")
    job = Job(model="llama-3.1-70b", checkpointing="full", parallel=Parallel(strategy="fsdp"))
    found = search_gpu_count(job, h100)
    assert found.best == 16 and "--optimizer-impl fused" in found.flags
    fit = formula(found.job, gpus=[h100]).fits[0]
    assert fits_within(fit.required_bytes, fit.usable_bytes)
    assert all(not t.fits for t in found.trials if t.num_gpus < 16)


def test_the_planner_never_offers_a_gpu_that_cannot_run_the_precision():
    # V100s have no bf16 tensor cores: the fit table says a bf16-mixed job does not fit
    # them, and the planner (which once judged bytes only) agrees now
    from vramplan.fit import precision_problem

    job = Job(model="llama-3.2-1b", seq_len=2048)
    found = plan(job, tokens=10**9, gpus=["V100-32GB", "A100-80GB"], max_gpus=64, top=50)
    assert precision_problem("bf16-mixed", get_gpu("V100-32GB"))
    assert found.candidates and {c.gpu for c in found.candidates} == {"A100-80GB"}
    assert not formula(job.with_changes(gpu="A100-80GB"), gpus=[get_gpu("V100-32GB")]).fits[0].fits


def test_each_plan_row_says_what_bounds_it(run_cli):
    from vramplan.planning.performance import performance_for

    found = plan(Job(model="llama-3.2-1b", seq_len=2048), tokens=10**9, gpus=["H100-SXM"],
                 max_gpus=8)
    assert found.candidates
    for c in found.candidates:  # the performance model's own verdict for that job
        assert c.bound == performance_for(c.job, get_gpu(c.gpu)).bound
    code, out, _ = run_cli("plan", "llama-3.2-1b", "-s", "2048", "--tokens", "1B", "--gpus",
                           "H100-SXM", "--max-gpus", "8")
    assert code == 0 and "bound" in out


def test_shapes_no_instance_rents_are_owned_hardware():
    # Lambda rents GH200 one at a time (gpus.toml rentable_gpus = [1]); the performance
    # model puts up to 4 (its gpus_per_node) on NVLink, a server nobody rents on demand
    from vramplan.planning.rentable import hardware

    gh200 = get_gpu("GH200")
    assert gh200.rentable_gpus == (1,)
    assert [hardware(gh200, n) for n in (1, 2, 4, 8)] == ["rented", "owned", "owned", "owned"]
    assert hardware(get_gpu("H100-SXM"), 8) == "rented"  # not in the catalog: assumed
    found = plan(Job(model="llama-3.2-1b", seq_len=2048), tokens=10**9, gpus=["GH200"],
                 max_gpus=8, top=50)
    owned = sorted(c.num_gpus for c in found.candidates if c.hardware == "owned")
    assert owned and all(n > 1 for n in owned)
    assert all(c.hardware == "rented" for c in found.candidates if c.num_gpus == 1)
    assert any(n.startswith(", ".join(map(str, owned)) + " x GH200: owned hardware")
               for n in found.notes)
