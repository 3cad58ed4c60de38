"""`vramplan calibrate`: fit the performance model to your own measured runs.

    vramplan measure llama-3.2-1b -b 4 --json --out run1.json     (on the GPU)
    vramplan calibrate run1.json run2.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from vramplan.cli.options import AsJson, console, print_json


def calibrate(
    results: Annotated[list[Path], typer.Argument(
        help="measure reports (JSON with the job and its measured step time)")],
    gpu: Annotated[Optional[str], typer.Option(
        help="the GPU the runs were on (default: the name the runs carry)")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="fit and show, but do not store")] = False,
    as_json: AsJson = False,
) -> None:
    """Fit the efficiency factors of the step-time model on measured runs of one GPU type
    and store them in your config folder; later estimates and plans on it use them.

    Example: vramplan calibrate run1.json run2.json
    """
    from vramplan.planning.calibrate import calibrate as fit_runs
    from vramplan.planning.calibrate import save

    result = fit_runs(list(results), gpu)
    path = None if dry_run else save(result)
    if as_json:
        print_json({**result.model_dump(mode="json"), "stored_in": str(path) if path else None})
        return
    f = result.factors
    console.print(f"{result.gpu}: {result.runs} runs; matmul {f.matmul:.3f}, attention "
                  f"{f.attention:.3f}, memory {f.memory:.3f}, host {f.kernel_us:.1f} us/kernel")
    console.print(f"median |error| {100 * result.median_error_before:.1f}% before, "
                  f"{100 * result.median_error_after:.1f}% after (in sample: the same runs)")
    console.print(f"stored in {path}" if path else "not stored (--dry-run)")


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)
