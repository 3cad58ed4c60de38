"""`vramplan check`: a CI gate. One line: it fits, or it does not by X GiB and the top fix
in the config's own format; exit 0 fits, 1 does not fit, 2 bad input.

    vramplan check --config recipes/1B_lora_single_device.yaml --gpu L4 --margin 0.1
"""

from __future__ import annotations

from typing import Annotated

import typer

from vramplan.cli.options import EXIT_DOES_NOT_FIT, console, job_command
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
) -> None:
    """One line: fits, or does not fit by X GiB with the top fix; exit 0 / 1 / 2.

    Example: vramplan check --config 1B_lora_single_device.yaml --gpu L4 --margin 0.1
    """
    from vramplan.engines.registry import get_engine
    from vramplan.hardware import get_gpu

    if not job.gpu:
        raise JobError("check needs the GPU to check against: --gpu L4 (vramplan gpus lists "
                       "them)")
    gpu = get_gpu(job.gpu)
    fit = get_engine("formula").run(job, gpus=[gpu]).fits[0]
    allowed = (1 - margin) * fit.usable_bytes
    if fit.required_bytes <= allowed:
        console.print(f"fits on {job.gpu}: {fit.required_bytes / GiB:.1f} GiB of "
                      f"{allowed / GiB:.1f} GiB (usable less {margin:.0%} margin)",
                      soft_wrap=True)
        return
    console.print(f"does not fit on {job.gpu} by {(fit.required_bytes - allowed) / GiB:.1f} "
                  f"GiB ({fit.required_bytes / GiB:.1f} GiB of {allowed / GiB:.1f} GiB); "
                  f"top fix: {top_fix(job, gpu, margin)}", soft_wrap=True)
    raise typer.Exit(EXIT_DOES_NOT_FIT)


def top_fix(job: Job, gpu, margin: float) -> str:
    """Make-it-fit's first fix, in the config's own words when the job came from one."""
    from vramplan.cli.options import last_config
    from vramplan.planning.make_fit import make_it_fit
    from vramplan.planning.techniques import ALLOW_NAMES

    fixes = make_it_fit(job, gpu, margin=margin, allow=ALLOW_NAMES, limit=10)
    if not fixes:
        return "none found (a bigger GPU: vramplan plan)"
    read = last_config()
    if read is None:
        return f"{fixes[0].flags} ({fixes[0].summary})"
    from vramplan.frameworks.configs.write import config_changes, override_line

    # make-it-fit's order (maths kept, then fastest), first the fixes the file can express
    written = [(fix, *config_changes(read, job, fix.job)) for fix in fixes]
    fix, changes, missing = sorted(written, key=lambda w: bool(w[2]))[0]
    if missing:
        return f"{fix.flags} ({fix.summary}; not expressible in the {read.format} file)"
    return f"{override_line(read, changes)} ({fix.summary})"


def register(app: typer.Typer) -> None:
    app.command("check")(check)
