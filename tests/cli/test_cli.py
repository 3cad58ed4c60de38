import json
import subprocess
import sys

import pytest

import vramplan


def test_no_arguments_estimates_the_default_job(run_cli):
    code, out, err = run_cli()
    assert code == 0, err
    assert "llama-3.1-8b" in out and "qlora" in out
    for category in ("weights", "gradients", "optimizer states", "activations", "inputs",
                     "temporary", "allocator overhead", "runtime context", "peak allocated"):
        assert category in out
    assert "L4" in out and "Does it fit?" in out


def test_estimate_flags_and_json(run_cli):
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "-b", "4", "--seq-len", "1024",
                           "--precision", "bf16-mixed", "--optimizer", "adamw", "--gpu", "L4",
                           "--json")
    data = json.loads(out)
    assert data["job"]["batch_size"] == 4 and data["job"]["seq_len"] == 1024
    assert [f["gpu"] for f in data["fits"]] == ["L4"]
    assert code == 1 and not data["fits"][0]["fits"]  # does not fit the GPU asked for: exit 1
    assert data["peak_allocated"] == vramplan.estimate(vramplan.Job(
        model="llama-3.2-1b", batch_size=4, seq_len=1024, gpu="L4")).peak_allocated


def test_job_file_with_flag_overrides(run_cli, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: gpt2\nbatch_size: 2\nseq_len: 512\npeft:\n  rank: 4\n"
                    "  target_modules: [c_attn]\n")
    code, out, err = run_cli("estimate", "--job", str(path), "-b", "8", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert (data["model_name"], data["job"]["batch_size"], data["job"]["peft"]["rank"]) == \
        ("gpt2", 8, 4)


def test_lora_flags_build_a_peft_section(run_cli):
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "--lora-rank", "8",
                           "--lora-targets", "q_proj,v_proj", "--json")
    assert code == 0
    assert json.loads(out)["params_trainable"] == 851_968


def test_runtime_flags_override_the_measured_defaults(run_cli):
    code, out, err = run_cli("estimate", "gpt2", "--cuda-context", "800MiB",
                             "--allocator-overhead", "0.1", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["categories"]["runtime_context"] == 800 * 2**20
    assert data["categories"]["allocator_overhead"] == int(0.1 * data["peak_allocated"])


@pytest.mark.parametrize("args, fragment", [
    (["estimate", "lama-3.1-8b"], "did you mean 'llama-3.1-8b'"),
    (["estimate", "gpt2", "--gpu", "H10O"], "unknown gpu 'H10O'"),
    (["estimate", "gpt2", "-b", "0"], "batch_size"),
    (["estimate", "gpt2", "-b", "-2"], "batch_size"),
    (["estimate", "gpt2", "--seq-len", "4096"], "1024 learned positions"),
    (["estimate", "gpt2", "--precision", "fp7"], "'fp7' is not one of 'fp32'"),
    (["estimate", "--job", "/nonexistent/job.yaml"], "does not exist"),
    (["estimate", "gpt2", "--engine", "magic"], "unknown engine 'magic'"),
    (["estimate", "gpt2", "--unit", "furlongs"], "'furlongs' is not one of 'GiB', 'GB'"),
    (["models", "--min-params", "lots"], "parameter count"),
    (["gpus", "--min-memory", "big"], "memory size"),
    (["estimate", "gpt2", "--cuda-context", "lots"], "cannot read 'lots' as a memory size"),
    (["estimate", "gpt2", "--allocator-overhead", "2"], "allocator_overhead"),
])
def test_bad_input_is_one_line_and_exit_code_2(run_cli, args, fragment):
    code, out, err = run_cli(*args)
    assert code == 2
    assert fragment.lower() in err.lower()
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3


def test_malformed_and_unknown_key_job_files(run_cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: gpt2\nbatch_size: [1\n")
    code, _, err = run_cli("estimate", "--job", str(bad))
    assert code == 2 and "bad.yaml" in err and "line" in err
    typo = tmp_path / "typo.yaml"
    typo.write_text("model: gpt2\nbatchsize: 2\n")
    code, _, err = run_cli("estimate", "--job", str(typo))
    assert code == 2 and "did you mean 'batch_size'" in err


def test_models_and_gpus_listings_filter(run_cli):
    code, out, _ = run_cli("models", "--family", "llama", "--json")
    names = [m["name"] for m in json.loads(out)]
    assert code == 0 and "llama-3.1-8b" in names and "gpt2" not in names
    code, out, _ = run_cli("gpus", "--min-memory", "80GB", "--json")
    gpus = json.loads(out)
    assert code == 0 and "H100-SXM" in [g["name"] for g in gpus] and "L4" not in [
        g["name"] for g in gpus]
    code, out, _ = run_cli("gpus")
    assert code == 0 and "L4" in out


def test_import_and_formula_path_do_not_import_torch():
    code = ("import sys, vramplan, vramplan.cli.app; "
            "vramplan.estimate(vramplan.Job(model='llama-3.1-70b')); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_public_api_is_explicit_and_sorted():
    assert vramplan.__all__ == sorted(vramplan.__all__)
    for name in vramplan.__all__:
        assert hasattr(vramplan, name)


def test_local_config_file_and_model_folder(run_cli, tmp_path):
    config = ('{"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, '
              '"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, '
              '"vocab_size": 32000, "max_position_embeddings": 4096}')
    (tmp_path / "config.json").write_text(config)
    for ref in (str(tmp_path / "config.json"), str(tmp_path)):
        code, out, err = run_cli("estimate", ref, "-b", "2", "--json")
        assert code == 0, err
        assert json.loads(out)["params_total"] > 0


@pytest.mark.torch
def test_trace_engine_from_the_cli(run_cli):
    code, out, err = run_cli("estimate", "gpt2", "-b", "1", "-s", "64", "--engine", "trace")
    assert code == 0, err
    assert "trace engine" in out and "Largest holders at the peak" in out


@pytest.mark.slow  # over 10 s on 2 cores: `pytest -m slow` runs it
def test_every_module_imports_alone_in_a_fresh_interpreter():
    """No import cycles: each module (a command too) imports on its own."""
    import pkgutil

    names = [m.name for m in pkgutil.walk_packages(vramplan.__path__, "vramplan.")
             if m.name != "vramplan.__main__"]
    code = ("import importlib, sys\nfailed = []\nfor name in sys.argv[1:]:\n"
            "    for loaded in [m for m in sys.modules if m.startswith('vramplan')]:\n"
            "        del sys.modules[loaded]\n"
            "    try:\n        importlib.import_module(name)\n"
            "    except Exception as e:\n        failed.append(f'{name}: {e!r}')\n"
            "print('\\n'.join(failed))")
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                         check=True)
    assert "vramplan.cli.commands.search" in names and out.stdout.strip() == ""


def test_set_reaches_fields_without_a_flag(run_cli):
    code, out, err = run_cli("estimate", "gpt2", "--peft", "lora", "--lora-targets", "c_attn",
                             "--set", "peft.dropout=0.2", "--set", "runtime.cublas_workspaces=0",
                             "--json")
    assert code == 0, err
    job = json.loads(out)["job"]
    assert job["peft"]["dropout"] == 0.2 and job["runtime"]["cublas_workspaces"] == 0
    code, _, err = run_cli("estimate", "gpt2", "--set", "peft.dropot=0.2")
    assert code == 2 and "did you mean 'dropout'" in err


def test_version_and_exit_code_when_it_does_not_fit(run_cli):
    code, out, _ = run_cli("--version")
    assert code == 0 and out.strip() == f"vramplan {vramplan.__version__}"
    code, _, _ = run_cli("estimate", "llama-3.1-8b", "--gpu", "L4")   # 16 GB of bf16 weights
    assert code == 1
    code, _, _ = run_cli("estimate", "gpt2", "--gpu", "L4")
    assert code == 0


def test_unwritable_output_is_refused_before_running(run_cli, tmp_path):
    code, _, err = run_cli("estimate", "gpt2", "--out", str(tmp_path / "missing" / "r.json"))
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli("estimate", "gpt2", "--out", str(tmp_path))
    assert code == 2 and "is a folder" in err
    code, _, err = run_cli("estimate", "gpt2", "--out", str(tmp_path / "r.json"))
    assert code == 0 and json.loads((tmp_path / "r.json").read_text())["engine"] == "formula"


def test_the_plan_function_is_callable_after_any_import():
    # vramplan.plan is the planner function, never shadowed by a subpackage of that name
    import vramplan.planning.planner  # noqa: F401
    plan = vramplan.plan(vramplan.Job(model="gpt2", seq_len=512, batch_size=8),
                         tokens=10**8, gpus=["L4"])
    assert callable(vramplan.plan) and plan.status == "ok" and plan.recommended is not None
