"""The README's first lines are the two set-up commands, and its measured claims are the
ones in benchmarks/results/ (benchmarks/readme_claims.py builds the table)."""

import subprocess
import sys
from pathlib import Path

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
