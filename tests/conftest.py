import sys

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
