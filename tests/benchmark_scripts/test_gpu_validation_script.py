"""benchmarks/gpu_validation.py's CPU side: its job list, --predict-only, --rescore and the
time-budgeted, failure-guarded job loop (the GPU part runs only on a lent GPU)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from vramplan import Job

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_validation.json"
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_validation",
                                                  ROOT / "benchmarks" / "gpu_validation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_job_is_a_valid_job_and_v1_comes_first(script):
    jobs = [Job.model_validate(fields) for fields in script.JOBS]
    assert len(jobs) >= 30
    assert len({json.dumps(f, sort_keys=True) for f in script.JOBS}) == len(jobs)  # no repeats
    v1 = [row["job"] for row in json.loads(RESULTS.read_text())["rows"]]
    assert script.V1_JOBS == len(v1) == 19 and script.JOBS[:19] == v1
    # local model configs exist (paths are relative to the repository root)
    for fields in script.JOBS:
        if fields["model"].endswith(".json"):
            assert (ROOT / fields["model"]).is_file()


def test_the_jobs_cover_every_profile_and_technique(script):
    jobs = [Job.model_validate(fields) for fields in script.JOBS]
    assert {"hf-trainer", "torchtune", "torchtitan"} <= {j.framework for j in jobs}
    assert {"adamw-8bit", "paged-adamw-8bit", "paged-adamw", "adamw-4bit", "adamw-fp8"} <= {
        j.optimizer for j in jobs}
    assert {"full", "selective", "selective:torchtitan-op", "selective:every-2nd-layer"} <= {
        j.checkpointing for j in jobs}
    assert any(j.peft and j.peft.method == "qlora" for j in jobs)
    assert any(j.peft and j.peft.method == "lora" for j in jobs)
    assert any(j.precision == "fp8" for j in jobs)
    assert any(j.loss == "chunked" for j in jobs) and any(j.activation_offload for j in jobs)
    assert {True, False} == {j.compile for j in jobs}
    assert max(j.seq_len or 0 for j in jobs) >= 16384
    moe = [j for j in jobs if j.model.endswith("mixtral-mini.json")]
    assert {None, "lora", "qlora"} == {j.peft.method if j.peft else None for j in moe}
    # every compiled job has an eager twin (same fields without compile)
    for fields in script.JOBS:
        if fields.get("compile"):
            assert {k: v for k, v in fields.items() if k != "compile"} in script.JOBS


@pytest.mark.torch
def test_predict_only_on_two_tiny_jobs(script, tmp_path, monkeypatch):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_LLAMA))
    jobs = [dict(model=str(config), batch_size=2, seq_len=32, precision="fp32"),
            dict(model=str(config), batch_size=2, seq_len=32, peft={"rank": 4})]
    monkeypatch.setattr(script, "JOBS", jobs)
    out = tmp_path / "predictions.json"
    script.main(["--quick", "--predict-only", str(out), "--out", str(tmp_path)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["job"] for r in rows] == jobs
    for row in rows:
        assert "formula_error" not in row and "trace_error" not in row
        assert row["formula"]["peak_allocated"] > 0 and row["trace"]["peak_allocated"] > 0
    # the LoRA job trains 4-rank adapters only: far fewer optimizer states
    assert rows[1]["trace"]["categories"]["optimizer_states"] < (
        rows[0]["trace"]["categories"]["optimizer_states"] / 10)


def test_rescore_keeps_the_committed_measurements(script, tmp_path, monkeypatch):
    shutil.copy(RESULTS, tmp_path / "gpu_validation.json")
    saved = json.loads(RESULTS.read_text())
    predicted = []

    def fake_predict(fields):  # the real predictions take a minute: stand in for them
        predicted.append(fields)
        figures = {"peak_allocated": 2**30, "peak_reserved": 2**30, "device_total": 2**30,
                   "categories": {}}
        return {"job": fields, "formula": figures, "trace": figures}
    monkeypatch.setattr(script, "predict", fake_predict)
    script.main(["--rescore", "--out", str(tmp_path)])
    new = json.loads((tmp_path / "gpu_validation.json").read_text())
    assert predicted == [row["job"] for row in saved["rows"]]
    for old, row in zip(saved["rows"], new["rows"], strict=True):
        assert row["measured"] == old["measured"] and row["trace"]["peak_allocated"] == 2**30
    assert new["machine"]["gpu"] == "NVIDIA H200"
    assert "measurements unchanged" in new["machine"]["predictions_from"]
    assert "| llama-3.2-1b" in (tmp_path / "gpu_validation.md").read_text().replace(
        "model=", "")


def test_the_job_loop_survives_failures_and_stops_starting_jobs_at_the_budget(script):
    now = [0.0]

    def validate(row):
        now[0] += 100  # each job takes 100 s
        if row["job"]["n"] == 1:
            raise RuntimeError("CUDA error: an illegal memory access")
        return {**row, "measured": {"peak_allocated": 1}}
    written = []
    rows = script.run_jobs([{"job": {"n": n}} for n in range(8)], validate, budget_s=540,
                           write=lambda rows: written.append(len(rows)),
                           clock=lambda: now[0])
    assert [r["job"]["n"] for r in rows] == list(range(8))
    assert rows[1]["measure_error"] == "RuntimeError: CUDA error: an illegal memory access"
    # jobs start at 0, 100, ..., 500 s; at 600 s the budget is spent
    assert [("measured" in r) for r in rows] == [True, False, True, True, True, True, False,
                                                 False]
    assert rows[6]["skipped"] == rows[7]["skipped"] == "time budget: not started after 540 s"
    assert written == list(range(1, 9))  # results written after every job


def test_out_defaults_to_the_device_machines_out_folder(script, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert script.default_out() == tmp_path
    monkeypatch.delenv("OUT")
    assert script.default_out() == ROOT / "benchmarks" / "results"


@pytest.mark.torch
def test_a_gpu_run_takes_saved_predictions_and_predicts_the_missing_ones(script, tmp_path,
                                                                         monkeypatch):
    import torch

    jobs = [dict(model="a", batch_size=1), dict(model="b", batch_size=1)]
    saved = {"rows": [{"job": jobs[0], "formula": {"peak_allocated": 7}}]}
    (tmp_path / "p.json").write_text(json.dumps(saved))
    monkeypatch.setattr(script, "JOBS", jobs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(script, "gpu_facts", lambda: {
        "gpu": "fake", "cuda": "0", "torch": "0", "python": "3", "platform": "x"})
    monkeypatch.setattr(script, "predict", lambda fields: {"job": fields, "predicted": "now"})
    monkeypatch.setattr(script, "validate", lambda row, steps, warmup: {**row, "ran": steps})
    script.main(["--predictions", str(tmp_path / "p.json"), "--out", str(tmp_path / "o"),
                 "--steps", "4"])
    rows = json.loads((tmp_path / "o" / "gpu_validation.json").read_text())["rows"]
    assert rows == [{"job": jobs[0], "formula": {"peak_allocated": 7}, "ran": 4},
                    {"job": jobs[1], "predicted": "now", "ran": 4}]
