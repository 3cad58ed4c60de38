"""How fast is the formula engine? In-process time per estimate() and the whole CLI process.

Targets (issue 2): estimate() <= 1 ms per job in-process; `vramplan estimate ... --json`
<= 0.5 s as a whole process. Writes benchmarks/results/formula_speed.json.

    python benchmarks/formula_speed.py
"""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import QUICK, results_dir  # noqa: E402 (benchmarks/common.py)

from vramplan import Job, Parallel, Peft, estimate
from vramplan.models import list_models

OUT = results_dir() / "formula_speed.json"


def jobs() -> list[Job]:
    """Every catalog model under a few technique settings."""
    out = []
    for entry in list_models():
        out.append(Job(model=entry.name, batch_size=4))
        if entry.family in ("llama", "qwen", "mistral", "gemma", "phi"):
            out.append(Job(model=entry.name, batch_size=2, seq_len=4096, peft=Peft(method="qlora"),
                           checkpointing="full"))
            out.append(Job(model=entry.name, batch_size=1, parallel=Parallel(strategy="fsdp",
                                                                             num_gpus=8)))
    return out


def in_process(repeats: int = 20) -> dict:
    batch = jobs()
    estimate(batch[0])  # load the catalogs once, as a long-lived process would have
    per_job = []
    for _ in range(repeats):
        start = time.perf_counter()
        for job in batch:
            estimate(job)
        per_job.append((time.perf_counter() - start) / len(batch))
    return {"jobs": len(batch), "repeats": repeats,
            "median_ms_per_job": 1e3 * statistics.median(per_job),
            "max_ms_per_job": 1e3 * max(per_job)}


def whole_process(repeats: int = 10) -> dict:
    exe = shutil.which("vramplan") or str(Path(sys.executable).parent / "vramplan")
    cmd = [exe, "estimate", "llama-3.1-70b", "-b", "4", "-s", "4096", "--gpu", "H100", "--json"]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True)
        assert done.returncode in (0, 1), done.stderr  # 1: it does not fit the --gpu asked
        times.append(time.perf_counter() - start)
    return {"command": " ".join(["vramplan", *cmd[1:]]), "repeats": repeats,
            "median_s": statistics.median(times), "max_s": max(times)}


def main() -> None:
    result = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "date": time.strftime("%Y-%m-%d"),
        "in_process": in_process(3 if QUICK else 20),
        "whole_process": whole_process(2 if QUICK else 10),
        "targets": {"ms_per_job": 1.0, "process_s": 0.5},
    }
    result["meets_targets"] = (result["in_process"]["median_ms_per_job"] <= 1.0
                               and result["whole_process"]["median_s"] <= 0.5)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
