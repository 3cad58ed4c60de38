"""The one table of Job fields and flags (vramplan/fields.py): every consumer reads it, and
the flags each one writes really build the job they describe."""

from __future__ import annotations

import json
import shlex

import pytest

from vramplan.cli.options import _JOB_FLAGS, _TEXT_FLAGS
from vramplan.fields import JOB_FIELDS, field_for
from vramplan.job import Job, Offload, Parallel, Peft
from vramplan.planning.changes import describe_changes
from vramplan.planning.options import PlanOptions, plan_words
from vramplan.views.command import FLAGS, cli_command


def test_the_cli_and_the_reproduce_command_read_the_table():
    assert _JOB_FLAGS == {f.name: (f.path, f.short, f.help) for f in JOB_FIELDS}
    assert _TEXT_FLAGS == {"lora_targets", "cuda_context"}
    assert FLAGS == {f.path: f.written for f in JOB_FIELDS}
    assert field_for(("parallel", "tensor_parallel")).written == "--tp"
    assert field_for(("peft", "dropout")) is None  # no flag: --set


BEFORE = Job(model="llama-3.2-1b", batch_size=4, seq_len=1024)
AFTERS = [
    BEFORE.with_changes(batch_size=1, grad_accum=4, checkpointing="full"),
    BEFORE.with_changes(peft=Peft(method="qlora", rank=8), optimizer="adamw-8bit"),
    BEFORE.with_changes(precision="bf16-pure", optimizer_in_backward=True,
                        offload=Offload(optimizer=True), loss="chunked"),
    BEFORE.with_changes(parallel=Parallel(strategy="fsdp", num_gpus=16, tensor_parallel=2),
                        optimizer_impl="fused"),
]


@pytest.mark.parametrize("after", AFTERS)
def test_the_flags_of_a_change_build_the_changed_job(run_cli, after):
    _, flags = describe_changes(BEFORE, after)
    before_words = shlex.split(cli_command(BEFORE))[2:]  # drop "vramplan estimate"
    code, out, err = run_cli("estimate", *before_words, *shlex.split(flags), "--json")
    assert code in (0, 1), err
    assert Job.model_validate(json.loads(out)["job"]) == after


def test_plan_words_read_the_plan_options():
    options = PlanOptions(tokens=10**9, gpus=("L4",), deadline_s=86400.0, allow=("lora",),
                          global_batch_tokens=65536)
    assert plan_words(options) == ("--tokens", "1B", "--gpus", "L4", "--deadline",
                                   "86400", "--allow", "lora", "--global-batch-tokens",
                                   "65536")
    assert plan_words(PlanOptions()) == ()
