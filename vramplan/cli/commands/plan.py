"""`vramplan plan`: which GPU, how many, which techniques, how long, how much.

    vramplan plan llama-3.1-70b -s 2048 --tokens 10B
    vramplan plan llama-3.1-8b --tokens 2B --gpus L4,A100-80GB --allow lora,qlora --json
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from vramplan.cli.options import (
    EXIT_BAD_INPUT,
    EXIT_DOES_NOT_FIT,
    AsJson,
    HtmlOut,
    MarginOpt,
    Out,
    check_writable,
    console,
    job_command,
    json_text,
    print_json,
    require_charts,
    write_html,
    write_or_print,
)
from vramplan.errors import JobError
from vramplan.fit import SAFETY_MARGIN
from vramplan.job import Job
from vramplan.planning.options import DEFAULT_MAX_GPUS
from vramplan.planning.techniques import ALLOW_NAMES


@job_command
def plan(
    job: Job,
    tokens: Annotated[Optional[str], typer.Option(
        help="tokens to train on, e.g. 2B, 500M")] = None,
    samples: Annotated[Optional[str], typer.Option(help="samples to train on")] = None,
    epochs: Annotated[Optional[float], typer.Option(
        help="passes over a dataset of --dataset-samples")] = None,
    dataset_samples: Annotated[Optional[str], typer.Option(
        help="samples in one epoch")] = None,
    gpus: Annotated[Optional[str], typer.Option(
        help="comma-separated GPU types to consider (default: the whole catalog)")] = None,
    max_gpus: Annotated[int, typer.Option(help="most GPUs in one job")] = DEFAULT_MAX_GPUS,
    max_cost: Annotated[Optional[float], typer.Option(help="most USD to spend")] = None,
    deadline: Annotated[Optional[str], typer.Option(
        help="longest training time, e.g. 24h, 3d")] = None,
    allow: Annotated[Optional[str], typer.Option(
        help=f"changes to the maths of training you accept: {','.join(ALLOW_NAMES)},"
             "global-batch")]
    = None,
    global_batch: Annotated[Optional[int], typer.Option(
        help="samples per optimizer step every configuration keeps (default: the job's "
             "own, batch size x grad accum x data-parallel GPUs)")] = None,
    global_batch_tokens: Annotated[Optional[str], typer.Option(
        help="the global batch in tokens, e.g. 4M (rounded to whole samples)")] = None,
    price_per_hour: Annotated[Optional[float], typer.Option(
        help="USD per GPU-hour (default: the catalog's)")] = None,
    top: Annotated[int, typer.Option(help="rows to show")] = 10,
    margin: MarginOpt = SAFETY_MARGIN,
    as_json: AsJson = False,
    out: Out = None,
    html: HtmlOut = None,
) -> None:
    """Search GPU types, counts and techniques for the configurations that fit, and show
    the cost/time front with the cheapest, fastest and recommended one.

    Exit code 1 when nothing fits; 2 for bad input or a cost or deadline nobody meets.

    Example: vramplan plan llama-3.1-70b -s 2048 --tokens 10B --max-gpus 64
    """
    from vramplan.planning.amount import parse_count, parse_duration
    from vramplan.planning.options import plan_options, plan_words
    from vramplan.planning.planner import plan as make_plan

    check_writable(out, html)
    require_charts(html)
    if job.gpu:  # --gpu X on plan means "plan on X"; silently planning every GPU misleads
        if gpus and [g.strip() for g in gpus.split(",")] != [job.gpu]:
            raise JobError(f"plan takes the GPU types to consider as --gpus (a list); give "
                           f"either --gpu {job.gpu} or --gpus {gpus}, not both")
        gpus, job = job.gpu, job.with_changes(gpu=None)
    options = plan_options(
        tokens=parse_count(tokens) if tokens else None,
        samples=parse_count(samples, "samples") if samples else None, epochs=epochs,
        dataset_samples=parse_count(dataset_samples, "dataset samples")
        if dataset_samples else None,
        gpus=[g.strip() for g in gpus.split(",") if g.strip()] if gpus else None,
        max_gpus=max_gpus, max_cost=max_cost,
        deadline_s=parse_duration(deadline) if deadline else None,
        allow=[a.strip() for a in allow.split(",") if a.strip()] if allow else None,
        global_batch=global_batch,
        global_batch_tokens=parse_count(global_batch_tokens, "global batch tokens")
        if global_batch_tokens else None, top=top, margin=margin, price_per_hour=price_per_hour)
    result = make_plan(job, options)
    data = result.model_dump(mode="json")
    if html:
        from vramplan.views.command import cli_command
        from vramplan.views.html import plan_html

        words = plan_words(options)
        write_html(html, plan_html(result, job=job,
                                   command=cli_command(job, "plan", tuple(words))))
    if as_json:
        print_json(data)
    else:
        from vramplan.views.plan_view import print_plan

        print_plan(result, console)
        _print_in_config(result, job)
    if out:
        write_or_print(out, json_text(data))
    if result.status == "nothing-fits":
        raise typer.Exit(EXIT_DOES_NOT_FIT)
    if result.status == "constraints-unmet":  # the table says why; stderr says that it failed
        bounds = " and ".join(f for f, v in (("--max-cost", max_cost), ("--deadline", deadline))
                              if v is not None)
        sys.stderr.write(f"error: no configuration that fits meets {bounds}; closest: "
                         f"{result.closest_miss}\n")
        raise typer.Exit(EXIT_BAD_INPUT)


def _print_in_config(result, job: Job) -> None:
    """The picks as changes to the --config file, in its launcher's words."""
    from vramplan.cli.options import last_config

    read = last_config()
    picks = [c for c in (result.cheapest, result.fastest, result.recommended) if c]
    if read is None or not picks:
        return
    from vramplan.frameworks.configs.write import config_changes, override_line

    console.print(f"\nIn {read.path.name}:")
    for choice in picks:
        changes, missing = config_changes(read, job, choice.candidate.job)
        line = override_line(read, changes) if changes else "as it is"
        rest = f" (no key in the file for {', '.join(missing)})" if missing else ""
        console.print(f"  {choice.label} ({choice.candidate.num_gpus} x {choice.candidate.gpu}):"
                      f" {line}{rest}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
