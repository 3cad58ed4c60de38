"""`vramplan check`: a CI gate. One line: it fits, or it does not by X GiB and the top fix
in the config's own format; exit 0 fits, 1 does not fit, 2 bad input. With --patch the
fixed copy of the file is written, with --diff the change is printed as a unified diff.

    vramplan check --config recipes/1B_lora_single_device.yaml --gpu L4 --margin 0.1
    vramplan check --config train.toml --gpu H100-SXM --patch fixed.toml -- --training.seq_len=8192
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from vramplan.cli.options import (
    EXIT_DOES_NOT_FIT,
    check_writable,
    console,
    job_command,
    last_config,
    write_or_print,
)
from vramplan.engines.runtime import SAFETY_MARGIN
from vramplan.errors import JobError
from vramplan.job import Job

GiB = 2**30


@job_command
def check(
    job: Job,
    margin: Annotated[float, typer.Option(
        min=0.0, max=0.9, help="safety margin: it fits when it needs at most usable x "
        "(1 - margin)")] = SAFETY_MARGIN,
    patch: Annotated[Optional[Path], typer.Option(
        "--patch", help="with --config: write the file with the top fix made here")] = None,
    diff: Annotated[bool, typer.Option(
        "--diff", help="with --config: print the top fix as a unified diff of the file")]
    = False,
) -> None:
    """One line: fits, or does not fit by X GiB with the top fix; exit 0 / 1 / 2.

    Example: vramplan check --config 1B_lora_single_device.yaml --gpu L4 --margin 0.1
    """
    from vramplan.engines.registry import get_engine
    from vramplan.hardware import get_gpu

    if not job.gpu:
        raise JobError("check needs the GPU to check against: --gpu L4 (vramplan gpus lists "
                       "them)")
    read = last_config()
    if (patch or diff) and read is None:
        raise JobError("--patch and --diff change a framework config: give it with --config")
    check_writable(patch)
    gpu = get_gpu(job.gpu)
    fit = get_engine("formula").run(job, gpus=[gpu]).fits[0]
    allowed = (1 - margin) * fit.usable_bytes
    if fit.required_bytes <= allowed:
        console.print(f"fits on {job.gpu}: {fit.required_bytes / GiB:.1f} GiB of "
                      f"{allowed / GiB:.1f} GiB (usable less {margin:.0%} margin)",
                      soft_wrap=True)
        return
    fix, changes, text = top_fix(job, gpu, margin, read)
    console.print(f"does not fit on {job.gpu} by {(fit.required_bytes - allowed) / GiB:.1f} "
                  f"GiB ({fit.required_bytes / GiB:.1f} GiB of {allowed / GiB:.1f} GiB); "
                  f"top fix: {text}", soft_wrap=True)
    if changes and (patch or diff):
        from vramplan.frameworks.configs.write import patched_text, unified_diff

        if diff:
            sys.stdout.write(unified_diff(read, changes))
        if patch:
            write_or_print(patch, patched_text(read, changes))
    raise typer.Exit(EXIT_DOES_NOT_FIT)


def top_fix(job: Job, gpu, margin: float, read) -> tuple[Any, dict | None, str]:
    """(fix, the file's changes or None, the fix in words): make-it-fit's first fix the
    config can express (its order: maths kept, then fastest), else its first fix."""
    from vramplan.planning.make_fit import make_it_fit
    from vramplan.planning.techniques import ALLOW_NAMES

    fixes = make_it_fit(job, gpu, margin=margin, allow=ALLOW_NAMES, limit=10)
    if not fixes:
        return None, None, "none found (a bigger GPU: vramplan plan)"
    if read is None:
        return fixes[0], None, f"{fixes[0].flags} ({fixes[0].summary})"
    from vramplan.frameworks.configs.write import config_changes, override_line

    for fix in fixes:
        changes, missing = config_changes(read, job, fix.job)
        if changes and not missing:
            return fix, changes, f"{override_line(read, changes)} ({fix.summary})"
    return fixes[0], None, (f"{fixes[0].flags} ({fixes[0].summary}; not expressible in the "
                            f"{read.format} file)")


def register(app: typer.Typer) -> None:
    app.command("check")(check)
