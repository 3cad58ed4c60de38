"""search / sweep with fake oracles (exactness, trial counts, OOM handling) and real engines."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import pytest

from vramplan.engines.memory_report import CATEGORIES, Measured, MemoryReport
from vramplan.errors import BudgetExceeded
from vramplan.job import Job
from vramplan.search import max_batch_size, max_seq_len, plot, sweep, write_csv, write_json

GiB = 1024**3
JOB = Job(model="tiny", batch_size=1, seq_len=512)


def affine(a: int, b: int):
    return lambda job: a + b * job.batch_size


def true_max(peak_of_value, limit, upper=10**7):
    """Largest v with peak(v) <= limit, by brute force over a monotone function."""
    lo, hi = 0, upper
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak_of_value(mid) <= limit else (lo, mid)
    return lo


def trial_bound(best: int) -> int:
    return math.ceil(math.log2(best)) + 2 if best > 1 else 2


@pytest.mark.parametrize("a,b", [(10 * GiB, GiB // 3), (GiB, 7 * 1024**2), (5, 10**6),
                                 (20 * GiB, 1024**3 + 12345), (0, 1024**2)])
def test_batch_size_is_exact_within_trial_target(a, b):
    budget = 24 * GiB
    result = max_batch_size(JOB, affine(a, b), budget)
    limit = int(budget * 0.95)
    expected = true_max(lambda v: a + b * v, limit)
    assert result.best == expected
    assert len(result.trials) <= trial_bound(expected)
    assert all(t.fits == (t.peak <= limit) for t in result.trials)


def test_every_max_from_1_to_300_is_exact():
    for best in range(1, 301):
        # peak crosses the limit right after `best`: limit = 1000 * best + 999
        oracle = affine(1000, 1000)
        budget = math.ceil((1000 * best + 1999) / 0.95)
        result = max_batch_size(JOB, oracle, budget)
        expected = true_max(lambda v: 1000 + 1000 * v, int(budget * 0.95))
        assert result.best == expected
        assert len(result.trials) <= trial_bound(expected), (best, result.trials)


def test_convex_seq_len_within_granularity():
    # activations with an attention term quadratic in the sequence length
    def peak(job):
        s = job.seq_len
        return 2 * GiB + 300_000 * s + 40 * s * s
    result = max_seq_len(JOB, peak, 16 * GiB, granularity=64)
    limit = int(16 * GiB * 0.95)
    assert result.best % 64 == 0
    assert peak(JOB.with_changes(seq_len=result.best)) <= limit
    assert peak(JOB.with_changes(seq_len=result.best + 64)) > limit
    assert len(result.trials) <= math.ceil(math.log2(result.best // 64)) + 2


def test_margin_and_maximum():
    oracle = affine(0, 100)
    assert max_batch_size(JOB, oracle, 10_000, margin=0).best == 100
    assert max_batch_size(JOB, oracle, 10_000, margin=0.2).best == 80
    capped = max_batch_size(JOB, oracle, 10_000, margin=0, maximum=48)
    assert capped.best == 48 and capped.capped
    assert max(t.value for t in capped.trials) == 48


def test_oom_exceptions_count_as_not_fitting_and_search_goes_on():
    limit_batch = 37
    calls = []

    def oracle(job):
        calls.append(job.batch_size)
        if job.batch_size > limit_batch:
            kind = job.batch_size % 3
            if kind == 0:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            if kind == 1:
                raise BudgetExceeded("step allocated 5 GiB over the 4 GiB budget")
            raise MemoryError()
        return 1  # tiny peak: only exceptions decide
    result = max_batch_size(JOB, oracle, GiB)
    assert result.best == limit_batch
    failed = [t for t in result.trials if not t.fits]
    assert failed and all(t.peak is None and t.error for t in failed)
    # doubling + bisection without peaks: about 2 log2(max) trials
    assert len(result.trials) <= 2 * math.ceil(math.log2(limit_batch)) + 2


@pytest.mark.torch
def test_torch_out_of_memory_error_is_caught():
    import torch

    def oracle(job):
        if job.batch_size > 5:
            raise torch.OutOfMemoryError("out of memory")
        return 1
    assert max_batch_size(JOB, oracle, GiB).best == 5


def test_other_errors_propagate():
    def oracle(job):
        raise ValueError("bad model")
    with pytest.raises(ValueError, match="bad model"):
        max_batch_size(JOB, oracle, GiB)


def _stopped_report(stopped: str) -> MemoryReport:
    """What measure() returns when the step raised in user code (or Ctrl-C): a small
    partial peak and the reason."""
    measured = Measured(source="measure", device="cpu", complete=False, stopped=stopped,
                        steps=0)
    return _report(weights=1000).model_copy(update={"engine": "measure", "measured": measured})


def test_a_crashed_measured_trial_is_an_error_not_a_fit():
    # a factory whose forward always raises was reported "fits: 8": its partial peak was
    # compared with the budget
    from vramplan.errors import EngineError

    def oracle(job):
        return _stopped_report("stopped by ValueError: boom (after 0 of 3 steps)")
    with pytest.raises(EngineError, match="did not complete a step.*ValueError: boom"):
        max_batch_size(JOB, oracle, GiB)
    with pytest.raises(EngineError, match="did not complete"):
        sweep(JOB, oracle, [1, 2], budget_bytes=GiB)


def test_an_interrupted_measured_trial_stops_the_search_as_ctrl_c():
    def oracle(job):
        return _stopped_report("interrupted (Ctrl-C) after 1 of 3 steps")
    with pytest.raises(KeyboardInterrupt):
        max_batch_size(JOB, oracle, GiB)


def test_the_cpu_allocator_failing_is_out_of_memory():
    from vramplan.engines.oom import is_out_of_memory
    assert is_out_of_memory(RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 10000000000000 bytes. Error code 12 (Cannot allocate memory)"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def _report(**categories) -> MemoryReport:
    cats = dict.fromkeys(CATEGORIES, 0) | categories
    return MemoryReport(engine="formula", job={}, model_name="x", params_total=1,
                        params_trainable=1, categories=cats)


@pytest.mark.parametrize("largest,expect", [
    ("optimizer_states", "8-bit"), ("weights", "QLoRA"), ("activations", "checkpointing"),
    ("temporary", "chunked")])
def test_does_not_fit_at_one_names_techniques(largest, expect):
    report = _report(**{largest: 30 * GiB, "weights": GiB if largest != "weights" else 30 * GiB})
    result = max_batch_size(JOB, lambda job: report, 24 * GiB)
    assert result.best is None and not result.fits
    assert len(result.trials) == 1
    assert result.largest_category == largest
    assert any(expect in s for s in result.suggestions)


def test_does_not_fit_with_oom_uses_explain_engine():
    def oracle(job):
        raise RuntimeError("CUDA out of memory")
    result = max_batch_size(JOB, oracle, GiB,
                            explain=lambda job: _report(optimizer_states=5 * GiB))
    assert result.best is None and result.largest_category == "optimizer_states"
    assert result.trials[0].error.startswith("RuntimeError: CUDA out of memory")


def test_sweep_rows_and_outputs(tmp_path):
    def oracle(job):
        return _report(weights=GiB, activations=job.batch_size * job.seq_len * 1000).model_copy(
            update={"measured": Measured(
                source="measure", device="cpu", complete=True, steps=2,
                step_time_median_s=0.5, samples_per_s=2 * job.batch_size, tokens_per_s=2.0,
                losses=[3.0, 2.5])})

    def failing(job):
        if job.batch_size * job.seq_len > 4096:
            raise RuntimeError("out of memory")
        return oracle(job)
    seen = []
    rows = sweep(JOB, failing, [1, 2, 4, 8], [512, 1024], budget_bytes=2 * GiB, on_row=seen.append)
    assert len(rows) == 8 == len(seen)
    ok = [r for r in rows if not r["error"]]
    assert ok[0]["device_total"] == GiB + 512_000 and ok[0]["final_loss"] == 2.5
    assert ok[0]["fits"] is True
    oom = [r for r in rows if r["error"]]
    assert [(r["batch_size"], r["seq_len"], r["fits"]) for r in oom] == [(8, 1024, False)]
    write_csv(rows, tmp_path / "s.csv")
    assert len(list(csv.DictReader(open(tmp_path / "s.csv")))) == 8
    write_json(rows, tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text())[0]["batch_size"] == 1
    pytest.importorskip("matplotlib")
    plot(rows, tmp_path / "s.png", limit_bytes=2 * GiB)
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_importing_search_does_not_import_torch():
    code = "import sys, vramplan.search; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_with_formula_engine():
    import vramplan.engines.formula as formula
    job = Job(model="llama-3.1-8b", seq_len=2048, precision="bf16-mixed", optimizer="adamw")
    result = max_batch_size(job.with_changes(peft={"method": "qlora"}), formula.estimate,
                            80 * GiB)
    assert result.best and result.best >= 1
    limit = 80 * GiB * 0.95
    assert formula.estimate(job.with_changes(peft={"method": "qlora"},
                                             batch_size=result.best)).device_total <= limit
    assert formula.estimate(job.with_changes(peft={"method": "qlora"},
                                             batch_size=result.best + 1)).device_total > limit
    assert len(result.trials) <= trial_bound(result.best)
    # full AdamW fine-tuning of 8B does not fit in 24 GiB: optimizer states dominate
    nofit = max_batch_size(job, formula.estimate, 24 * GiB)
    assert nofit.best is None and nofit.largest_category == "optimizer_states"


def test_any_monotone_oracle_is_exact_and_bounded():
    import random
    rng = random.Random(0)
    for _ in range(200):
        # rounded, stepwise, noisy-growth peaks: the model is wrong, the safeguards hold
        steps = [rng.randint(0, 3 * 1024**2) for _ in range(5000)]
        cum = [0]
        for s in steps:
            cum.append(cum[-1] + s)
        rounding = rng.choice([1, 2 * 1024**2, 20 * 1024**2])

        def oracle(job, cum=cum, rounding=rounding):
            return -(-cum[min(job.batch_size, 5000)] // rounding) * rounding + 10 * rounding
        budget = rng.randint(cum[2] + 11 * rounding, cum[-1] // 2)
        result = max_batch_size(JOB, oracle, budget)
        expected = true_max(lambda v: oracle(JOB.with_changes(batch_size=max(v, 1))),
                            int(budget * 0.95), upper=5000)
        assert result.best == expected
        assert len(result.trials) <= 3 * math.ceil(math.log2(expected)) + 4


# --- the CLI commands, in-process ---------------------------------------------------------------


def _cli():
    import typer
    from typer.testing import CliRunner

    from vramplan.cli.commands import search as commands
    app = typer.Typer()
    commands.register(app)
    return app, CliRunner()


def test_cli_search_batch_size_json():
    app, runner = _cli()
    result = runner.invoke(app, ["search", "batch-size", "llama-3.2-1b", "-s", "512",
                                 "--peft", "qlora", "--budget", "40GiB", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["parameter"] == "batch_size" and data["best"] >= 1 and data["fits"]


def test_cli_search_needs_a_budget_or_gpu():
    app, runner = _cli()
    result = runner.invoke(app, ["search", "seq-len", "llama-3.2-1b"])
    assert result.exit_code != 0
    assert "--gpu" in str(result.exception)


def test_cli_search_no_fit_names_techniques():
    app, runner = _cli()
    result = runner.invoke(app, ["search", "batch-size", "llama-3.1-8b", "--gpu", "L4"])
    assert result.exit_code == 1, result.output  # nothing fits: an answer, exit code 1
    assert "does not fit even at batch size 1" in result.output and "try:" in result.output


def test_cli_sweep_writes_files(tmp_path):
    pytest.importorskip("matplotlib")
    app, runner = _cli()
    result = runner.invoke(app, [
        "sweep", "llama-3.2-1b", "--peft", "lora", "--batch-sizes", "1,2,4",
        "--seq-lens", "256,512", "--gpu", "L4", "--out", str(tmp_path / "s.json"),
        "--plot", str(tmp_path / "s.png")])
    assert result.exit_code == 0, result.output
    assert len(json.loads((tmp_path / "s.json").read_text())) == 6
    result = runner.invoke(app, [
        "sweep", "llama-3.2-1b", "--peft", "lora", "--batch-sizes", "1,2,4",
        "--seq-lens", "256,512", "--gpu", "L4", "--out", str(tmp_path / "s.csv")])
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "s.csv").read_text().splitlines()
    assert len(lines) == 7 and lines[0].startswith("batch_size,seq_len,peak_allocated")
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_values_the_model_refuses_are_a_limit_not_a_crash():
    from vramplan.errors import JobError

    def oracle(job):
        if job.seq_len > 1000:
            raise JobError(f"seq_len={job.seq_len} is longer than the model's 1000 positions")
        return job.seq_len
    result = max_seq_len(JOB, oracle, GiB, granularity=64)
    assert result.best == 960 and "1000 positions" in result.limited_by
    assert len(result.trials) <= 2 * math.ceil(math.log2(1000 / 64)) + 2


TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096, "tie_word_embeddings": False}


@pytest.mark.torch
def test_with_trace_engine_as_oracle():
    import vramplan.engines.trace as trace
    job = Job(model="tiny", batch_size=1, seq_len=128, precision="bf16-mixed")

    def oracle(j):
        return trace.trace(j, model_config=TINY_LLAMA).peak_allocated
    budget = int(oracle(job.with_changes(batch_size=24)) / 0.95)  # the edge is near 24
    result = max_batch_size(job, oracle, budget)
    assert oracle(job.with_changes(batch_size=result.best)) <= result.limit_bytes
    assert oracle(job.with_changes(batch_size=result.best + 1)) > result.limit_bytes
    assert len(result.trials) <= trial_bound(result.best)


def test_ctrl_c_in_a_sweep_keeps_the_completed_points(run_cli, monkeypatch, tmp_path):
    # Ctrl-C lost every completed point; now they are shown and written, exit 130, one line
    from vramplan.cli.commands import search as search_command
    from vramplan.engines.formula import estimate

    def oracle_for(*args, **kwargs):
        def oracle(job):
            if job.batch_size == 3:
                raise KeyboardInterrupt
            return estimate(job)
        return oracle
    monkeypatch.setattr(search_command, "oracle_for", oracle_for)
    out = tmp_path / "rows.json"
    code, stdout, stderr = run_cli("sweep", "gpt2", "-s", "64", "--batch-sizes", "1,2,3,4",
                                   "--out", str(out))
    assert code == 130
    assert stderr == ("interrupted: interrupted after 2 of 4 points; the completed points "
                      "are above\n")
    assert [row["batch_size"] for row in json.loads(out.read_text())] == [1, 2]


def test_sweep_without_lengths_shows_the_length_the_engine_chose():
    from vramplan.engines.formula import estimate
    rows = sweep(vramplan_job("gpt2"), estimate, [1, 2])
    assert [r["seq_len"] for r in rows] == [1024, 1024]  # GPT-2's 1024 positions


def vramplan_job(model: str):
    from vramplan import Job
    return Job(model=model)


def test_ctrl_c_in_a_search_keeps_its_trials(run_cli, monkeypatch, tmp_path):
    from vramplan.cli.commands import search as command
    from vramplan.search import SearchInterrupted

    def oracle(job):
        if job.batch_size > 2:  # the third trial (batch 4) is interrupted
            raise KeyboardInterrupt
        return job.batch_size * GiB
    with pytest.raises(SearchInterrupted) as stop:
        max_batch_size(JOB, oracle, 10 * GiB)
    assert [t.value for t in stop.value.result.trials] == [1, 2]
    assert stop.value.result.best == 2 and "interrupted after 2 trials" in str(stop.value)

    monkeypatch.setattr(command, "oracle_for", lambda *args, **kwargs: oracle)
    out = tmp_path / "trials.json"
    code, printed, err = run_cli("search", "batch-size", "gpt2", "--budget", "10GiB",
                                 "--json", "--out", str(out))
    assert code == 130 and err.strip().startswith("interrupted: interrupted after 2 trials")
    data = json.loads(printed)
    assert [t["value"] for t in data["trials"]] == [1, 2] and data["best"] == 2
    assert json.loads(out.read_text())["interrupted"]
