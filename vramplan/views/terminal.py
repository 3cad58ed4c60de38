"""Terminal views of reports and catalogs (rich). Callers pass the Console to print on."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vramplan.engines.memory_report import CATEGORIES, CATEGORY_HELP, MemoryReport
from vramplan.units import GB, GiB, format_count

_PHASE_ORDER = ("forward", "backward", "optimizer")


def _size(n: float, unit: str) -> str:
    return f"{n / (GiB if unit == 'GiB' else GB):,.2f}"


def job_summary(report: MemoryReport) -> str:
    """One line with the job's arithmetic, e.g. '4 batch x 2048 tokens x 2 accum x 8 GPUs'."""
    job = report.job
    par = job.parallel
    dp = par.data_parallel
    per_sample = report.tokens_per_step // max(1, job.batch_size * job.grad_accum * dp)
    what = f"{per_sample} tokens" if per_sample > 1 else "1 sample"
    line = (f"{job.batch_size} batch x {what} x {job.grad_accum} accum x {dp} data-parallel"
            f" = {report.tokens_per_step:,} {'tokens' if per_sample > 1 else 'samples'} per step")
    techniques = [job.precision, job.optimizer, f"attention {job.attention}"]
    if job.framework != "plain":
        techniques.insert(0, f"{job.framework} defaults")
    if job.checkpointing != "none":
        techniques.append(f"{job.checkpointing} checkpointing")
    if job.peft:
        dtype = f" {job.peft.adapter_dtype} adapters" if job.peft.adapter_dtype else ""
        dora = " DoRA" if job.peft.dora else ""
        techniques.append(f"{job.peft.method}{dora} r={job.peft.rank}{dtype}")
    if job.keep_grads_between_steps:
        techniques.append("gradients kept between steps")
    if par.strategy != "none":
        techniques.append(f"{par.strategy} over {par.num_gpus} GPUs")
    if par.tensor_parallel > 1:
        techniques.append(f"TP={par.tensor_parallel}")
    if par.context_parallel > 1:
        techniques.append(f"CP={par.context_parallel}")
    if job.loss.startswith("chunked"):
        techniques.append(f"{job.loss} loss")
    return line + "\n" + ", ".join(techniques)


def print_report(report: MemoryReport, console: Console, unit: str = "GiB",
                 highlight_gpu: str | None = None) -> None:
    console.print(f"[bold]{report.model_name}[/]: {format_count(report.params_total)} parameters, "
                  f"{format_count(report.params_trainable)} trainable  "
                  f"[dim]({report.engine} engine)[/]")
    console.print(job_summary(report))

    per = " per GPU" if report.per_gpu_of > 1 else ""
    table = Table(title=f"Memory at the peak ({report.peak_phase}){per}", title_justify="left")
    table.add_column("category")
    table.add_column(unit, justify="right")
    table.add_column("share", justify="right")
    table.add_column("what it is", style="dim")
    total = report.device_total or 1
    for name in CATEGORIES:
        value = report.categories[name]
        table.add_row(name.replace("_", " "), _size(value, unit), f"{100 * value / total:.1f}%",
                      CATEGORY_HELP[name])
    table.add_section()
    table.add_row("[bold]peak allocated[/]", f"[bold]{_size(report.peak_allocated, unit)}[/]", "",
                  "torch.cuda.max_memory_allocated()")
    table.add_row("peak reserved", _size(report.peak_reserved, unit), "",
                  "torch.cuda.max_memory_reserved()")
    table.add_row("[bold]device total[/]", f"[bold]{_size(report.device_total, unit)}[/]", "",
                  "what nvidia-smi shows")
    if report.unified_memory_bytes:
        table.add_row("paged (unified memory)", _size(report.unified_memory_bytes, unit), "",
                      "paged optimizer states, outside the allocator; page to the host if short")
    console.print(table)
    if report.phase_peaks:
        phases = ", ".join(f"{p} {_size(report.phase_peaks[p], unit)}" for p in _PHASE_ORDER
                           if p in report.phase_peaks)
        console.print(f"Peak allocated by phase ({unit}): {phases}")
    if report.top_modules:
        top = Table(title="Largest holders at the peak", title_justify="left")
        for col in ("module or op", unit, "category"):
            top.add_column(col, justify="right" if col == unit else "left")
        for usage in report.top_modules[:8]:
            top.add_row(usage.name, _size(usage.bytes, unit), usage.category.replace("_", " "))
        console.print(top)
    if report.fits:
        print_fits(report, console, unit, highlight_gpu)
    for note in report.notes:
        console.print(f"[dim]note:[/] {note}")


def print_fits(report: MemoryReport, console: Console, unit: str, highlight: str | None) -> None:
    margin = max((fit.margin for fit in report.fits), default=0.0)
    table = Table(title="Does it fit?", title_justify="left", caption=(
        f"fits: needs at most usable x (1 - {margin:.0%} safety margin)" if margin else None))
    for col, justify in (("GPU", "left"), (f"usable {unit}", "right"), (f"needs {unit}", "right"),
                         (f"headroom {unit}", "right"), ("headroom", "right"), ("fits", "center")):
        table.add_column(col, justify=justify)
    for fit in sorted(report.fits, key=lambda f: (f.usable_bytes, f.gpu)):
        mark = "[green]yes[/]" if fit.fits else "[red]no[/]"
        if not fit.supported:  # the GPU cannot run the job, whatever the memory
            mark = "[red]no: cannot run[/]"
        style = "bold" if highlight and fit.gpu.lower() == highlight.lower() else None
        table.add_row(fit.gpu, _size(fit.usable_bytes, unit), _size(fit.required_bytes, unit),
                      _size(fit.headroom_bytes, unit), f"{100 * fit.headroom_fraction:.0f}%",
                      mark, style=style)
    console.print(table)
    for problem in sorted({fit.problem for fit in report.fits if fit.problem}):
        console.print(f"[dim]cannot run:[/] {escape(problem)}")
