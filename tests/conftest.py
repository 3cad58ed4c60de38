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
