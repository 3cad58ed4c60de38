"""The README's first lines are the two set-up commands, and its measured claims are the
ones in benchmarks/results/ (benchmarks/readme_claims.py builds the table)."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vramplan.cli import app as cli_app

ROOT = Path(__file__).parent.parent


def test_readme_starts_with_the_two_setup_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    commands = [line.split("#")[0].strip() for line in lines[:8]
                if line.startswith(("make ", "./", "python"))]
    assert commands == ["make run", "make test"]


def test_readme_claims_are_read_from_the_result_files():
    table = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_claims.py")],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert table in (ROOT / "README.md").read_text(), \
        "run: python benchmarks/readme_claims.py --write"


def _tour(part: int) -> list[tuple[str, str]]:
    """(command line, its comment) of the README tour's code block number `part`."""
    text = (ROOT / "README.md").read_text()
    tour = text[text.index("## A tour"):text.index("Every command that runs a job takes")]
    block = tour.split("```")[2 * part + 1].replace("\\\n", " ")  # continued lines
    return [(c.strip(), line.partition("#")[2]) for line in block.splitlines()
            if line.startswith("$ vramplan ")
            for c in line[2:].partition("#")[0].split(";")]


def test_the_tour_works_after_make_run(tmp_path, monkeypatch, capsys):
    """Every command of the tour's first part runs (serve aside: it blocks) with the exit
    code its comment promises: 1 where it says it does not fit, else 0."""
    monkeypatch.chdir(tmp_path)  # --html s.html lands here
    commands = [(c, note) for c, note in _tour(0) if not c.startswith("vramplan serve")]
    assert len(commands) >= 12
    for command, note in commands:
        command = command.replace(" tests/data/", f" {ROOT}/tests/data/")  # from the clone
        with pytest.raises(SystemExit) as stop:
            cli_app.main(shlex.split(command)[1:])
        err = capsys.readouterr().err
        expected = 1 if "does not fit" in note else 0
        assert stop.value.code == expected, f"{command}: exit {stop.value.code}: {err[-300:]}"
