"""Paged optimizer states in time (planning/paging.py): free when they fit in what the step
leaves of the GPU, and all of them in and out every step, waited on, when they do not."""

import dataclasses

from vramplan import Job
from vramplan.hardware import get_gpu
from vramplan.planning.paging import paging
from vramplan.planning.performance import job_factors, phase_times, predict, step_terms

SMALL = get_gpu("RTX-4070-Ti-SUPER")  # 16 GB, PCIe 4.0 x16
LARGE = get_gpu("RTX-4090")           # 24 GB, PCIe 4.0 x16
# Llama 3.2 1B: 1,235,814,400 parameters; the 33 norm weights (2 per block x 16 + the final
# one) of 2048 elements are under bitsandbytes' 1e5-element paging floor, all else is paged
PAGED_ELEMENTS = 1_235_814_400 - 33 * 2048


def _job(**changes) -> Job:
    return Job(**{"model": "llama-3.2-1b", "batch_size": 1, "seq_len": 2048,
                  "precision": "bf16-pure", "checkpointing": "full", "optimizer": "paged-adamw",
                  **changes})


def test_states_that_do_not_fit_beside_the_step_move_in_and_out_every_step():
    paged = paging(_job(), SMALL)
    assert paged.states == 8 * PAGED_ELEMENTS  # fp32 exp_avg and exp_avg_sq
    assert 0 < paged.free < paged.states       # the step fits, its states do not
    assert paged.moved == 2 * paged.states
    eight_bit = paging(_job(optimizer="paged-adamw-8bit", batch_size=4), SMALL)
    assert eight_bit.states == 2 * PAGED_ELEMENTS  # 8-bit exp_avg and exp_avg_sq
    assert eight_bit.free == 0 and eight_bit.moved == 4 * PAGED_ELEMENTS


def test_states_that_fit_stay_on_the_gpu_and_cost_nothing():
    paged = paging(_job(), LARGE)
    assert paged.free > paged.states and paged.moved == 0
    assert step_terms(_job(), LARGE).phases[-1].paged_s == 0
    assert paging(_job(optimizer="adamw-8bit"), SMALL) is None  # nothing in unified memory


def test_the_optimizer_waits_on_the_paging_at_the_host_links_rate():
    job = _job()
    terms = step_terms(job, SMALL)
    optimizer = terms.phases[-1]
    assert optimizer.phase == "optimizer"
    assert optimizer.paged_s == 2 * 8 * PAGED_ELEMENTS / 31.5e9  # PCIe 4.0 x16
    factors = job_factors(job, SMALL)
    unpaged = dataclasses.replace(terms, phases=terms.phases[:-1] + (
        dataclasses.replace(optimizer, paged_s=0.0),))
    with_paging, _ = phase_times(terms, factors)
    without, _ = phase_times(unpaged, factors)
    added = with_paging[-1].time_s - without[-1].time_s
    assert abs(added - optimizer.paged_s / factors.host_link) < 1e-12  # never hidden
    assert with_paging[-1].bound == "host link"


def test_the_report_says_why_the_step_pages():
    perf = predict(_job(), SMALL)
    assert any(n.startswith("paged optimizer states (9.21 GiB in unified memory) do not fit")
               and "18.41 GiB over its PCIe 4.0 x16 link" in n for n in perf.notes)
    assert not any(n.startswith("paged optimizer states (") for n in predict(
        _job(), LARGE).notes)
