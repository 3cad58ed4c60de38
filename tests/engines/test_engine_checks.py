"""Job x Architecture checks run once for every engine (engines/checks.py): the formula, the
trace and measure refuse the same jobs with the same line, before any model is built."""

from __future__ import annotations

import pytest

from vramplan.engines.checks import check_job, check_job_for_engine
from vramplan.engines.registry import run_engine
from vramplan.errors import JobError
from vramplan.job import Job, Parallel
from vramplan.models import load_architecture

BAD = [
    (dict(model="gpt2", seq_len=4096), "longer than gpt2's 1024 learned positions"),
    (dict(model="llama-3.2-1b", parallel=Parallel(num_gpus=3, tensor_parallel=3)),
     "tensor_parallel=3 must divide llama-3.2-1b's 32 attention heads"),
    (dict(model="bert-base-uncased", image_size=224), "image_size does not apply to"),
    (dict(model="llama-3.2-1b", task="image-classification"),
     "does not support task 'image-classification'"),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_check_job_refuses(fields, message):
    job = Job(**fields)
    with pytest.raises(JobError, match=message):
        check_job(job, load_architecture(job.model))
    with pytest.raises(JobError, match=message):
        run_engine(job, "formula")


@pytest.mark.parametrize("engine", ["trace", "measure"])
@pytest.mark.parametrize(("fields", "message"), BAD)
def test_every_engine_refuses_the_same_job_with_the_same_line(engine, fields, message):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    job = Job(**fields)
    with pytest.raises(JobError) as formula:
        run_engine(job, "formula")
    with pytest.raises(JobError) as other:
        run_engine(job, engine)
    assert str(other.value) == str(formula.value)


def test_models_no_architecture_describes_are_left_to_the_engine():
    check_job_for_engine(Job(model="my_pkg.models:build"))  # a factory: the engine builds it
    check_job_for_engine(Job(model="x"), model_config={"model_type": "no-such-family"})
    check_job_for_engine(Job(model="llama-3.2-1b", seq_len=1024))  # a good job passes
