import importlib.util
import sys
from pathlib import Path

import pytest

from vramplan.cli import app as cli_app
from vramplan.cli import options as cli_options


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Run the `vramplan` command in-process; returns (exit code, stdout, stderr)."""

    def run(*args: str):
        monkeypatch.setattr(sys, "argv", ["vramplan", *args])
        monkeypatch.setattr(cli_options.console, "width", 200)
        code = 0
        try:
            cli_app.main()
        except SystemExit as stop:
            code = stop.code or 0
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


# Without torch and transformers (the `make run` install), a module marked torch as a whole
# is not even imported, so `pytest -m "not torch"` runs the torch-free part there alone.
_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
_TORCH_MODULE = "pytestmark = pytest.mark.torch"


def pytest_ignore_collect(collection_path: Path, config):
    if _TORCH or collection_path.suffix != ".py" or not collection_path.is_file():
        return None
    return True if _TORCH_MODULE in collection_path.read_text() else None


# Over 9 s each on the 2-core VM (pytest --durations, 2026-12-02), and each a variant of a
# case that stays in the default run: `make test` must stay under 10 minutes on 2 cores.
# They run with -m slow (or "slow or not slow").
SLOW_ON_TWO_CORES = {
    "tests/engines/test_formula_vs_trace.py::test_formula_matches_trace[fsdp-root-unit]",
    "tests/frameworks/test_frameworks_trace.py::test_formula_matches_trace[torchtitan-op-lora]",
    "tests/frameworks/test_frameworks_trace.py::test_formula_matches_trace[torchtitan-op]",
    "tests/frameworks/test_frameworks_trace.py::test_formula_matches_trace[bf16-adapters]",
    "tests/frameworks/test_frameworks_trace.py::"
    "test_formula_matches_trace[fp32-adapters-bf16-model]",
    "tests/frameworks/test_frameworks_trace.py::test_formula_matches_trace[every-2nd-layer]",
    "tests/web/test_web_browser.py::test_trace_completes_and_shows_its_timeline",
    "tests/web/test_web_api.py::test_a_dead_worker_is_reported_and_replaced",
    "tests/engines/test_compile_formula.py::"
    "test_torchtune_chunked_losses_compiled_follow_the_trace[chunked:torchtune-output]",
    "tests/engines/test_compile_formula.py::"
    "test_torchtune_chunked_losses_compiled_follow_the_trace[chunked:torchtune-linear]",
    "tests/engines/test_offload_trace.py::test_formula_matches_trace_with_optimizer_offload",
    "tests/engines/test_formula_vs_trace.py::test_formula_matches_trace[chunked-loss]",
    # 7-8 s each (2026-12-02): the plain torchtune case and the other properties stay
    "tests/frameworks/test_frameworks_trace.py::"
    "test_torchtune_losses_match[torchtune-chunked-output]",
    "tests/frameworks/test_frameworks_trace.py::"
    "test_torchtune_losses_match[torchtune-no-checkpointing]",
    "tests/engines/test_properties.py::"
    "test_more_gpus_never_need_more_memory_per_gpu_under_sharding",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_ON_TWO_CORES:
            item.add_marker(pytest.mark.slow)
