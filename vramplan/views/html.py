"""Self-contained HTML reports: one offline file, no scripts, figures as inline SVG.

A page is a list of `Section`s (a title and escaped HTML). The builders below make the
sections of a MemoryReport, a sweep, a search and a comparison; other views (the planner)
add their own with `Section`, `table_html` and `figure_html`, and `page_html` joins them.

    >>> text = report_html(vramplan.estimate(job), command="vramplan estimate gpt2 -b 4")
    >>> write_html(text, "report.html")

Nothing on the page loads from the network, and it needs no JavaScript: hover text is
SVG <title> elements and the HTML `title` attribute. Every string that comes from the
user (model names, notes, commands) is escaped.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramplan.engines.memory_report import CATEGORIES, CATEGORY_HELP, MemoryReport
from vramplan.job import Job
from vramplan.units import format_count
from vramplan.views import charts

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;
background:#f6f7f9}
main{max-width:980px;margin:0 auto;padding:16px 20px 40px}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:17px;margin:0 0 8px}
.sub{color:#5b6475;margin:0 0 14px}
section{background:#fff;border:1px solid #dde1e8;border-radius:8px;padding:14px 16px;
margin:12px 0}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:4px 8px;border-bottom:1px solid #eceef2;text-align:left;vertical-align:top}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
tr.no td{color:#b3261e}tr.yes td:first-child{font-weight:600}
.kpis{display:flex;flex-wrap:wrap;gap:10px;margin:6px 0 4px}
.kpi{border:1px solid #dde1e8;border-radius:6px;padding:6px 12px;min-width:120px}
.kpi b{display:block;font-size:18px}.kpi span{color:#5b6475;font-size:12px}
pre{background:#f1f3f6;padding:8px 10px;border-radius:6px;overflow-x:auto;font-size:12px;
white-space:pre-wrap;word-break:break-all}
figure svg{width:100%;max-width:860px;height:auto}abbr{text-decoration:underline dotted}
ul.notes{margin:4px 0;padding-left:20px;color:#3a4252}
footer{color:#7a8294;font-size:12px;margin-top:18px}
"""


@dataclass(frozen=True)
class Section:
    """One block of a page: `body` is HTML the builder already escaped."""

    title: str
    body: str
    id: str = ""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def page_html(title: str, sections: Iterable[Section], *, subtitle: str = "") -> str:
    """A whole page: inline style, no script, no external resource."""
    blocks = "\n".join(
        f'<section{f" id={chr(34)}{esc(s.id)}{chr(34)}" if s.id else ""}>'
        f"<h2>{esc(s.title)}</h2>\n{s.body}</section>" for s in sections)
    sub = f'<p class="sub">{esc(subtitle)}</p>' if subtitle else ""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{esc(title)}</title><style>{_STYLE}</style></head>\n"
            f"<body><main><h1>{esc(title)}</h1>{sub}\n{blocks}\n"
            f"<footer>Made by vramplan; sizes in GiB/MiB are binary (1 GiB = 2^30 "
            f"bytes), GB decimal. This file needs no network and no JavaScript.</footer>"
            f"</main></body></html>\n")


def table_html(headers: Sequence[str], rows: Iterable[Sequence[Any]], *,
               numeric: Iterable[int] = (), row_class: Sequence[str] | None = None,
               titles: Sequence[str | None] | None = None) -> str:
    """An escaped table; `numeric` column indexes are right-aligned, `titles` give each
    row hover text."""
    numeric = set(numeric)
    head = "".join(f'<th class="n">{esc(h)}</th>' if i in numeric else f"<th>{esc(h)}</th>"
                   for i, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cls = f' class="{esc(row_class[r])}"' if row_class and row_class[r] else ""
        tip = f' title="{esc(titles[r])}"' if titles and titles[r] else ""
        cells = "".join(f'<td class="n">{esc(v)}</td>' if i in numeric else f"<td>{esc(v)}</td>"
                        for i, v in enumerate(row))
        body.append(f"<tr{cls}{tip}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def figure_html(figure_and_tips) -> str:
    """A (Figure, tips) pair from vramplan.views.charts as inline SVG."""
    fig, tips = figure_and_tips
    return f'<figure style="margin:8px 0">{charts.figure_svg(fig, tips)}</figure>'


def kpis_html(items: Iterable[tuple[str, str]]) -> str:
    return '<div class="kpis">' + "".join(
        f'<div class="kpi"><b>{esc(v)}</b><span>{esc(k)}</span></div>' for k, v in items
    ) + "</div>"


def write_html(text: str, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(text, encoding="utf-8")
    return path


# --- a MemoryReport ----------------------------------------------------------------------


def _flat(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            out += _flat(value, f"{prefix}{key}.")
        elif isinstance(value, (list, tuple)):
            out.append((prefix + key, ", ".join(str(v) for v in value)))
        else:
            out.append((prefix + key, "default" if value is None else value))
    return out


def job_section(job: Job | Mapping[str, Any], command: str | None = None) -> Section:
    """Every setting of the job, and the command that reproduces it."""
    rows = _flat(job.model_dump(mode="json") if isinstance(job, Job) else job)
    body = table_html(("setting", "value"), rows)
    if command:
        body = f"<p>Reproduce it with:</p><pre>{esc(command)}</pre>" + body
    return Section("The job", body, "job")


def memory_section(report: MemoryReport) -> Section:
    unit, size = charts.unit_for(report.device_total)
    total = report.device_total or 1
    per = " per GPU" if report.per_gpu_of > 1 else ""
    kpis = kpis_html([
        (f"peak allocated{per}", f"{report.peak_allocated / size:,.2f} {unit}"),
        (f"peak reserved{per}", f"{report.peak_reserved / size:,.2f} {unit}"),
        (f"device total{per} (nvidia-smi)", f"{report.device_total / size:,.2f} {unit}"),
        ("peak phase", report.peak_phase or "-"),
        ("parameters (trainable)",
         f"{format_count(report.params_total)} ({format_count(report.params_trainable)})"),
    ])
    rows = [(charts.label(c), f"{report.categories[c] / size:,.3f}",
             f"{100 * report.categories[c] / total:.1f}%", CATEGORY_HELP[c]) for c in CATEGORIES]
    rows += [("peak allocated", f"{report.peak_allocated / size:,.3f}", "",
              "torch.cuda.max_memory_allocated()"),
             ("peak reserved", f"{report.peak_reserved / size:,.3f}", "",
              "torch.cuda.max_memory_reserved()"),
             ("device total", f"{report.device_total / size:,.3f}", "", "what nvidia-smi shows")]
    phases = ""
    if report.phase_peaks:
        phases = "<p>Allocated at the peak of each phase: " + ", ".join(
            f"{esc(p)} {v / size:,.3f} {unit}" for p, v in report.phase_peaks.items()) + "</p>"
    body = (kpis + figure_html(charts.breakdown_figure(report)) + phases
            + table_html(("category", unit, "share", "what it is"), rows, numeric=(1, 2),
                         titles=[CATEGORY_HELP.get(c) for c in CATEGORIES] + [None] * 3))
    return Section(f"Where the memory goes ({report.engine} engine)", body, "memory")


def fit_section(report: MemoryReport) -> Section:
    fits = sorted(report.fits, key=lambda f: (f.usable_bytes, f.gpu))
    prices = charts.gpu_prices(f.gpu for f in fits)
    unit, size = charts.unit_for(*(f.usable_bytes for f in fits))
    rows = [(f.gpu, f"{f.usable_bytes / size:,.2f}", f"{f.required_bytes / size:,.2f}",
             f"{f.headroom_bytes / size:,.2f}", f"{100 * f.headroom_fraction:.0f}%",
             "yes" if f.fits else "no",
             f"{prices[f.gpu]:.2f}" if prices.get(f.gpu) else "-") for f in fits]
    body = (figure_html(charts.fit_figure(report, prices))
            + table_html(("GPU", f"usable {unit}", f"needs {unit}", f"headroom {unit}",
                          "headroom", "fits", "$/GPU-hour"), rows, numeric=(1, 2, 3, 4, 6),
                         row_class=["yes" if f.fits else "no" for f in fits])
            + "<p>Prices are on-demand USD per GPU-hour from the GPU catalog (each with its "
              "provider and date in <code>vramplan gpus</code>).</p>")
    fitting = sum(f.fits for f in fits)
    return Section(f"Does it fit? ({fitting} of {len(fits)} GPUs)", body, "fit")


def trace_section(report: MemoryReport) -> Section:
    unit, size = charts.unit_for(*(u.bytes for u in report.top_modules), report.peak_allocated)
    body = figure_html(charts.timeline_figure(report)) if report.timeline else ""
    if report.top_modules:
        body += "<p>Largest holders at the peak, by module and by op:</p>" + table_html(
            ("module or op", unit, "category"),
            [(u.name, f"{u.bytes / size:,.3f}", charts.label(u.category))
             for u in report.top_modules], numeric=(1,))
    return Section("Memory over the step", body, "timeline")


def notes_section(report: MemoryReport) -> Section:
    items = "".join(f"<li>{esc(n)}</li>" for n in report.notes)
    return Section("Notes", f'<ul class="notes">{items}</ul>', "notes")


def measured_section(report: MemoryReport) -> Section:
    measured = report.measured.model_dump(mode="json") if report.measured else {}
    rows = [(k, v) for k, v in measured.items()
            if not isinstance(v, (list, dict)) and v is not None]
    return Section("Measured", table_html(("figure", "value"), rows), "measured")


def performance_section(report: MemoryReport) -> Section:
    """Predicted step time, throughput and (with an amount of training) time and cost."""
    from vramplan.views.plan_view import cost_words, duration

    perf = report.performance
    kpis = kpis_html([
        ("step time", duration(perf.step_time_s) + (
            f" (80%: {duration(perf.step_time_range_s[0])}-"
            f"{duration(perf.step_time_range_s[1])})" if perf.step_time_range_s else "")),
        ("tokens/s (all GPUs)", f"{perf.tokens_per_s:,.0f}"),
        ("MFU", f"{100 * perf.mfu:.0f}%"),
        ("bound by", perf.bound),
        ("training time", duration(perf.training_time_s)),
        ("cost", cost_words(perf)),
    ])
    rows = [(p.phase, duration(p.time_s), p.per_step, p.bound) for p in perf.phases]
    body = kpis + table_html(("phase", "time", "x per step", "bound"), rows, numeric=(1, 2))
    body += (f"<p>{esc(perf.num_gpus)} x {esc(perf.gpu)}, {esc(perf.compute_dtype)} "
             f"{esc(perf.cores)}; predicted by the performance model "
             f"(vramplan/planning/performance.py); factors: {esc(perf.factors)}.</p>")
    if perf.notes:  # the assumptions the terminal prints beside the same numbers
        body += "<ul class='notes'>" + "".join(f"<li>{esc(n)}</li>" for n in perf.notes) + \
            "</ul>"
    return Section(f"Time and cost on {perf.gpu}", body, "performance")


def report_sections(report: MemoryReport, command: str | None = None) -> list[Section]:
    sections = [memory_section(report)]
    if getattr(report, "performance", None) is not None:
        sections.append(performance_section(report))
    if report.fits:
        sections.append(fit_section(report))
    if report.timeline or report.top_modules:
        sections.append(trace_section(report))
    if report.measured:
        sections.append(measured_section(report))
    sections.append(job_section(report.job, command))
    if report.notes:
        sections.append(notes_section(report))
    return sections


def report_html(report: MemoryReport, *, command: str | None = None) -> str:
    """One MemoryReport as a self-contained page."""
    return page_html(f"{report.model_name}: GPU memory of one training step",
                     report_sections(report, command),
                     subtitle=f"{report.engine} engine, report schema {report.schema_version}")


# --- sweeps, searches, comparisons -------------------------------------------------------


def sweep_section(rows: Sequence[Mapping[str, Any]], limits: Mapping[str, int] | None = None
                  ) -> Section:
    """Heatmap of batch x sequence length with a fit boundary per GPU, and the rows."""
    unit, size = charts.unit_for(*(r.get("device_total") for r in rows))
    limits = dict(limits or {})
    headers = ["batch", "seq len", f"peak allocated {unit}", f"device total {unit}"]
    headers += [f"fits {gpu}" for gpu in limits]
    table_rows = []
    for r in rows:
        total = r.get("device_total")
        cells = [r["batch_size"], r["seq_len"], _opt(r.get("peak_allocated"), size),
                 _opt(total, size)]
        cells += ["OOM" if total is None else ("yes" if total <= lim else "no")
                  for lim in limits.values()]
        table_rows.append(cells)
    body = (figure_html(charts.sweep_heatmap_figure(rows, limits))
            + table_html(headers, table_rows, numeric=(0, 1, 2, 3)))
    if limits:
        body += "<p>A point fits a GPU when its device total is at most " + ", ".join(
            f"{esc(g)} {v / size:,.2f} {unit}" for g, v in limits.items()) + ".</p>"
    return Section("Sweep: batch size x sequence length", body, "sweep")


def _opt(value: int | None, size: int) -> str:
    return "-" if value is None else f"{value / size:,.3f}"


def sweep_html(rows: Sequence[Mapping[str, Any]], *, job: Job | Mapping[str, Any],
               limits: Mapping[str, int] | None = None, engine: str = "formula",
               command: str | None = None) -> str:
    """A sweep's page: heatmap, rows and the job."""
    model = job.model if isinstance(job, Job) else job.get("model", "")
    return page_html(f"{model}: sweep ({engine} engine)",
                     [sweep_section(rows, limits), job_section(job, command)])


def search_section(result: Mapping[str, Any]) -> Section:
    """A SearchResult (its to_dict()) as the answer and its trials."""
    name = str(result["parameter"]).replace("_", " ")
    unit, size = charts.unit_for(result["budget_bytes"])
    if result.get("best") is not None:
        answer = f"Largest {name} that fits: <b>{esc(result['best'])}</b>"
        if result.get("capped"):
            answer += " (the maximum tried; more may fit)"
    else:
        answer = f"Does not fit even at the smallest {esc(name)}."
        if result.get("largest_category"):
            answer += f" {esc(charts.label(result['largest_category']))} fill most of it."
    body = f"<p>{answer}</p><p>Fits when the peak is at most {result['limit_bytes'] / size:,.2f}" \
           f" {unit} = budget {result['budget_bytes'] / size:,.2f} {unit} x (1 - " \
           f"{esc(result['margin'])} margin).</p>"
    body += table_html(("trial", name, f"peak {unit}", "fits"), [
        (i, t["value"], _opt(t["peak"], size), "yes" if t["fits"] else "no")
        for i, t in enumerate(result["trials"], 1)], numeric=(0, 1, 2))
    if result.get("suggestions"):
        body += "<p>What may help:</p><ul class='notes'>" + "".join(
            f"<li>{esc(s)}</li>" for s in result["suggestions"]) + "</ul>"
    return Section(f"Search: {name}", body, "search")


def search_html(result: Mapping[str, Any], *, job: Job | Mapping[str, Any],
                command: str | None = None) -> str:
    model = job.model if isinstance(job, Job) else job.get("model", "")
    return page_html(f"{model}: {str(result['parameter']).replace('_', ' ')} "
                     "search", [search_section(result), job_section(job, command)])


def compare_section(reports: Mapping[str, MemoryReport | str]) -> Section:
    """Engines side by side (vramplan.compare's rows); the last engine is the reference each
    error is measured against."""
    from vramplan.compare import comparison_rows

    ok = {n: r for n, r in reports.items() if isinstance(r, MemoryReport)}
    names = list(reports)
    reference = names[-1]
    unit, size = charts.unit_for(*(r.device_total for r in ok.values()))
    rows = [[charts.label(row["figure"])] + [_opt(row[n], size) for n in names]
            + [f"{100 * row[f'{n}_error']:+.1f}%" if row.get(f"{n}_error") is not None else "-"
               for n in names[:-1]]
            for row in comparison_rows(dict(reports))]
    headers = [unit, *names, *(f"{n} error" for n in names[:-1])]
    body = figure_html(charts.compare_figure(ok)) if reference in ok else ""
    body += table_html(headers, rows, numeric=range(1, len(headers)))
    body += f"<p>error = (engine - {esc(reference)}) / {esc(reference)}.</p>"
    failed = [(n, r) for n, r in reports.items() if not isinstance(r, MemoryReport)]
    if failed:
        body += "<ul class='notes'>" + "".join(
            f"<li>{esc(n)}: {esc(r)}</li>" for n, r in failed) + "</ul>"
    return Section("Predicted against measured", body, "compare")


def compare_html(reports: Mapping[str, MemoryReport | str], *, command: str | None = None
                 ) -> str:
    """Predicted (formula, trace) against measured, with errors, then each report."""
    ok = [r for r in reports.values() if isinstance(r, MemoryReport)]
    if not ok:
        return page_html("engines compared", [compare_section(reports)])
    first = ok[0]
    sections = [compare_section(reports)]
    for report in ok:
        if report.timeline or report.top_modules:
            sections.append(trace_section(report))
        if report.measured:
            sections.append(measured_section(report))
    sections.append(job_section(first.job, command))
    return page_html(f"{first.model_name}: engines compared", sections)


# --- plans -----------------------------------------------------------------------------------


def plan_section(plan) -> Section:
    """A vramplan.planning.planner.Plan: the picks with their reasons, cost against time with the
    Pareto front, the candidates, and what was ruled out."""
    from vramplan.views.plan_view import duration, money

    picks = [c for c in (plan.recommended, plan.cheapest, plan.fastest) if c is not None]
    body = "".join(f"<p><b>{esc(c.label)}</b>: {esc(c.candidate.num_gpus)} x "
                   f"{esc(c.candidate.gpu)} ({esc(c.candidate.flags)}) - {esc(c.reason)}</p>"
                   for c in picks)
    if plan.status != "ok":
        body += f"<p><b>{esc(plan.status.replace('-', ' '))}</b>" + (
            f": closest miss {esc(plan.closest_miss)}" if plan.closest_miss else "") + "</p>"
    if plan.candidates:
        body += figure_html(charts.plan_figure(plan))
    front = {id(c) for c in plan.front}
    rows = [(f"{c.num_gpus} x {c.gpu}" + (" (owned)" if c.hardware == "owned" else ""),
             "yes" if id(c) in front or c in plan.front else "",
             ", ".join(c.changes) or "as asked", duration(c.step_time_s),
             f"{c.tokens_per_s:,.0f}", f"{100 * c.mfu:.0f}%", c.bound,
             duration(c.training_time_s), money(c.cost_usd), f"{100 * c.headroom_fraction:.0f}%")
            for c in plan.candidates]
    body += table_html(("GPUs", "on the front", "changes", "step", "tokens/s", "MFU", "bound",
                        "training time", "cost", "memory headroom"), rows,
                       numeric=(3, 4, 5, 7, 8, 9), titles=[c.flags for c in plan.candidates])
    if plan.ruled_out:
        body += "<p>Ruled out:</p><ul class='notes'>" + "".join(
            f"<li>{esc(r.gpu)}: {esc(r.reason)}</li>" for r in plan.ruled_out) + "</ul>"
    if plan.to_fit:
        body += "<p>What would make it fit:</p><ul class='notes'>" + "".join(
            f"<li>{esc(t)}</li>" for t in plan.to_fit) + "</ul>"
    if plan.notes:
        body += "<ul class='notes'>" + "".join(f"<li>{esc(n)}</li>" for n in plan.notes) + "</ul>"
    return Section(f"Plan: {len(plan.candidates)} configurations that fit "
                   f"({plan.configurations} checked)", body, "plan")


def plan_html(plan, *, job: Job | Mapping[str, Any], command: str | None = None) -> str:
    """A plan's page: the picks, cost against time, the candidates, and the job."""
    return page_html(f"{plan.model}: which GPUs, how long, how much",
                     [plan_section(plan), job_section(job, command)])
