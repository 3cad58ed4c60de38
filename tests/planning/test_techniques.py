"""The techniques table: each technique applies itself; every consumer reads the table."""

from __future__ import annotations

import dataclasses

from vramplan.engines.formula import estimate as formula
from vramplan.fit import fits_within
from vramplan.hardware import get_gpu
from vramplan.job import Job
from vramplan.planning import techniques
from vramplan.planning.make_fit import make_it_fit, with_fixes
from vramplan.planning.planner import PLANNER_ALLOW, _Search
from vramplan.planning.techniques import ALLOW_NAMES, TECHNIQUES, technique
from vramplan.search.suggestions import suggestions_for

L4 = get_gpu("L4")
FULL_FINE_TUNE = Job(model="llama-3.1-8b", gpu="L4")  # bf16-mixed AdamW, batch 1


def test_each_technique_applies_itself_or_says_it_does_not_apply():
    job = Job(model="llama-3.1-8b", batch_size=8)
    assert technique("full checkpointing").apply(job).checkpointing == "full"
    half = technique("gradient accumulation").apply(job)
    assert (half.batch_size, half.grad_accum) == (4, 2)  # the effective batch stays 8
    assert technique("optimizer in backward").apply(job).optimizer_in_backward
    assert technique("bf16 weights").apply(job).precision == "bf16-pure"
    assert technique("FSDP / ZeRO-3").apply(job).parallel.num_gpus == 2
    done = job.with_changes(checkpointing="full", precision="bf16-pure")
    assert technique("full checkpointing").apply(done) is None
    assert technique("bf16 weights").apply(done) is None
    assert technique("tensor parallelism").apply(job) is None  # the planner picks degrees
    # refused combinations are not applied: no optimizer in backward with accumulation
    assert technique("optimizer in backward").applied(job.with_changes(grad_accum=2)) is None


def test_make_it_fit_finds_a_full_fine_tune_for_8b_on_an_l4():
    fit = formula(FULL_FINE_TUNE).fits[0]
    assert not fit.fits
    fixes = make_it_fit(FULL_FINE_TUNE, L4, allow=ALLOW_NAMES)
    full = [f for f in fixes if f.job.peft is None]
    assert full, [f.flags for f in fixes]
    fix = full[0]
    job = fix.job
    assert (job.precision, job.optimizer_in_backward, job.offload.optimizer) == (
        "bf16-pure", True, True) and job.peft is None and job.optimizer == "adamw"
    again = formula(job).fits[0]  # the numbers are the formula's for that job
    assert again.required_bytes == fix.device_total_bytes
    assert fits_within(again.required_bytes, again.usable_bytes)
    assert "--precision bf16-pure" in fix.flags and "--offload-optimizer" in fix.flags
    assert "--optimizer-in-backward" in fix.flags
    # and estimate shows it among its fixes
    report = with_fixes(formula(FULL_FINE_TUNE), FULL_FINE_TUNE)
    assert any(f.job.peft is None for f in report.to_fit)


def test_fixes_are_smallest_changes_ranked_by_how_much_they_change():
    job = Job(model="llama-3.1-8b", batch_size=8, seq_len=2048, gpu="L4")
    fixes = make_it_fit(job, L4, allow=ALLOW_NAMES, limit=20)
    names = [set(f.changes) for f in fixes]
    for i, a in enumerate(names):  # no fix holds another
        assert not any(b < a for b in names[:i] + names[i + 1:])
    keys = [(f.changes_maths, len(f.changes)) for f in fixes if f.job.peft is not None
            or f is fixes[-1]]
    assert keys[:-1] == sorted(keys[:-1])


def _without(names: set[str]):
    return tuple(t for t in TECHNIQUES if t.name not in names)


def test_every_consumer_reads_the_table(monkeypatch):
    gone = {"LoRA", "QLoRA", "full checkpointing", "selective checkpointing"}
    monkeypatch.setattr(techniques, "TECHNIQUES", _without(gone))
    # make-it-fit composes only what the table holds
    fixes = make_it_fit(FULL_FINE_TUNE, L4, allow=ALLOW_NAMES, limit=20)
    assert fixes and not any(set(f.changes) & gone for f in fixes)
    assert all(f.job.peft is None and f.job.checkpointing == "none" for f in fixes)
    # the planner's variants come from it
    search = _Search(Job(model="llama-3.2-1b"), [L4], None, 0.05, ("lora", "qlora"), 1, 8)
    assert not any("peft" in v for v in search.variants())
    # search's suggestions come from it
    assert not any(line.startswith(("full checkpointing", "selective checkpointing"))
                   for line in suggestions_for(Job(model="llama-3.2-1b"), "activations"))
    # with a technique changed, make-it-fit uses the change
    swapped = tuple(dataclasses.replace(t, apply=lambda job: None) if t.name == "optimizer "
                    "offload" else t for t in TECHNIQUES)
    monkeypatch.setattr(techniques, "TECHNIQUES", swapped)
    assert not any("optimizer offload" in f.changes
                   for f in make_it_fit(FULL_FINE_TUNE, L4, allow=ALLOW_NAMES, limit=20))


def test_allow_names_are_the_tables_everywhere():
    import typing

    from vramplan.cli.commands.plan import plan as plan_command
    from vramplan.web.schemas import PlanRequest

    schema = PlanRequest.model_json_schema()["properties"]["allow"]["items"]["enum"]
    assert schema == [*ALLOW_NAMES, PLANNER_ALLOW]
    assert ALLOW_NAMES == tuple(sorted({t.allow for t in TECHNIQUES if t.allow}))
    hint = typing.get_type_hints(plan_command.__wrapped__, include_extras=True)["allow"]
    assert ",".join(ALLOW_NAMES) in hint.__metadata__[0].help  # the CLI's --allow help
