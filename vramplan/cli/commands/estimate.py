"""`vramplan estimate`: peak memory of one training step, by category, and where it fits.

    vramplan estimate llama-3.1-8b -b 4 -s 2048 --peft qlora --gpu L4
    vramplan estimate --job job.yaml --json
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from vramplan.cli.options import (
    EXIT_DOES_NOT_FIT,
    AsJson,
    EngineName,
    HtmlOut,
    MarginOpt,
    Out,
    check_writable,
    config_notes,
    console,
    job_command,
    json_text,
    last_config,
    print_json,
    progress,
    require_charts,
    write_html,
    write_or_print,
)
from vramplan.engines.memory_report import MemoryReport
from vramplan.fit import SAFETY_MARGIN
from vramplan.job import Job


@job_command
def estimate(
    job: Job,
    engine: EngineName = "formula",
    as_json: AsJson = False,
    out: Out = None,
    unit: Annotated[Literal["GiB", "GB"], typer.Option(help="GiB (binary) or GB (decimal)")]
    = "GiB",
    time_limit: Annotated[float, typer.Option(
        min=0.1, help="trace: stop after this many seconds")] = 300.0,
    html: HtmlOut = None,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", help="write the figures: PATH (.png, .svg or .pdf) gets the memory by "
        "phase; PATH-fit and PATH-timeline (trace) go beside it")] = None,
    tokens: Annotated[Optional[str], typer.Option(
        help="with --gpu: tokens to train on (e.g. 2B) for time and cost")] = None,
    samples: Annotated[Optional[str], typer.Option(
        help="with --gpu: samples to train on")] = None,
    epochs: Annotated[Optional[float], typer.Option(
        help="with --gpu: passes over --dataset-samples")] = None,
    dataset_samples: Annotated[Optional[str], typer.Option(
        help="samples in one epoch")] = None,
    price_per_hour: Annotated[Optional[float], typer.Option(
        help="USD per GPU-hour (default: the catalog's)")] = None,
    sort: Annotated[Optional[str], typer.Option(
        help="without --gpu: add step time and cost per GPU type, sorted by cost, time or "
             "headroom")] = None,
    margin: MarginOpt = SAFETY_MARGIN,
) -> None:
    """Peak GPU memory of one training step, by category, and where it fits.

    Exit code 1 when the job does not fit the --gpu asked for.

    Example: vramplan estimate llama-3.1-8b -b 4 -s 2048 --peft qlora --gpu L4
    """
    from vramplan.planning.amount import parse_count
    from vramplan.planning.estimate import compose

    check_writable(out, html, plot)
    require_charts(html, plot)
    with progress(f"{engine} engine", quiet=as_json or engine == "formula"):
        # memory, fit, time and cost on --gpu, and fixes when it does not fit: the one
        # estimate the API and the web app give too
        report = compose(
            job, engine=engine, time_limit_s=time_limit, margin=margin,
            tokens=parse_count(tokens) if tokens else None,
            samples=parse_count(samples, "samples") if samples else None, epochs=epochs,
            dataset_samples=parse_count(dataset_samples, "dataset samples")
            if dataset_samples else None, price_per_hour=price_per_hour)
    if config_notes():  # what the framework config left out or did not understand
        report = report.model_copy(update={"notes": [*config_notes(), *report.notes]})
    show(report, job, as_json=as_json, unit=unit)
    if not job.gpu and (sort or tokens or samples or epochs) and not as_json:
        from vramplan.planning.amount import TrainingAmount
        from vramplan.planning.performance import per_gpu
        from vramplan.views.plan_view import print_per_gpu

        amount = TrainingAmount(
            tokens=parse_count(tokens) if tokens else None,
            samples=parse_count(samples, "samples") if samples else None, epochs=epochs,
            dataset_samples=parse_count(dataset_samples, "dataset samples")
            if dataset_samples else None, price_per_hour=price_per_hour)
        print_per_gpu(per_gpu(job, report.fits, amount, sort or "time"), console)
    if out:
        write_or_print(out, json_text(report.to_json_dict()))
    write_views(report, job, html=html, plot=plot,
                extra=() if engine == "formula" else ("--engine", engine))
    exit_for_fit(report, job)


def write_views(report: MemoryReport, job: Job, *, html: Path | None, plot: Path | None,
                command: str = "estimate", extra: tuple[str, ...] = ()) -> None:
    """--html: the self-contained report; --plot: its figures as image files."""
    if html:
        from vramplan.views.command import cli_command
        from vramplan.views.html import report_html

        write_html(html, report_html(report, command=cli_command(job, command, extra)))
    if plot:
        from vramplan.views.charts import save_report_figures

        save_report_figures(report, plot)


def show(report: MemoryReport, job: Job, *, as_json: bool, unit: str = "GiB") -> None:
    if as_json:
        print_json(report.to_json_dict())
        return
    from vramplan.views.terminal import print_report

    print_report(report, console, unit=unit, highlight_gpu=job.gpu)
    if report.performance is not None:
        from vramplan.views.plan_view import print_performance

        print_performance(report.performance, console)
    if report.to_fit:
        console.print(f"\nTo make it fit on {job.gpu}:")
        read = last_config()
        for fix in report.to_fit:
            maths = " (changes the maths of training)" if fix.changes_maths else ""
            console.print(f"  {fix.flags}: {fix.summary}{maths}", soft_wrap=True)
            if read is not None:  # the same fix in the user's own file
                from vramplan.frameworks.configs.write import fix_in_config

                line = fix_in_config(read, job, fix.job)
                console.print(f"    {read.format}: {line or 'no key in the file for this'}",
                              soft_wrap=True)


def exit_for_fit(report: MemoryReport, job: Job) -> None:
    """Exit code 1 when a GPU was named and the job does not fit it."""
    if job.gpu and report.fits and not any(f.fits for f in report.fits):
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
