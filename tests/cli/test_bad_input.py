"""A permanent bad-input battery (issue 12): generated cases over the commands, every Job
field the CLI sets, and malformed job files and model configs. Each must end with exit
code 2, one line on stderr, no traceback, within a time limit. The summary (cases by
outcome) is written to benchmarks/results/bad_input_battery.json when BAD_INPUT_SUMMARY is
set:

    BAD_INPUT_SUMMARY=1 python -m pytest -q tests/cli/test_bad_input.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from vramplan.cli import app as cli_app
from vramplan.cli import options as cli_options

TIME_LIMIT_S = 10
SUMMARY = Path(__file__).parents[2] / "benchmarks" / "results" / "bad_input_battery.json"

NUMBERS = ["0", "-1", "x", "", "1" + "0" * 400, "nan", "inf", "1e400", "1.5"]
INT_OPTIONS = ["--batch-size", "--grad-accum", "--seq-len", "--target-len", "--image-size",
               "--lora-rank", "--num-gpus", "--tensor-parallel", "--context-parallel"]
FLOAT_OPTIONS = ["--audio-seconds", "--lora-alpha", "--allocator-overhead"]
CHOICE_OPTIONS = ["--precision", "--optimizer", "--optimizer-impl", "--checkpointing",
                  "--attention", "--loss", "--peft", "--strategy", "--task", "--framework"]
SIZE_OPTIONS = ["--cuda-context"]

CONFIGS = {  # broken config.json files (item 7)
    "zero-heads": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=0, vocab_size=256,
                       n_positions=64),
    "nan-width": '{"model_type": "llama", "hidden_size": NaN, "intermediate_size": 128, '
                 '"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}',
    "infinite-vocab": '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
                      '"num_hidden_layers": 2, "num_attention_heads": 4, '
                      '"vocab_size": Infinity}',
    "heads-not-dividing": dict(model_type="bert", hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=3, vocab_size=256,
                               max_position_embeddings=64),
    "kv-groups": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=3,
                      vocab_size=256),
    "no-model-type": dict(hidden_size=64),
    "unknown-model-type": dict(model_type="mamba", hidden_size=64),
    "not-an-object": "[1, 2, 3]",
    "malformed": "{",
    "string-layers": dict(model_type="gpt2", n_embd=64, n_layer="2", n_head=4,
                          vocab_size=256, n_positions=64),
    # issue 19 section 2: a strict transformers config class refusing a type (a traceback)
    "strict-type": dict(model_type="gpt_neox", hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, vocab_size=256,
                        use_parallel_residual="yes"),
    # ... and a shape key left out, which took transformers' default (pythia-160m without
    # hidden_size was estimated at 2.9B parameters)
    "missing-shape-key": dict(model_type="gpt_neox", num_hidden_layers=12,
                              num_attention_heads=12, intermediate_size=3072,
                              vocab_size=50304),
    # pre-quantised weights were estimated as 16-bit (quantization_config ignored)
    "gptq": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                 quantization_config=dict(quant_method="gptq", bits=4, group_size=128)),
    "bnb-4bit-full-finetune": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   vocab_size=256, quantization_config=dict(
                                       quant_method="bitsandbytes", load_in_4bit=True,
                                       bnb_4bit_quant_type="nf4")),
    # MPT without no_bias: transformers reads no biases, llm-foundry biases everywhere
    "mpt-ambiguous-bias": dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2,
                               vocab_size=256, attn_config=dict(alibi=True)),
    "mpt-gqa-without-kv-heads": dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2,
                                     vocab_size=256, no_bias=True, attn_config=dict(
                                         alibi=True, attn_type="grouped_query_attention")),
}
# configs the trace reads (a transformers config class), given with --engine trace
TRACE_CONFIGS = {
    # transformers' MptAttentionConfig types attn_pdrop as int (0.0 is normalised)
    "mpt-dropout": dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2, vocab_size=256,
                        no_bias=True, attn_config=dict(alibi=True, attn_pdrop=0.1)),
    # llm-foundry's biases, which transformers' MptForCausalLM does not build
    "mpt-biases": dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2, vocab_size=256,
                       no_bias=False, attn_config=dict(alibi=True)),
    "missing-shape-key": CONFIGS["missing-shape-key"],
    "gptq": CONFIGS["gptq"],
}

JOB_FILES = {  # malformed job files (item 11)
    "alias-bomb.yaml": "\n".join(
        ["a: &a [x, x, x, x, x, x, x, x, x]"]
        + [f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]"
           for i in range(8)]) + "\n",
    "huge.yaml": "model: " + "x" * 2_000_000 + "\n",
    "malformed.yaml": "model: [gpt2\n",
    "list.yaml": "- 1\n- 2\n",
    "unknown-key.yaml": "model: gpt2\nbatchsize: 2\n",
    "bad-value.toml": 'model = "gpt2"\nbatch_size = -4\n',
    "bad.json": '{"model": "gpt2", "peft": {"rank": 0}}',
    "not-utf8.yaml": b"\xff\xfe\x00model".decode("latin-1"),
}


def _step(seconds):
    def change(row):
        row["measured"]["step_time_median_s"] = seconds
        return row
    return change


def _device(name):
    def change(row):
        row["measured"]["device_name"] = name
        return row
    return change


CALIBRATE_FILES = {  # a measured H200 run, broken one way each (issue 19, calibrate)
    "step 1e-9 s": _step(1e-9),
    "step 1e9 s": _step(1e9),
    "step as text": _step("fast"),
    "step true": _step(True),
    "step NaN": lambda row: json.dumps(row).replace(
        json.dumps(row["measured"]["step_time_median_s"]), "NaN", 1),
    "faster than the datasheet": _step(1e-3),
    "run on an L4": _device("NVIDIA L4"),
    "run on the CPU": _device("cpu"),
    "a list": lambda row: [1, 2, 3],
    "a sweep": lambda row: [{"batch_size": 1, "seq_len": 128, "device_total": 5}],
    "an estimate": lambda row: {"job": row["job"], "peak_allocated": 5},
}


def cases(tmp: Path) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for option in INT_OPTIONS + FLOAT_OPTIONS:
        allowed = {"1.5"} if option in FLOAT_OPTIONS else set()
        if option == "--allocator-overhead":
            allowed.add("0")  # no overhead is a value a user may measure
        out += [(f"estimate {option} {v[:12]!r}", ["estimate", "gpt2", option, v])
                for v in NUMBERS if v not in allowed]
    for option in CHOICE_OPTIONS:
        out.append((f"estimate {option} bogus", ["estimate", "gpt2", option, "bogus"]))
    for option in SIZE_OPTIONS:
        out += [(f"estimate {option} {v[:12]!r}", ["estimate", "gpt2", option, v])
                for v in ["x", "", "-1GB", "1" + "0" * 400 + "GB", "inf GB"]]
    out += [
        ("estimate model ''", ["estimate", ""]),
        ("estimate model 300 bytes", ["estimate", "x" * 300]),
        ("estimate model NUL", ["estimate", "bad\x01name"]),
        ("estimate missing path", ["estimate", str(tmp / "nope" / "config.json")]),
        ("estimate unknown gpu", ["estimate", "gpt2", "--gpu", "H9000"]),
        ("estimate gpu 300 bytes", ["estimate", "gpt2", "--gpu", "g" * 300]),
        ("estimate lora targets none", ["estimate", "gpt2", "--peft", "lora",
                                        "--lora-targets", "nothing"]),
        ("estimate seq beyond positions", ["estimate", "gpt2", "-s", "4096"]),
        ("estimate --set unknown", ["estimate", "gpt2", "--set", "bogus=1"]),
        ("estimate --set malformed", ["estimate", "gpt2", "--set", "noequals"]),
        # a whole section (issue 19): only peft=null has a meaning (no adapters)
        ("estimate --set peft=lora", ["estimate", "gpt2", "--set", "peft=lora"]),
        ("estimate --set parallel=3", ["estimate", "gpt2", "--set", "parallel=3"]),
        ("estimate --set parallel=null", ["estimate", "gpt2", "--set", "parallel=null"]),
        ("estimate --set peft=null and --lora-rank", ["estimate", "gpt2", "--set", "peft=null",
                                                      "--lora-rank", "8"]),
        ("estimate tp not dividing heads", ["estimate", "gpt2", "-n", "5", "--tp", "5"]),
        ("estimate cp on an encoder", ["estimate", "bert-base-uncased", "-n", "2", "--cp",
                                       "2"]),
        ("estimate unknown engine", ["estimate", "gpt2", "--engine", "magic"]),
        ("sweep batch sizes 0,1", ["sweep", "gpt2", "--batch-sizes", "0,1"]),
        ("sweep batch sizes x", ["sweep", "gpt2", "--batch-sizes", "1,x"]),
        ("sweep batch sizes empty", ["sweep", "gpt2", "--batch-sizes", ""]),
        ("sweep seq lens -1", ["sweep", "gpt2", "--batch-sizes", "1", "--seq-lens", "-1"]),
        ("models min params ''", ["models", "--min-params", ""]),
        ("models min params x", ["models", "--min-params", "x"]),
        ("models max params -1", ["models", "--max-params", "-1"]),
        ("gpus unknown option", ["gpus", "--bogus"]),
        ("unknown command", ["bogus"]),
        ("measure device tpu", ["measure", "gpt2", "--device", "tpu"]),
        # unwritable outputs are checked before running (item 9)
        ("estimate --out missing folder", ["estimate", "gpt2", "--out",
                                           str(tmp / "no" / "such" / "r.json")]),
        ("estimate --out under a file", ["estimate", "gpt2", "--out",
                                         str(tmp / "a-file" / "r.json")]),
        ("estimate --html missing folder", ["estimate", "gpt2", "--html",
                                            str(tmp / "no" / "r.html")]),
        ("estimate --plot missing folder", ["estimate", "gpt2", "--plot",
                                            str(tmp / "no" / "r.png")]),
        ("sweep --csv missing folder", ["sweep", "gpt2", "--batch-sizes", "1", "--csv",
                                        str(tmp / "no" / "r.csv")]),
        # impossible jobs (item 10)
        ("estimate cp 3 with seq 2048", ["estimate", "llama-3.2-1b", "-n", "3", "--cp", "3",
                                         "-s", "2048"]),
        ("estimate target len 1e23", ["estimate", "t5-small", "--target-len", "1e23"]),
    ]
    out += [  # issue 19, section 2: margins and amounts, plan, calibrate, older classes
        ("estimate tokens 1e400", ["estimate", "gpt2", "--gpu", "L4", "--tokens", "1e400"]),
        ("estimate tokens 0", ["estimate", "gpt2", "--gpu", "L4", "--tokens", "0"]),
        ("plan tokens 1e400", ["plan", "gpt2", "--tokens", "1e400"]),
        ("plan deadline inf", ["plan", "gpt2", "--tokens", "1B", "--deadline", "inf"]),
        ("plan max cost nan", ["plan", "gpt2", "--tokens", "1B", "--max-cost", "nan"]),
        ("plan max cost inf", ["plan", "gpt2", "--tokens", "1B", "--max-cost", "inf"]),
        ("plan constraints unmet", ["plan", "gpt2", "--tokens", "1B", "--max-cost",
                                    "0.000001"]),
        ("plan --gpu and --gpus", ["plan", "gpt2", "--gpu", "L4", "--gpus", "H100"]),
        ("estimate job /dev/zero", ["estimate", "--job", "/dev/zero"]),
        ("estimate image size on text", ["estimate", "gpt2", "--image-size", "224"]),
        ("estimate seq len on vision", ["estimate", "vit-base-patch16-224", "-s", "128"]),
        ("estimate target len on decoder", ["estimate", "gpt2", "--target-len", "64"]),
        ("estimate audio on text", ["estimate", "gpt2", "--audio-seconds", "3"]),
        ("estimate --set boolean batch", ["estimate", "gpt2", "--set", "batch_size=true"]),
        ("estimate --set boolean gpus", ["estimate", "gpt2", "--set",
                                         "parallel.num_gpus=false"]),
        ("estimate --set boolean alpha", ["estimate", "gpt2", "--peft", "lora", "--set",
                                          "peft.alpha=true"]),
        ("sweep margin 2", ["sweep", "gpt2", "--batch-sizes", "1,2", "--margin", "2"]),
        ("search margin -1", ["search", "batch-size", "gpt2", "--gpu", "L4", "--margin",
                              "-1"]),
        ("search budget 0", ["search", "batch-size", "gpt2", "--budget", "0"]),
        ("search budget -1GB", ["search", "batch-size", "gpt2", "--budget", "-1GB"]),
        ("search budget 1e400GB", ["search", "batch-size", "gpt2", "--budget", "1e400GB"]),
        ("search no budget", ["search", "batch-size", "gpt2"]),
        ("measure unknown emulate gpu", ["measure", "gpt2", "--emulate-gpu", "H9000"]),
        ("lora targets of another family", ["estimate", "gpt2", "--peft", "lora",
                                            "--lora-targets", "q_proj"]),
    ]
    for price in ("inf", "nan", "-1", "0"):
        out.append((f"estimate price per hour {price}", [
            "estimate", "gpt2", "--gpu", "L4", "--tokens", "1B", "--price-per-hour", price]))
    run_row = json.loads((SUMMARY.parent / "gpu_validation.json").read_text())["rows"][0]
    for name, change in CALIBRATE_FILES.items():
        path = tmp / f"calibrate-{name}.json"
        data = change(json.loads(json.dumps(run_row)))
        path.write_text(data if isinstance(data, str) else json.dumps(data))
        out.append((f"calibrate {name}", ["calibrate", str(path), "--gpu", "H200",
                                          "--dry-run"]))
    out.append(("calibrate /dev/zero", ["calibrate", "/dev/zero", "--dry-run"]))
    (tmp / "a-file").write_text("not a folder")
    for name, text in CONFIGS.items():
        path = tmp / name / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if isinstance(text, str) else json.dumps(text))
        out.append((f"config {name}", ["estimate", str(path)]))
    for name, config in TRACE_CONFIGS.items():
        path = tmp / f"trace-{name}" / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config))
        out.append((f"trace config {name}", ["estimate", str(path), "--engine", "trace"]))
    for name, text in JOB_FILES.items():
        path = tmp / name
        path.write_bytes(text.encode("latin-1") if name == "not-utf8.yaml" else text.encode())
        out.append((f"job file {name}", ["estimate", "--job", str(path)]))
    return out


def run(argv: list[str], capsys, monkeypatch) -> tuple[int, str, str, float]:
    monkeypatch.setattr(sys, "argv", ["vramplan", *argv])
    monkeypatch.setattr(cli_options.console, "width", 200)
    start, code = time.perf_counter(), 0
    try:
        cli_app.main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException as error:  # noqa: BLE001 - a traceback is what this test looks for
        captured = capsys.readouterr()
        return -1, captured.out, f"Traceback: {type(error).__name__}: {error}", 0.0
    captured = capsys.readouterr()
    return code, captured.out, captured.err, time.perf_counter() - start


def outcome(code: int, err: str, seconds: float) -> str:
    if "Traceback" in err:
        return "traceback"
    if seconds > TIME_LIMIT_S:
        return "too slow"
    if code == 0:
        return "accepted nonsense"
    if code != 2:
        return f"wrong exit code {code}"
    if len(err.strip().splitlines()) != 1 or not err.startswith("error: "):
        return "not one line"
    return "clean"


def test_bad_input_battery(tmp_path, capsys, monkeypatch):
    results = []
    for name, argv in cases(tmp_path):
        code, _, err, seconds = run(argv, capsys, monkeypatch)
        results.append({"case": name, "outcome": outcome(code, err, seconds), "exit": code,
                        "seconds": round(seconds, 3), "stderr": err.strip()[:200]})
    counts = Counter(r["outcome"] for r in results)
    if os.environ.get("BAD_INPUT_SUMMARY"):
        SUMMARY.write_text(json.dumps({
            "machine": "2-core x86_64 VM, Python 3.11 (in-process CLI)",
            "cases": len(results), "by_outcome": dict(counts), "time_limit_s": TIME_LIMIT_S,
            "results": results}, indent=1) + "\n")
    bad = [f"{r['case']}: {r['outcome']} ({r['stderr'][:120]})" for r in results
           if r["outcome"] != "clean"]
    assert not bad, "\n".join(bad)


def test_set_peft_null_means_no_adapters(tmp_path):
    # it ended in a TypeError traceback; over a job file's adapters it trains every weight
    job_file = tmp_path / "job.yaml"
    job_file.write_text("model: gpt2\npeft:\n  rank: 8\n")
    assert cli_options.build_job(None, job_file, {}, ["peft=null"]).peft is None
    assert cli_options.build_job("gpt2", None, {}, ["peft=null"]).peft is None
    assert cli_options.build_job(None, job_file, {}, []).peft.rank == 8
