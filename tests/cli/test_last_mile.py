"""Issue 19, sections 2 and 4: the rough edges a new user hits first and the bad-input
classes that are not one-line refusals (those are in test_bad_input.py's battery)."""

from __future__ import annotations

import importlib.util
import json
import logging
import textwrap

import pytest

from vramplan.cli import options as cli_options
from vramplan.errors import EngineError


def _strict_json(text: str):
    """json.loads that refuses Infinity and NaN, as every other JSON reader does."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _without(monkeypatch, *modules: str) -> None:
    """Make find_spec say `modules` are not installed (the `make run` / wheel install)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] in modules
                        else real(name, *a))


# --- JSON stays JSON ---------------------------------------------------------------------


def test_json_output_never_holds_infinity_or_nan():
    text = cli_options.json_text({"a": float("inf"), "b": [float("nan"), 1.5], "c": {"d": 2}})
    assert _strict_json(text) == {"a": None, "b": [None, 1.5], "c": {"d": 2}}


def test_estimate_json_with_a_price_is_standard_json(run_cli):
    code, out, _ = run_cli("estimate", "gpt2", "--gpu", "L4", "--tokens", "1B",
                           "--price-per-hour", "2", "--json")
    assert code == 0 and _strict_json(out)["performance"]["cost_usd"] > 0


# --- plan --------------------------------------------------------------------------------


def test_plan_takes_gpu_as_the_one_gpu_type_to_plan_on(run_cli):
    code, out, _ = run_cli("plan", "llama-3.2-1b", "--gpu", "L4", "--tokens", "1B", "--json")
    plan = _strict_json(out)
    assert code == 0 and plan["candidates"]
    assert {c["gpu"] for c in plan["candidates"]} == {"L4"}


def test_plan_constraints_unmet_says_why_on_stderr(run_cli):
    code, _, err = run_cli("plan", "gpt2", "--tokens", "1B", "--max-cost", "0.000001")
    assert code == 2 and err.startswith("error: no configuration") and "--max-cost" in err
    assert len(err.strip().splitlines()) == 1


# --- compare, Ctrl-C, serve ----------------------------------------------------------------


def test_compare_exits_2_naming_the_engine_that_failed(run_cli, monkeypatch):
    import vramplan.compare as compare

    real = compare.run_engine

    def failing(job, engine, **options):
        if engine == "trace":
            raise EngineError("op foo cannot run on fake tensors")
        return real(job, engine)
    monkeypatch.setattr(compare, "run_engine", failing)
    code, out, err = run_cli("compare", "gpt2", "--engines", "formula,trace")
    assert code == 2 and "trace failed" in err and "op foo" in err
    assert "peak allocated" in out  # the engine that answered is still shown


def test_ctrl_c_exits_130_and_says_so(run_cli, monkeypatch):
    import vramplan.engines.registry as registry
    import vramplan.planning.estimate as composed

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(registry, "run_engine", interrupted)
    monkeypatch.setattr(composed, "run_engine", interrupted)  # the one estimate's import
    code, _, err = run_cli("estimate", "gpt2")
    assert code == 130 and "interrupted" in err


@pytest.mark.parametrize("delay_s", [0.25, 0.5])
def test_ctrl_c_while_the_command_loads_says_so(delay_s):
    # the first half second imports typer, pydantic and vramplan: a Ctrl-C there printed an
    # import traceback (or, on a fast machine, nothing) instead of the one line
    import signal
    import subprocess
    import sys
    import time
    # a plan of seconds (a 1B plan now ends inside half a second on a fast machine)
    process = subprocess.Popen([sys.executable, "-m", "vramplan", "plan", "llama-3.1-405b",
                                "--tokens", "1B", "--allow", "global-batch,lora,qlora",
                                "--max-gpus", "1024"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               # as from a terminal: a shell's background job (`pytest &`)
                               # ignores SIGINT, and Python keeps an inherited SIG_IGN
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay_s)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert (process.returncode, err) == (130, "interrupted (Ctrl-C)\n")


def test_serve_refuses_a_port_in_use_before_printing_its_url(run_cli):
    import socket

    pytest.importorskip("uvicorn")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = run_cli("serve", "--port", str(port))
    assert code == 2 and "cannot listen" in err and "http://" not in out


# --- the make-run install: no torch; a wheel without extras: no matplotlib -----------------


def test_html_and_plot_without_matplotlib_are_one_line(run_cli, monkeypatch, tmp_path):
    _without(monkeypatch, "matplotlib")
    for flag in ("--html", "--plot"):
        code, _, err = run_cli("estimate", "gpt2", flag, str(tmp_path / "r.html"))
        assert code == 2 and "pip install 'vramplan[plot]'" in err
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_trace_and_measure_without_torch_are_one_line(run_cli, monkeypatch):
    _without(monkeypatch, "torch")
    for argv in (("estimate", "gpt2", "--engine", "trace"), ("measure", "gpt2")):
        code, _, err = run_cli(*argv)
        assert code == 2 and "pip install 'vramplan[torch]'" in err, argv


def test_bitsandbytes_cpu_kernel_notice_is_silenced(run_cli):
    run_cli("gpus")
    assert logging.getLogger("bitsandbytes").getEffectiveLevel() >= logging.ERROR


# --- QLoRA defaults, LoRA targets per family -----------------------------------------------


def test_plain_qlora_notes_that_peft_turns_checkpointing_on(run_cli):
    code, out, _ = run_cli("estimate", "llama-3.1-8b", "--peft", "qlora", "--json")
    assert code == 0
    assert any("prepare_model_for_kbit_training" in n and "--checkpointing full" in n
               for n in _strict_json(out)["notes"])
    _, out, _ = run_cli("estimate", "llama-3.1-8b", "--peft", "qlora", "--checkpointing",
                        "none", "--json")  # asked for: no note
    assert not any("QLoRA without checkpointing" in n for n in _strict_json(out)["notes"])


def test_hf_trainer_qlora_checkpoints_as_peft_does():
    from vramplan import Job

    assert Job(model="llama-3.1-8b", framework="hf-trainer",
               peft={"method": "qlora"}).checkpointing == "full"
    assert Job(model="llama-3.1-8b", framework="hf-trainer",
               peft={"method": "lora"}).checkpointing == "none"
    assert Job(model="llama-3.1-8b", framework="hf-trainer", checkpointing="none",
               peft={"method": "qlora"}).checkpointing == "none"


def test_make_it_fit_on_t5_offers_lora_on_its_own_linears(run_cli):
    code, out, err = run_cli("estimate", "t5-3b", "--gpu", "L4")
    assert code == 1 and not err and "--peft lora" in out


@pytest.mark.parametrize("model, targets", [("gpt2", ("c_attn",)), ("t5-small", ("q", "v")),
                                            ("bert-base-uncased", ("query", "value")),
                                            ("llama-3.2-1b", ("q_proj", "k_proj", "v_proj",
                                                              "o_proj"))])
def test_lora_without_targets_takes_the_familys(model, targets):
    from vramplan import Job, estimate

    job = Job(model=model, peft={"method": "lora"})
    assert job.peft.target_modules == targets
    assert estimate(job).params_trainable > 0


# --- time estimates a job cannot have; --sort cost -----------------------------------------


def test_a_cnn_gets_memory_and_says_why_it_has_no_time(run_cli):
    code, out, _ = run_cli("estimate", "resnet-50", "--gpu", "L4", "--json")
    report = _strict_json(out)
    assert code == 0 and report["performance"] is None
    assert any(n.startswith("no time estimate: ") for n in report["notes"])


def test_sort_cost_without_an_amount_sorts_on_cost_per_million_tokens(run_cli):
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "-b", "2", "--sort", "cost")
    assert code == 0 and "$/M tokens" in out
    rows = [line.split("│") for line in out.splitlines() if "│ yes " in line]
    costs = [float(r[-2].strip().lstrip("$")) for r in rows if r[-2].strip() != "-"]
    assert len(costs) > 3 and costs == sorted(costs)


# --- calibrate: a broken user efficiency.toml ---------------------------------------------


def test_a_broken_user_efficiency_table_is_ignored_with_a_note(run_cli, monkeypatch, tmp_path):
    from vramplan.planning.efficiency import clear_cache

    monkeypatch.setenv("VRAMPLAN_CONFIG_DIR", str(tmp_path))
    for table in ('matmul = 0.5\n', 'matmul = "fast"\n', 'matmul = inf\nattention = 0.5\n'):
        (tmp_path / "efficiency.toml").write_text('[gpus."H200"]\n' + table)
        clear_cache()
        code, out, _ = run_cli("estimate", "llama-3.2-1b", "--gpu", "H200", "--json")
        assert code == 0, table
        factors = _strict_json(out)["performance"]["factors"]
        assert "was ignored" in factors and "calibrate again" in factors
    clear_cache()


# --- measure: sizes in GiB, a broken config --------------------------------------------------


def test_out_of_memory_sizes_are_in_binary_units():
    from vramplan.engines.oom import describe_oom

    text = describe_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried "
                                     "to allocate 123456789012 bytes. Error code 12"))
    assert "114.98 GiB" in text and "123456789012" not in text


@pytest.mark.torch
def test_measure_on_a_broken_config_is_one_line(run_cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="gpt2", n_embd=64, n_layer=2, n_head=0, vocab_size=256, n_positions=64)))
    code, _, err = run_cli("measure", str(tmp_path), "-b", "1", "-s", "16", "--steps", "1",
                           "--warmup", "0", "--device", "cpu")
    assert code == 2 and err.startswith("error: cannot build") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# --- factories ----------------------------------------------------------------------------


@pytest.fixture
def factory_package(tmp_path, monkeypatch):
    """A package in the working directory, as a user's project would have it."""
    package = tmp_path / "lastmile_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(textwrap.dedent("""
        import time
        from torch import nn

        def mlp():
            return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        module = nn.Linear(8, 8)

        def blocks():
            try:
                time.sleep(600)
            except Exception:
                pass
    """))
    monkeypatch.chdir(tmp_path)
    yield "lastmile_pkg.models"
    import sys
    for name in [n for n in sys.modules if n.startswith("lastmile_pkg")]:
        del sys.modules[name]


@pytest.mark.torch  # factory_package: a torch module
def test_a_factory_from_the_working_directory_may_return_a_bare_module(run_cli,
                                                                       factory_package):
    for ref in (f"{factory_package}:mlp", f"{factory_package}:module"):
        code, out, err = run_cli("estimate", ref, "--engine", "trace", "--gpu", "L4", "--json")
        assert code == 0, err
        notes = _strict_json(out)["notes"]
        assert any("inputs guessed from its first layer" in n for n in notes)
        assert any(n.startswith("no time estimate: ") for n in notes)  # not "use --engine trace"


@pytest.mark.torch  # factory_package: a torch module
def test_a_blocking_factory_stops_at_the_time_limit(run_cli, factory_package):
    code, _, err = run_cli("estimate", f"{factory_package}:blocks", "--engine", "trace",
                           "--time-limit", "1")
    assert code == 2 and "time limit" in err


# --- the web app's trace worker and sweep errors (issue 19, section 3) -----------------------


def test_a_worker_that_dies_at_its_time_limit_is_reported_as_the_time_limit():
    import time
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from vramplan.web.traces import TraceQueue, TraceTask

    queue = TraceQueue()
    for elapsed, expected in ((5.0, "time limit of 2 s"), (0.5, "may have run out of memory")):
        task = TraceTask("t", {}, time_limit_s=2.0)
        task.started = time.monotonic() - elapsed
        task.future = Future()
        task.future.set_exception(BrokenProcessPool("terminate called"))
        queue._finish(task)
        assert expected in task.error


def test_a_bad_gpu_in_a_sweep_is_an_error_of_the_sweeps_gpus():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from vramplan.web import create_app

    r = TestClient(create_app()).post("/api/v1/sweep", json={
        "job": {"model": "gpt2"}, "batch_sizes": [1], "seq_lens": [128],
        "gpus": ["L4", "H9000"]})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "gpus.1"


def test_sweep_chart_legend_shows_its_lines_in_their_colours():
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba

    import vramplan
    from vramplan.views import charts

    rows = vramplan.sweep(vramplan.Job(model="gpt2"), vramplan.estimate, [1, 2, 4, 8], [128, 256])
    biggest = max(r["device_total"] for r in rows)
    fig, _ = charts.sweep_heatmap_figure(rows, {"big": biggest, "small": biggest // 2})
    legend = fig.axes[0].get_legend()
    background = to_rgba(legend.get_frame().get_facecolor())
    for line in legend.get_lines():  # white on a white box was invisible
        assert to_rgba(line.get_color()) != background
    assert background != to_rgba("white")


def test_the_terminal_shows_the_reports_cost_of_a_million_tokens(run_cli):
    """Without --tokens the terminal prints the figure the JSON (and the web page) carry."""
    _, out, _ = run_cli("estimate", "llama-3.2-1b", "--gpu", "H100-SXM", "--json")
    perf = _strict_json(out)["performance"]
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "--gpu", "H100-SXM")
    assert code == 0
    assert f"cost: ${perf['cost_per_million_tokens_usd']:.3f} per million tokens" in \
        " ".join(out.split())
