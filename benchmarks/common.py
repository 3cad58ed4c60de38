"""What every benchmark shares: where results go and whether to run quickly.

`make bench` (benchmarks/run_all.py) runs each benchmark in full and rewrites
benchmarks/results/. CI runs them with --quick: a few cases each, written to a temporary
folder (VRAMPLAN_BENCH_OUT), so that a benchmark cannot rot unnoticed."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

QUICK = os.environ.get("VRAMPLAN_BENCH_QUICK") == "1"


# the config keys of a model's depth, across transformers' families
DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers",
              "encoder_layers", "decoder_layers")


def shrunk_config(model: str, depth: int, widths: dict[str, int]) -> dict:
    """A model's transformers config with `widths` set where it has those keys, `depth`
    blocks, and its special token ids inside the shrunk vocabulary: a step the CPU runs
    in seconds whose per-block counts scale to the real model."""
    from vramplan.training.hf_model import load_model_config

    config = dict(load_model_config(model))
    config.update({k: v for k, v in widths.items() if k in config})
    config.update({k: depth for k in DEPTH_KEYS if k in config})
    for i, k in enumerate(("pad_token_id", "bos_token_id", "eos_token_id",
                           "decoder_start_token_id")):
        if isinstance(config.get(k), int):
            config[k] = i
    return config


def results_dir() -> Path:
    folder = Path(os.environ.get("VRAMPLAN_BENCH_OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def host_cpu() -> str:
    """The host's CPU model and count: a step's host time per kernel is the host's, so a GPU
    run records which CPU drove it (docs/performance.md, "Host time is the host's")."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def machine_line() -> str:
    """The machine, in one line, for a result's header."""
    return (f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}")


def write_results(name: str, result: dict, markdown: str) -> None:
    """A benchmark's results: `name`.json (the numbers) and `name`.md (the table)."""
    out = results_dir()
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown)
