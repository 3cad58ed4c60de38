"""The web app's JSON API, in-process with FastAPI's TestClient."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

import vramplan  # noqa: E402
from vramplan.job import Job  # noqa: E402
from vramplan.web import create_app  # noqa: E402
from vramplan.web.schemas import MAX_CONFIG_BYTES, MAX_REQUEST_BYTES  # noqa: E402
from vramplan.web.server import is_local, server_url  # noqa: E402

TINY_LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1000, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def client():
    app = create_app(max_queued_traces=1)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    app.state.traces.close()


def test_estimate_equals_the_library(client):
    job = {"model": "gpt2", "batch_size": 4, "seq_len": 256,
           "peft": {"method": "lora", "target_modules": ["c_attn"]}}
    r = client.post("/api/v1/estimate", json={"job": job})
    assert r.status_code == 200
    expected = vramplan.estimate(Job.model_validate(job)).to_json_dict()
    assert r.json()["report"] == expected
    assert r.json()["command"] == ("vramplan estimate gpt2 --batch-size 4 --seq-len 256 "
                                   "--peft lora --lora-targets c_attn")
    assert r.json()["charts"] is None


def test_a_clusters_own_network_gives_the_librarys_answer(client):
    job = {"model": "llama-3.2-1b", "gpu": "H100-SXM",
           "parallel": {"strategy": "fsdp", "num_gpus": 16, "network_gb_s": 6.25}}
    r = client.post("/api/v1/estimate", json={"job": job})
    assert r.status_code == 200
    assert r.json()["report"] == vramplan.estimate(Job.model_validate(job)).to_json_dict()
    assert "--set parallel.network_gb_s=6.25" in r.json()["command"]


def test_estimate_charts_and_html(client):
    r = client.post("/api/v1/estimate", json={"job": {"model": "gpt2"}, "charts": True})
    charts = r.json()["charts"]
    assert set(charts) == {"breakdown", "fit"} and all(s.startswith("<svg") for s in
                                                        charts.values())
    page = client.post("/api/v1/estimate?format=html", json={"job": {"model": "gpt2"}})
    assert page.headers["content-type"].startswith("text/html")
    assert "script-src 'none'" in page.headers["content-security-policy"]
    assert "vramplan estimate gpt2" in page.text and "<script" not in page.text


@pytest.mark.parametrize("job, field, words", [
    ({"model": "gpt2", "batch_size": 0}, "job.batch_size", "greater than or equal to 1"),
    ({"model": "gpt2", "batch_size": 10**9}, "job.batch_size", "less than or equal to 1000000"),
    ({"model": "gpt2", "target_len": 10**12}, "job.target_len", "less than or equal"),
    ({"model": "gpt2", "precision": "fp9"}, "job.precision", "must be one of"),
    ({"model": "gpt2", "colour": "red"}, "job.colour", "unknown key 'colour'; allowed: model,"),
    ({"model": "gpt2", "batchsize": 2}, "job.batchsize", "(did you mean 'batch_size'?)"),
    ({"model": "gpt2", "peft": {"rnk": 8}}, "job.peft.rnk", "(did you mean 'rank'?)"),
    ({"model": "gpt2", "parallel": {"network_gb_s": 0}}, "job.parallel.network_gb_s",
     "greater than 0"),
    ({"model": "gpt2", "gpu": "L5"}, "job.gpu", "Did you mean 'L4'"),
    ({"model": "/etc/passwd"}, "job.model", "paths, module:factory references"),
    ({"model": "mypkg.models:build"}, "job.model", "not a catalog model"),
    ({"model": "../../secret/config.json"}, "job.model", "not a catalog model"),
    # (a chat/instruct variant of a catalog model resolves to it: tests/models/test_user_models.py)
    ({"model": "someorg/Some-Model-7B"}, "job.model", "Hub downloads are refused"),
])
def test_bad_input_is_a_422_naming_the_field(client, job, field, words):
    r = client.post("/api/v1/estimate", json={"job": job})
    assert r.status_code == 422
    fields = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert field in fields and words in fields[field]
    assert "Traceback" not in r.text


def test_a_bad_field_reads_as_a_job_file_with_it_does(client):
    """One wording (errors.describe): the web's message for each field is the CLI's."""
    from vramplan.errors import JobError
    from vramplan.job import job_from_dict

    job = {"model": "gpt2", "batch_size": 0, "precison": "bf16-mixed"}
    with pytest.raises(JobError) as cli:
        job_from_dict(job)
    r = client.post("/api/v1/estimate", json={"job": job})
    assert r.status_code == 422
    messages = [e["message"] for e in r.json()["errors"]]
    assert len(messages) == 2 and all(m in str(cli.value) for m in messages)
    assert "batch_size: Input should be greater than or equal to 1 (got 0)" in str(cli.value)


@pytest.mark.parametrize(("path", "model"), [
    ("/api/v1/estimate", "EstimateRequest"), ("/api/v1/plan", "PlanRequest")])
def test_an_unknown_request_key_names_the_route_s_keys(client, path, model):
    """A mistyped key beside the job gets its close match and the keys the route's request
    body allows (its own model's fields), as a Job key does."""
    from vramplan.web import schemas

    allowed = list(getattr(schemas, model).model_fields)
    r = client.post(path, json={"job": {"model": "gpt2"}, "max_gpu": 4, "tokns": 10})
    assert r.status_code == 422
    errors = {e["field"]: e["message"] for e in r.json()["errors"]}
    hint = {"max_gpu": "max_gpus" if "max_gpus" in allowed else None, "tokns": "tokens"}
    for key, close in hint.items():
        message = errors[key]
        assert message.startswith(f"unknown key {key!r}")
        assert (f"did you mean {close!r}" in message) == (close is not None)
        assert message.endswith("allowed: " + ", ".join(allowed))


def test_a_catalog_hf_id_is_accepted(client):
    r = client.post("/api/v1/estimate", json={"job": {"model": "openai-community/gpt2"}})
    assert r.status_code == 200, r.text


def test_impossible_combination_and_engine_refusal(client):
    r = client.post("/api/v1/estimate", json={"job": {
        "model": "gpt2", "optimizer_in_backward": True, "grad_accum": 2}})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "job"
    r = client.post("/api/v1/estimate", json={"job": {"model": "gpt2", "seq_len": 4096}})
    assert r.status_code == 422 and "1024 learned positions" in r.json()["error"]


def test_wrong_content_type_size_and_json(client):
    r = client.post("/api/v1/estimate", content=b"model=gpt2",
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "JSON" in r.json()["error"]
    r = client.post("/api/v1/estimate", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 422
    big = b'{"job": {"model": "gpt2"}, "pad": "' + b"x" * MAX_REQUEST_BYTES + b'"}'
    r = client.post("/api/v1/estimate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_uploaded_config_is_data(client):
    r = client.post("/api/v1/estimate", json={"job": {"model": "tiny", "seq_len": 128},
                                              "config": TINY_LLAMA})
    assert r.status_code == 200, r.text
    from vramplan.engines.formula import estimate
    expected = estimate(Job(model="tiny", seq_len=128), model_config=TINY_LLAMA)
    assert r.json()["report"] == expected.to_json_dict()
    # the command names the file the user keeps beside it, never a server path
    assert r.json()["command"] == "vramplan estimate config.json --seq-len 128"


@pytest.mark.parametrize("config, words", [
    ({**TINY_LLAMA, "model_type": "my_custom_code"}, "is not supported"),
    ({"hidden_size": 8}, "has no model_type"),
    ({**TINY_LLAMA, "hidden_size": 10**40}, "number out of range"),
    ({k: v for k, v in TINY_LLAMA.items() if k != "num_hidden_layers"}, "num_hidden_layers"),
    ({**TINY_LLAMA, "auto_map": {"AutoModel": "evil.py--Model"}, "pad": "x" * MAX_CONFIG_BYTES},
     "larger than 1 MiB"),
])
def test_bad_uploads_are_refused(client, config, words):
    r = client.post("/api/v1/estimate", json={"job": {"model": "tiny"}, "config": config})
    assert r.status_code in (413, 422)
    assert words in r.text


def test_upload_label_cannot_be_a_path(client):
    r = client.post("/api/v1/estimate", json={"job": {"model": "/etc/passwd"},
                                              "config": TINY_LLAMA})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "job.model"


def test_models_and_gpus(client):
    names = [m["name"] for m in client.get("/api/v1/models", params={"q": "llama-3"}).json()]
    assert "llama-3.2-1b" in names and all("llama-3" in n for n in names)
    assert client.get("/api/v1/models", params={"limit": 0}).status_code == 422
    gpus = {g["name"]: g for g in client.get("/api/v1/gpus").json()}
    assert gpus["L4"]["usable_bytes"] == vramplan.hardware.get_gpu("L4").usable_bytes


def test_allow_lists_every_plan_allow_name_with_its_techniques(client):
    from vramplan.planning.techniques import TECHNIQUES

    allow = client.get("/api/v1/allow").json()
    assert list(allow) == [*sorted({t.allow for t in TECHNIQUES if t.allow}), "global-batch"]
    assert allow["offload"] == "optimizer offload / activation offload"
    assert allow["bf16-pure"] == "bf16 weights"


def test_search_equals_the_library(client):
    job = {"model": "gpt2", "seq_len": 512, "gpu": "L4"}
    r = client.post("/api/v1/search", json={"job": job})
    assert r.status_code == 200
    expected = vramplan.max_batch_size(Job.model_validate(job), vramplan.estimate,
                                       vramplan.hardware.get_gpu("L4").usable_bytes)
    assert r.json()["best"] == expected.best
    r = client.post("/api/v1/search", json={"job": {"model": "gpt2"}})
    assert r.status_code == 422 and "job.gpu" in r.json()["error"]
    r = client.post("/api/v1/search", json={"job": job, "parameter": "seq_len"})
    assert r.json()["best"] == 1024 and r.json()["capped"]  # gpt2 stops at 1024 positions


def test_sweep_rows_and_limits(client):
    r = client.post("/api/v1/sweep", json={"job": {"model": "gpt2"}, "batch_sizes": [4, 1, 4],
                                           "seq_lens": [128], "gpus": ["L4"], "margin": 0.1})
    assert r.status_code == 200
    data = r.json()
    limit = int(vramplan.hardware.get_gpu("L4").usable_bytes * 0.9)
    assert data["limits"] == {"L4": limit}
    assert [row["batch_size"] for row in data["rows"]] == [1, 4]  # sorted, deduplicated
    for row in data["rows"]:
        peak = vramplan.estimate(Job(model="gpt2", batch_size=row["batch_size"],
                                     seq_len=128)).device_total
        assert row["device_total"] == peak and row["fits_gpu"]["L4"] == (peak <= limit)
    r = client.post("/api/v1/sweep", json={"job": {"model": "gpt2"}, "batch_sizes": [0]})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "batch_sizes"
    r = client.post("/api/v1/sweep", json={"job": {"model": "gpt2"},
                                           "batch_sizes": list(range(1, 100))})
    assert r.status_code == 422


def test_export_yaml_and_command(client):
    r = client.post("/api/v1/export", json={"job": {"model": "gpt2", "batch_size": 2},
                                            "command": "sweep"})
    assert r.json() == {"command": "vramplan sweep gpt2 --batch-size 2",
                        "yaml": "model: gpt2\nbatch_size: 2\n", "settings_without_flag": []}


def test_unknown_routes_and_methods_are_json(client):
    r = client.get("/api/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert client.get("/api/v1/estimate").status_code == 405
    assert client.get("/api/v1/trace/" + "0" * 32).status_code == 404


def test_page_is_one_offline_file(client):
    r = client.get("/")
    assert r.status_code == 200 and "<script>" in r.text
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    for attribute in ("src=", "href="):
        for part in r.text.split(attribute)[1:]:
            assert not part.lstrip("\"'").startswith(("http:", "https:", "//"))


def test_openapi_documents_the_api(client):
    spec = client.get("/openapi.json").json()
    for path in ("/api/v1/estimate", "/api/v1/trace", "/api/v1/search", "/api/v1/sweep",
                 "/api/v1/models", "/api/v1/gpus", "/api/v1/export"):
        assert path in spec["paths"]
    assert "Job" in spec["components"]["schemas"]
    page = client.get("/docs")  # offline: FastAPI's default page would load a CDN
    assert page.status_code == 200 and "/api/v1/sweep" in page.text
    assert "<script" not in page.text and "cdn" not in page.text.lower()
    assert client.get("/redoc").status_code == 404


def test_server_binds_localhost_by_default():
    assert server_url() == "http://127.0.0.1:8000/"
    assert is_local("127.0.0.1") and is_local("localhost") and is_local("::1")
    assert not is_local("0.0.0.0") and not is_local("192.168.1.4")


# --- traces: a worker process, a queue limit, a time limit -----------------------------------


def _wait(client, task_id, seconds=120):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = client.get(f"/api/v1/trace/{task_id}").json()
        if status["status"] in ("done", "error"):
            return status
        time.sleep(0.3)
    raise AssertionError("trace did not finish")


@pytest.mark.torch
def test_trace_runs_in_a_worker_and_the_queue_is_bounded(client):
    body = {"job": {"model": "tiny", "seq_len": 32}, "config": TINY_LLAMA}
    first = client.post("/api/v1/trace", json=body)
    assert first.status_code == 202
    # max_queued_traces=1: a second trace while the first runs is refused
    second = client.post("/api/v1/trace", json=body)
    assert second.status_code == 429 and "already queued or running" in second.json()["error"]
    status = _wait(client, first.json()["id"])
    assert status["status"] == "done", status
    from vramplan.engines.trace import trace
    expected = trace(Job(model="tiny", seq_len=32), model_config=TINY_LLAMA)
    report = status["report"]
    assert report["engine"] == "trace" and report["peak_allocated"] == expected.peak_allocated
    assert report["timeline"]
    html = client.get(f"/api/v1/trace/{first.json()['id']}?format=html")
    assert "Memory over the step" in html.text
    with_charts = client.get(f"/api/v1/trace/{first.json()['id']}?charts=true").json()
    assert with_charts["charts"]["timeline"].startswith("<svg")


@pytest.mark.torch
def test_trace_time_limit_is_reported(client):
    r = client.post("/api/v1/trace", json={"job": {"model": "gpt2", "batch_size": 2},
                                           "time_limit_s": 0.001})
    status = _wait(client, r.json()["id"])
    assert status["status"] == "error" and "time" in status["error"].lower()
    assert "Traceback" not in json.dumps(status)


@pytest.mark.torch
def test_a_dead_worker_is_reported_and_replaced():
    import os
    import signal

    from vramplan.web.traces import TraceQueue

    queue = TraceQueue(max_pending=2)
    try:
        job = Job(model="gpt2", batch_size=1, seq_len=16).model_dump(mode="json")
        first = queue.submit(job, None, 60)
        deadline = time.monotonic() + 60
        while not queue._executor._processes and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in list(queue._executor._processes):
            os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer would
        while queue.get(first.id)[0].finished is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "worker stopped" in queue.get(first.id)[0].error
        second = queue.submit(job, None, 60)  # a fresh worker takes the next trace
        while queue.get(second.id)[0].finished is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert queue.get(second.id)[0].result["engine"] == "trace"
    finally:
        queue.close()


def test_plan_equals_the_library(client):
    from vramplan.planning.planner import plan

    body = {"job": {"model": "llama-3.2-1b", "seq_len": 1024}, "tokens": 10**9,
            "gpus": ["L4", "A100-80GB"], "max_gpus": 8, "allow": ["lora"]}
    r = client.post("/api/v1/plan", json=body)
    assert r.status_code == 200, r.text
    expected = plan(Job(model="llama-3.2-1b", seq_len=1024), tokens=10**9,
                    gpus=["L4", "A100-80GB"], max_gpus=8, allow=("lora",))
    assert r.json()["plan"] == expected.model_dump(mode="json")
    as_typed = client.post("/api/v1/plan", json={**body, "tokens": "1B"})  # as the CLI reads it
    assert as_typed.json()["plan"] == r.json()["plan"]
    typo = client.post("/api/v1/plan", json={**body, "tokens": "1 billion"})
    assert typo.status_code == 422 and typo.json()["errors"][0]["field"] == "tokens"
    assert "write e.g. 2B, 500M" in typo.json()["errors"][0]["message"]
    page = client.post("/api/v1/plan?format=html", json=body).text
    assert ("vramplan plan llama-3.2-1b --seq-len 1024 --tokens 1B --gpus "
            "L4,A100-80GB --max-gpus 8 --allow lora") in page  # the defaults left out
    bad = client.post("/api/v1/plan", json={**body, "allow": ["magic"], "max_gpus": 10**6})
    fields = {e["field"] for e in bad.json()["errors"]}
    assert bad.status_code == 422 and {"allow.0", "max_gpus"} <= fields
    upload = client.post("/api/v1/plan", json={**body, "job": {"model": "tiny"},
                                               "config": TINY_LLAMA})
    assert upload.status_code == 422 and "catalog models only" in upload.json()["error"]


def test_the_pages_choices_are_the_jobs_own(client):
    """The page's selects are filled from /api/v1/choices, which reads the Job's Literal
    types: each offers exactly the Job's values, its default first (a value added to the
    Job reaches the page), and the page restates none of them."""
    import re
    import typing
    from pathlib import Path

    from vramplan import job as job_module

    page = (Path(job_module.__file__).parent / "web" / "page.html").read_text()
    offered = client.get("/api/v1/choices").json()
    assert offered == job_module.choices()
    literals = {"precision": (job_module.Precision, "bf16-mixed"),
                "parallel.strategy": (job_module.Strategy, "none"),
                "optimizer": (job_module.Optimizer, "adamw"),
                "checkpointing": (job_module.Checkpointing, "none"),
                "attention": (job_module.Attention, "sdpa"),
                "loss": (job_module.Loss, "standard"),
                "parallel.pipeline_schedule": (job_module.PipelineSchedule, "1f1b"),
                "framework": (job_module.Framework, "plain"),
                "optimizer_impl": (job_module.OptimizerImpl, "foreach")}
    for path, (literal, default) in literals.items():
        assert offered[path][0] == default, path
        assert sorted(offered[path]) == sorted(typing.get_args(literal)), path
    selects = dict(re.findall(r'<select id="([^"]+)" name="[^"]+" data-choice="([^"]+)">'
                              r'</select>', page))
    assert set(selects.values()) == set(literals)
    assert "<option>" not in page  # no select restates a Job value
    assert offered["fsdp_strategies"] == list(job_module.FSDP_STRATEGIES)
    assert offered["sharded_strategies"] == list(job_module.SHARDED_STRATEGIES)
    assert offered["chunked_schedules"] == list(job_module.CHUNKED_SCHEDULES)
    assert '"fsdp", "hybrid-shard"' not in page  # nor the strategies with FSDP's switch
    assert '"interleaved"' not in page  # nor the schedules that take chunks


def test_a_refused_pipeline_names_its_field(client):
    """An engine's refusal that one field causes carries that field's path, so the page can
    show it beside the field (16 blocks over 4 stages hold at most 4 chunks per GPU)."""
    job = {"model": "llama-3.2-1b", "parallel": {
        "num_gpus": 4, "pipeline_parallel": 4, "pipeline_schedule": "interleaved",
        "pipeline_chunks": 5}}
    r = client.post("/api/v1/estimate", json={"job": job})
    assert r.status_code == 422
    [item] = r.json()["errors"]
    assert item["field"] == "job.parallel.pipeline_chunks"
    assert "use at most 4 chunks per GPU" in item["message"]
