"""Mutation testing of the formula, the fit table and the report's categories: each mutant
is a one-line change to a copy of the package; a mutant is killed when the fast tests
fail on it. The six mutants the foundation review found surviving come first, then
operator and constant mutants generated in the fit and category code.

    python benchmarks/mutation_check.py          # writes results/mutation_testing.{json,md}

(mutmut / cosmic-ray would run the whole suite per mutant: hours on 2 cores. This runs
the test files that cover these modules, about 40 s per mutant.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import QUICK, machine_line, results_dir  # noqa: E402 (benchmarks/common.py)

ROOT = Path(__file__).parent.parent
TESTS = ["tests/engines/test_pinned.py", "tests/engines/test_formula.py",
         "tests/hardware/test_gpus.py", "tests/cli/test_cli.py",
         "tests/frameworks/test_frameworks.py"]

# (name, file, old text, new text): the review's six, by hand
LISTED = [
    ("allocator overhead x10", "vramplan/engines/formula/phases.py",
     'ALLOCATOR_OVERHEAD = {"none": 0.06,', 'ALLOCATOR_OVERHEAD = {"none": 0.6,'),
    ("CUDA context 1390 -> 139 MiB", "vramplan/job.py",
     "Field(1390 * 1024**2,", "Field(139 * 1024**2,"),
    ("fit against nominal memory", "vramplan/engines/runtime.py",
     "fits=fits_within(required, gpu.usable_bytes, margin)",
     "fits=fits_within(required, gpu.memory_bytes, margin)"),
    ("activations outside the blocks = 0", "vramplan/engines/formula/saved.py",
     "    total += norm_bytes * n_last  # final norm",
     "    total += 0 * n_last  # final norm"),
    ("a gated-MLP tensor dropped", "vramplan/engines/activations.py",
     'saved.append(("gate/up/act", (2 * c +', 'saved.append(("gate/up/act", (1 * c +'),
    ("recomputed activations as temporary (trace)", "vramplan/engines/trace.py",
     '            return "activations"  # recomputed by checkpointing',
     '            return "temporary"  # recomputed by checkpointing'),
]

# generated: every comparison and +/- in these functions, one at a time
GENERATED_IN = [("vramplan/engines/runtime.py", "def fit_table", "def fits_for_job"),
                ("vramplan/fit.py", "def limit_bytes", "# --- precision support"),
                ("vramplan/engines/memory_report.py", "    def peak_allocated",
                 "    def to_json_dict")]
SWAPS = [(" >= ", " > "), (" <= ", " < "), (" - ", " + "), (" + ", " - "), (" > ", " >= "),
         (" and not ", " or not ")]


def generated() -> list[tuple[str, str, str, str]]:
    mutants = []
    for path, start, end in GENERATED_IN:
        text = (ROOT / path).read_text()
        a = text.index(start)
        b = text.index(end, a) if end else len(text)
        in_doc = False
        for line in text[a:b].splitlines():
            if line.count('"""') == 1:  # a docstring opens or closes here
                in_doc = not in_doc
                continue
            if in_doc or line.strip().startswith(("#", '"""', "@")) or "->" in line:
                continue
            for old, new in SWAPS:
                for match in re.finditer(re.escape(old), line):
                    changed = line[:match.start()] + new + line[match.end():]
                    mutants.append((f"{path.split('/')[-1]}: {line.strip()} -> "
                                    f"{changed.strip()}", path, line, changed))
    return mutants


def run(mutant: tuple[str, str, str, str], work: Path) -> dict:
    name, path, old, new = mutant
    target = work / path
    original = target.read_text()
    if original.count(old) != 1:
        return {"mutant": name, "file": path, "outcome": "not applied (text not unique)"}
    target.write_text(original.replace(old, new))
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               *TESTS], cwd=work, capture_output=True, text=True, timeout=900)
        outcome = "killed" if done.returncode else "survived"
    except subprocess.TimeoutExpired:
        outcome = "killed (timeout)"
    finally:
        target.write_text(original)
    return {"mutant": name, "file": path, "outcome": outcome,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    mutants = LISTED + generated()
    if QUICK:
        mutants = mutants[:1]
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        for part in ("vramplan", "tests", "pyproject.toml", "docs", "README.md"):
            source = ROOT / part
            (shutil.copytree if source.is_dir() else shutil.copy)(source, work / part)
        rows = []
        for mutant in mutants:
            rows.append(run(mutant, work))
            print(f"{rows[-1]['outcome']:>10}  {mutant[0]}", flush=True)
    survived = [r for r in rows if r["outcome"] == "survived"]
    summary = {"machine": machine_line(), "date": time.strftime("%Y-%m-%d"), "tests": TESTS,
               "mutants": len(rows), "killed": sum(r["outcome"].startswith("killed")
                                                   for r in rows),
               "survived": len(survived)}
    out = results_dir()
    (out / "mutation_testing.json").write_text(
        json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
    lines = ["# Mutation testing: formula, fit table, report categories", "",
             f"Machine: {summary['machine']}. Date: {summary['date']}. Tests run per mutant: "
             f"{', '.join(TESTS)}.", "",
             f"{summary['killed']} of {summary['mutants']} mutants killed; "
             f"{summary['survived']} survived.", "", "| mutant | outcome |", "|---|---|"]
    lines += [f"| `{r['mutant']}` | {r['outcome']} |" for r in rows]
    (out / "mutation_testing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6]))


if __name__ == "__main__":
    main()
