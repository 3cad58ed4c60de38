"""How many trials do the batch-size and sequence-length searches need, and are they exact?

The formula engine is the oracle (instant), so every answer can be checked: the value found
fits and the next one (batch size + 1, sequence + granularity) does not. Target (issue 4):
the true maximum in at most ceil(log2(max)) + 2 trials.
Writes benchmarks/results/search_trials.{json,md}.

    python benchmarks/search_trials.py
"""

from __future__ import annotations

import json
import math
import platform
import time

from common import QUICK, results_dir  # noqa: E402 (benchmarks/common.py)

from vramplan import Job, Peft, estimate, max_batch_size, max_seq_len
from vramplan.hardware import get_gpu

OUT = results_dir()
MODELS = ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "mistral-7b",
          "qwen2.5-14b")
TECHNIQUES = {"full": {}, "lora": {"peft": Peft()},
              "qlora": {"peft": Peft(method="qlora"), "checkpointing": "full"}}
GPUS = ("L4", "A100-80GB", "H200")
GRANULARITY = 64


def check(job: Job, parameter: str, result, limit: int) -> bool:
    """The answer fits, and one step more does not (unless the model's positions stop it)."""
    if result.best is None:
        return estimate(job.with_changes(**{parameter: 1 if parameter == "batch_size"
                                            else GRANULARITY})).device_total > limit
    step = 1 if parameter == "batch_size" else GRANULARITY
    fits = estimate(job.with_changes(**{parameter: result.best})).device_total <= limit
    try:
        over = estimate(job.with_changes(**{parameter: result.best + step})).device_total > limit
    except Exception:  # a longer sequence the model refuses counts as the limit
        over = True
    return fits and (over or bool(result.limited_by))


def main() -> None:
    rows = []
    for model in (MODELS[:1] if QUICK else MODELS):
        for name, fields in TECHNIQUES.items():
            for gpu in GPUS:
                budget = get_gpu(gpu).usable_bytes
                for parameter in ("batch_size", "seq_len"):
                    job = Job(model=model, batch_size=1,
                              seq_len=2048, **fields)
                    if parameter == "batch_size":
                        result = max_batch_size(job, estimate, budget)
                    else:
                        result = max_seq_len(job, estimate, budget, granularity=GRANULARITY)
                    units = (result.best or 1) // (1 if parameter == "batch_size"
                                                   else GRANULARITY)
                    target = math.ceil(math.log2(max(units, 2))) + 2
                    rows.append({"model": model, "technique": name, "gpu": gpu,
                                 "parameter": parameter, "best": result.best,
                                 "trials": len(result.trials), "target": target,
                                 "exact": check(job, parameter, result,
                                                result.limit_bytes)})
    summary = {
        "searches": len(rows), "exact": sum(r["exact"] for r in rows),
        "trials": sum(r["trials"] for r in rows), "target_sum": sum(r["target"] for r in rows),
        "over_target": sum(r["trials"] > r["target"] for r in rows),
        "machine": f"{platform.platform()}, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    (OUT / "search_trials.json").write_text(json.dumps({"summary": summary, "rows": rows},
                                                       indent=2) + "\n")
    lines = ["# Search trials (formula engine as oracle)", "",
             f"Machine: {summary['machine']}. Date: {summary['date']}.", "",
             f"{summary['exact']} of {summary['searches']} searches exact; "
             f"{summary['trials']} trials in all against a target sum of "
             f"{summary['target_sum']}; {summary['over_target']} over their own target.", "",
             "Over target: " + (", ".join(
                 f"{r['model']} {r['technique']} {r['gpu']} {r['parameter']} "
                 f"({r['trials']} trials, target {r['target']})"
                 for r in rows if r["trials"] > r["target"]) or "none") + ".", "",
             "| model | technique | GPU | parameter | best | trials | target | exact |",
             "|---|---|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['model']} | {r['technique']} | {r['gpu']} | {r['parameter']} | "
              f"{r['best']} | {r['trials']} | {r['target']} | {r['exact']} |" for r in rows]
    (OUT / "search_trials.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
