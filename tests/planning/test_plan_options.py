"""Plan options are one validated model: the CLI, vramplan.plan and POST /api/v1/plan take
the same fields with the same defaults and ranges, and give the same plan."""

from __future__ import annotations

import json

import pytest

import vramplan
from vramplan.errors import JobError
from vramplan.fit import MAX_MARGIN
from vramplan.planning.options import DEFAULT_MAX_GPUS, PlanOptions, plan_options

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from vramplan.web import create_app
    return TestClient(create_app())


def test_the_web_schema_is_the_plan_options():
    from vramplan.web.schemas import PlanRequest

    assert set(PlanOptions.model_fields) <= set(PlanRequest.model_fields)
    for name, field in PlanOptions.model_fields.items():
        assert PlanRequest.model_fields[name].default == field.default, name
    assert PlanRequest.model_fields["max_gpus"].default == DEFAULT_MAX_GPUS == 512
    assert "global_batch_tokens" in PlanRequest.model_fields


def test_one_margin_range():
    assert plan_options(margin=0.49).margin == 0.49
    for bad in (MAX_MARGIN, 0.9, -0.1, float("nan")):
        with pytest.raises(JobError, match="0 to 0.5"):
            plan_options(margin=bad)


def test_cli_api_and_web_give_the_same_plan(run_cli, client):
    job = vramplan.Job(model="llama-3.2-1b", seq_len=2048)
    options = dict(tokens=10**9, gpus=["L4", "H100-SXM"], max_gpus=8,
                   global_batch_tokens=65_536, allow=["lora"])
    api = vramplan.plan(job, **options).model_dump(mode="json")
    web = client.post("/api/v1/plan", json={"job": job.model_dump(mode="json"), **options})
    assert web.status_code == 200, web.text
    code, out, err = run_cli("plan", "llama-3.2-1b", "-s", "2048", "--tokens", "1B",
                             "--gpus", "L4,H100-SXM", "--max-gpus", "8",
                             "--global-batch-tokens", "65536", "--allow", "lora", "--json")
    assert code == 0, err
    assert json.loads(out) == api == web.json()["plan"]
    assert api["global_batch"] == 32  # 65,536 tokens / 2048 per sample


def test_bad_plan_options_are_one_line_everywhere(run_cli, client):
    code, _, err = run_cli("plan", "llama-3.2-1b", "--tokens", "1B", "--max-cost", "nan")
    assert code == 2 and err.count("\n") == 1 and "max_cost: Input should be a finite number" in err
    bad = client.post("/api/v1/plan", json={"job": {"model": "llama-3.2-1b"}, "margin": 0.7})
    assert bad.status_code == 422 and "0 to 0.5" in bad.text
