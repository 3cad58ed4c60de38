"""measure engine on the CPU: allocator-level peaks, budgets as OOM, partial runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vramplan.engines.measure import measure, measure_setup
from vramplan.errors import BudgetExceeded
from vramplan.job import Job
from vramplan.search import max_batch_size
from vramplan.training.setup import TrainingSetup

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module


JOB = Job(model="tiny", batch_size=4, seq_len=32, precision="fp32")


class TinyLM(torch.nn.Module):
    """An embedding, two MLP blocks and an LM head: enough to have activations."""

    def __init__(self, vocab=256, hidden=64, fail_at_call=None, interrupt_at_call=None):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
            torch.nn.Linear(4 * hidden, hidden)) for _ in range(2)])
        self.head = torch.nn.Linear(hidden, vocab)
        self.calls, self.fail_at_call, self.interrupt_at_call = 0, fail_at_call, interrupt_at_call

    def forward(self, input_ids, labels):
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise ValueError("user code broke: shapes do not match")
        if self.calls == self.interrupt_at_call:
            raise KeyboardInterrupt
        logits = self.head(self.blocks(self.embed(input_ids)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def tiny_setup(job: Job = JOB, optimizer="adamw", **model_kw) -> TrainingSetup:
    torch.manual_seed(0)
    model = TinyLM(**model_kw)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2))

    def batch():
        ids = torch.randint(0, 256, (job.batch_size, job.seq_len))
        return {"input_ids": ids, "labels": ids}
    return TrainingSetup(model=model, optimizer=opt, make_batch=batch,
                         compute_loss=lambda m, b: m(**b), autocast_dtype=None,
                         device=torch.device("cpu"), model_name="tiny")


def param_bytes(setup):
    return sum(p.numel() * p.element_size() for p in setup.model.parameters())


def test_cpu_measure_reports_peak_categories_and_timing():
    setup = tiny_setup()
    report = measure_setup(setup, JOB, steps=3, warmup=2)
    w = param_bytes(setup)
    assert report.engine == "measure"
    assert report.categories["weights"] == w
    assert report.categories["optimizer_states"] >= 2 * w  # AdamW: exp_avg + exp_avg_sq
    # the peak holds at least weights + gradients + Adam states
    assert report.peak_allocated >= 4 * w
    assert set(report.phase_peaks) == {"inputs", "forward", "backward", "optimizer", "end"}
    assert report.peak_phase in report.phase_peaks
    assert report.peak_allocated == max(report.phase_peaks.values())
    m = report.measured.model_dump()
    assert m["complete"] and m["steps"] == 5 and len(m["losses"]) == 5
    assert m["step_time_median_s"] > 0 and m["step_time_p90_s"] >= m["step_time_median_s"]
    assert m["samples_per_s"] == pytest.approx(4 / m["step_time_median_s"])
    assert m["tokens_per_s"] == pytest.approx(4 * 32 / m["step_time_median_s"])
    assert m["non_finite_losses"] == 0 and m["skipped_steps"] == 0
    assert report.peak_reserved == report.peak_allocated  # no caching allocator on the CPU


def test_cpu_peak_grows_with_batch_and_matches_the_allocator():
    peaks = [measure_setup(tiny_setup(JOB.with_changes(batch_size=b)), JOB, steps=1,
                           warmup=1).peak_allocated for b in (2, 8, 32)]
    assert peaks[0] < peaks[1] < peaks[2]
    # logits (b x s x vocab x 4 bytes) alone grow by this much from batch 8 to 32
    assert peaks[2] - peaks[1] >= 24 * 32 * 256 * 4


@pytest.mark.slow  # over 10 s on 2 cores: `pytest -m slow` runs it
def test_budget_turns_into_budget_exceeded_and_search_uses_it():
    # in one process, as the CLI runs a search: each trial's profiler starts after the
    # earlier trials' profilers are destroyed (measure._CpuProbe.step), so none of them
    # ends the allocator's memory reporting while another records
    _search_case(_budget_case())


def _budget_case():
    peak = measure_setup(tiny_setup(), JOB, steps=1, warmup=1).peak_allocated
    with pytest.raises(BudgetExceeded, match="over the budget"):
        measure_setup(tiny_setup(), JOB, steps=1, warmup=1, budget_bytes=peak // 2)
    return peak


def _search_case(peak: int):
    def oracle(job):
        return measure_setup(tiny_setup(job), job, steps=1, warmup=1,
                             budget_bytes=budget).peak_allocated
    budget = 3 * peak
    result = max_batch_size(JOB, oracle, budget, margin=0.0, maximum=4096)
    assert result.best is not None and result.best > JOB.batch_size
    assert any(t.error.startswith("BudgetExceeded") for t in result.trials) or result.capped
    assert oracle(JOB.with_changes(batch_size=result.best)) <= budget


def test_user_error_keeps_partial_results():
    report = measure_setup(tiny_setup(fail_at_call=3), JOB, steps=3, warmup=1)
    m = report.measured.model_dump()
    assert not m["complete"] and len(m["losses"]) == 2
    assert "ValueError: user code broke" in m["stopped"]
    assert any("partial run" in n for n in report.notes)
    assert report.peak_allocated > 0


def test_ctrl_c_gives_partial_report():
    report = measure_setup(tiny_setup(interrupt_at_call=4), JOB, steps=5, warmup=1)
    assert "interrupted" in report.measured.stopped and len(report.measured.losses) == 3


def test_non_finite_losses_and_skipped_fp16_steps():
    setup = tiny_setup()
    with torch.no_grad():
        setup.model.head.weight[0, 0] = float("inf")
    job = JOB.with_changes(precision="fp16-mixed")  # fp16-mixed runs a GradScaler
    report = measure_setup(setup, job, steps=2, warmup=1)
    assert report.measured.non_finite_losses == 3
    assert report.measured.skipped_steps == 3


def test_grad_accum_counts_tokens_per_optimizer_step():
    job = JOB.with_changes(grad_accum=2)
    report = measure_setup(tiny_setup(job), job, steps=2, warmup=1)
    assert report.tokens_per_step == 2 * 4 * 32
    assert report.categories["gradients"] > 0


TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": False}


def test_measure_job_end_to_end_with_shared_builders(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    job = Job(model=str(config), batch_size=2, seq_len=64, precision="bf16-mixed")
    report = measure(job, steps=2, warmup=1, device="cpu")
    assert report.params_total > 0 and report.peak_allocated > report.categories["weights"]
    assert report.measured.tokens_per_s == pytest.approx(
        128 / report.measured.step_time_median_s)
    assert report.tokens_per_step == 128 and all(math.isfinite(x)
                                                 for x in report.measured.losses)


def test_measure_agrees_with_trace_engine_when_present():
    import vramplan.engines.trace as trace
    job = Job(model="x", batch_size=2, seq_len=64, precision="fp32", optimizer="adamw")
    measured = measure(job, steps=1, warmup=1, device="cpu", model_config=TINY_LLAMA)
    try:
        traced = trace.trace(job, model_config=TINY_LLAMA)
    except TypeError:
        pytest.skip("trace() takes no model_config yet")
    from vramplan.compare import predicted_workspaces
    workspaces = predicted_workspaces(traced)  # cuBLAS workspaces: on a GPU, not the CPU
    assert traced.peak_allocated - workspaces == pytest.approx(measured.peak_allocated,
                                                               rel=0.02)


# --- the CLI commands, in-process ---------------------------------------------------------------


def _cli():
    import typer
    from typer.testing import CliRunner

    from vramplan.cli.commands import measure as commands
    app = typer.Typer()
    commands.register(app)
    return app, CliRunner()


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def test_cli_measure_table_and_json(tiny_config, tmp_path):
    app, runner = _cli()
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["measure", tiny_config, "-b", "2", "-s", "32", "-p", "fp32",
                                 "--steps", "2", "--warmup", "1", "--device", "cpu",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "step time" in result.output and "tokens/s" in result.output
    report = json.loads(out.read_text())
    assert report["engine"] == "measure" and report["measured"]["steps"] == 3


def test_cli_measure_over_budget_says_out_of_memory(tiny_config):
    app, runner = _cli()
    result = runner.invoke(app, ["measure", tiny_config, "-b", "2", "-s", "32", "--steps",
                                 "1", "--device", "cpu", "--budget", "64KiB"])
    assert result.exit_code == 1 and "out of memory" in result.output


def test_cli_compare_side_by_side(tiny_config):
    app, runner = _cli()
    result = runner.invoke(app, ["compare", tiny_config, "-b", "2", "-s", "32", "-p", "fp32",
                                 "--engines", "formula,trace,measure", "--steps", "1",
                                 "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    peak = next(r for r in data["rows"] if r["figure"].endswith("w/o cuBLAS workspaces"))
    assert peak["measure"] > 0
    if peak["trace"] is not None:  # an engine that is not there yet reports why
        assert abs(peak["trace_error"]) < 0.05  # trace replays the real step
    if peak["formula"] is not None:
        assert abs(peak["formula_error"]) < 2.0  # closed form, on a toy model


# --- several processes: torchrun, gloo on the CPU -------------------------------------------------

DIST_SCRIPT = """
import json, os, sys
from vramplan.engines.measure import measure
from vramplan.job import Job
config, strategy, out = sys.argv[1:]
job = Job(model=config, batch_size=2, seq_len=32, precision="fp32",
          parallel={"strategy": strategy, "num_gpus": 2})
report = measure(job, steps=2, warmup=1, device="cpu")
if int(os.environ["RANK"]) == 0:
    open(out, "w").write(json.dumps(report.to_json_dict()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_two_ranks_aggregate_on_rank_0(tmp_path, tiny_config, strategy):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "run.py"
    script.write_text(DIST_SCRIPT)
    out = tmp_path / "report.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    # its own session, so a hang can be ended with all of torchrun's workers
    process = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2",
                                str(script), tiny_config, strategy, str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    m = report["measured"]
    assert m["world_size"] == 2 and len(m["ranks"]) == 2 and report["per_gpu_of"] == 2
    assert m["peak_allocated_max"] >= m["peak_allocated_min"] > 0
    assert m["complete"]
    if strategy == "fsdp":  # each rank holds half of the weights (and optimizer states)
        params = report["params_total"] * 4
        assert report["categories"]["weights"] < 0.75 * params


# --- the CUDA path, with torch.cuda faked (no GPU here): wiring, not numbers --------------------


def test_cuda_path_with_faked_torch_cuda(monkeypatch):
    from types import SimpleNamespace

    fractions = []
    fake = {
        "init": lambda: None, "current_device": lambda: 0,
        "get_device_name": lambda d=None: "Fake H200",
        "get_device_properties": lambda d=None: SimpleNamespace(total_memory=140 * 1024**3),
        "set_per_process_memory_fraction": lambda f, d=None: fractions.append(f),
        "reset_peak_memory_stats": lambda d=None: None, "synchronize": lambda d=None: None,
        "max_memory_allocated": lambda d=None: 10_000_000,
        "max_memory_reserved": lambda d=None: 12_000_000,
        "memory_reserved": lambda d=None: 0,
        "device_memory_used": lambda d=None: 600_000_000,
        "utilization": lambda d=None: 50, "memory_usage": lambda d=None: 30,
    }
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)
    setup = tiny_setup()
    setup.device = torch.device("cuda", 0)  # the tensors stay on the CPU; only the probe differs
    report = measure_setup(setup, JOB, steps=2, warmup=1, emulate_gpu="L4")
    from vramplan.hardware import get_gpu
    usable = get_gpu("L4").usable_bytes
    context = max(600_000_000, JOB.runtime.cuda_context_bytes)  # the job's is the floor
    assert fractions[0] == pytest.approx((usable - context) / (140 * 1024**3))
    assert fractions[-1] == 1.0  # the cap is lifted after the run
    assert report.peak_allocated == 10_000_000 and report.peak_reserved == 12_000_000
    assert report.categories["runtime_context"] == 588_000_000
    m = report.measured.model_dump()
    assert m["device"] == "Fake H200" and m["gpu_util_mean"] == 50
    assert m["mem_bandwidth_util_mean"] == 30 and m["nvml_used_max"] == 600_000_000
    assert m["context_overhead"] == 588_000_000 and report.runtime_gpu == "L4"
    assert m["complete"], m["stopped"]


def test_out_of_memory_message_keeps_the_failed_request_only():
    from vramplan.engines.oom import describe_oom
    seen_on_h200 = RuntimeError(  # benchmarks/results/gpu_cli_check.txt
        "CUDA out of memory. Tried to allocate 112.00 MiB. GPU 0 has a total capacity of "
        "139.80 GiB of which 117.91 GiB is free. Including non-PyTorch memory, this process "
        "has 21.88 GiB memory in use. 21.29 GiB allowed; Of the allocated memory 21.09 GiB "
        "is allocated by PyTorch")
    assert describe_oom(seen_on_h200) == "CUDA out of memory: tried to allocate 112.00 MiB"


def test_categories_mean_what_they_mean_in_the_trace():
    """Inputs are the batch tensors alive at the peak, activations what forward saved for
    backward (less the loss's buffers): on a tiny Llama the CPU run and the trace agree to
    the byte; only the trace's cuBLAS workspaces (CUDA's) are extra temporary."""
    from vramplan.engines.trace import trace
    job = Job(model="tiny", batch_size=4, seq_len=256, precision="bf16-mixed")
    traced = trace(job, model_config=TINY_LLAMA)
    measured = measure(job, steps=1, warmup=1, device="cpu", model_config=TINY_LLAMA)
    assert measured.peak_phase == traced.peak_phase == "backward"
    # backward holds the input ids the embedding saved (4 x 256 int64); the labels are read
    assert measured.categories["inputs"] == traced.categories["inputs"] == 4 * 256 * 8
    assert measured.categories["activations"] == traced.categories["activations"]
    assert measured.categories["temporary"] > 0


def test_a_cpu_measurement_fills_the_fit_table_with_each_gpus_runtime():
    from vramplan.engines.runtime import runtime_context_bytes, workspaces_bytes
    from vramplan.hardware import get_gpu
    job = Job(model="tiny", batch_size=2, seq_len=32, precision="fp32", gpu="L4")
    report = measure(job, steps=1, warmup=1, device="cpu", model_config=TINY_LLAMA)
    (fit,) = report.fits
    l4 = get_gpu("L4")
    # the CPU run has neither cuBLAS workspaces nor a CUDA context: the L4's are added
    assert fit.gpu == "L4" and fit.required_bytes == report.device_total + workspaces_bytes(
        job.runtime, l4) + runtime_context_bytes(job.runtime, l4)


LEAK_CONFIG = dict(model_type="llama", hidden_size=128, intermediate_size=256,
                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=8000, max_position_embeddings=64)  # 2.1M params, ~34 MB a run


@pytest.mark.slow  # over 10 s on 2 cores: `pytest -m slow` runs it
def test_measure_frees_its_model_and_optimizer():
    # each CPU measure() kept its model and optimizer alive: the gradient hooks torch holds in
    # C++ closed a cycle the garbage collector cannot see (+430 MiB a call on a 36M model)
    import gc

    def rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    job = Job(model="tiny", batch_size=1, seq_len=8, precision="fp32", optimizer="adamw")
    for call in range(20):
        measure(job, steps=1, warmup=0, device="cpu", model_config=LEAK_CONFIG)
        gc.collect()
        if call == 1:
            after_two = rss()
    assert rss() <= 1.10 * after_two


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:0:1", ""])
def test_an_unknown_device_is_refused(device):
    # `--device tpu` gave torch's RuntimeError traceback
    from vramplan.errors import EngineError
    with pytest.raises(EngineError, match="use cpu, cuda or cuda:N"):
        measure(Job(model="tiny", batch_size=1, seq_len=8), device=device or "x",
                model_config=LEAK_CONFIG)


def test_a_multi_gpu_job_needs_torchrun(monkeypatch):
    # a 4-GPU ZeRO-3 job was measured unsharded in one process and reported as one rank's
    from vramplan.errors import EngineError
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    job = Job(model="tiny", batch_size=1, seq_len=8,
              parallel={"strategy": "zero3", "num_gpus": 4})
    with pytest.raises(EngineError, match="torchrun --nproc-per-node 4"):
        measure(job, device="cpu", model_config=LEAK_CONFIG)


def test_measure_without_a_completed_step_exits_2(run_cli, tmp_path, monkeypatch):
    # measure printed a partial step's figures and exited 0 when the forward always raised
    (tmp_path / "vp_failing_forward.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        raise ValueError('boom in forward')\n"
        "def build():\n"
        "    return {'model': Net(), 'input_shapes': (4,)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run_cli("measure", "vp_failing_forward:build", "--device", "cpu",
                           "--steps", "1")
    assert code == 2
    assert err.startswith("error: no training step completed (stopped by ValueError: boom")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("fields", [dict(activation_offload=True, checkpointing="full"),
                                    dict(offload={"optimizer": True}, parallel={
                                        "strategy": "zero2", "num_gpus": 1})])
def test_measure_refuses_offload_it_would_not_run(fields):
    from vramplan.errors import EngineError

    # on the CPU there is no GPU memory to free; the step would run without offloading
    # and be reported as the offloaded one
    with pytest.raises(EngineError, match="measure does not run CPU offload"):
        measure(Job(model="tiny", **fields), device="cpu", model_config=TINY_LLAMA)


def test_no_memory_events_is_an_error(monkeypatch):
    """A CPU measurement whose profiler saw no allocations is an error, never a peak of 0."""
    from vramplan.engines import measure as engine
    from vramplan.errors import EngineError
    monkeypatch.setattr(engine._CpuProbe, "_collect", lambda self, profiler: False)
    with pytest.raises(EngineError, match="recorded no memory events"):
        measure_setup(tiny_setup(), JOB, steps=1, warmup=1)
