"""The HTML report: offline, small, escaped, and carrying the report's own numbers."""

from __future__ import annotations

import json
import re
import shlex
from html.parser import HTMLParser

import pytest

import vramplan
from vramplan.engines.memory_report import CATEGORIES, CATEGORY_HELP, MemoryReport, ModuleUsage
from vramplan.job import Job, Parallel, Peft
from vramplan.units import GiB, MiB
from vramplan.views import charts
from vramplan.views.command import FLAGS, cli_command, job_yaml, settings_without_flag
from vramplan.views.html import (
    Section,
    compare_html,
    page_html,
    report_html,
    search_html,
    sweep_html,
    table_html,
)

pytest.importorskip("matplotlib")


class _Links(HTMLParser):
    """Every src/href attribute and every tag name of a page."""

    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.links += [v for k, v in attrs if k.split(":")[-1] in ("src", "href") and v]


def _links(page: str) -> _Links:
    parser = _Links()
    parser.feed(page)
    return parser


def assert_offline(page: str) -> None:
    parsed = _links(page)
    remote = [u for u in parsed.links if re.match(r"\s*(https?:)?//", u, re.I)]
    assert remote == []
    assert not parsed.tags & {"script", "link", "iframe", "img"}  # nothing fetched, no JS
    assert "@import" not in page and "url(http" not in page


@pytest.fixture(scope="module")
def formula_report() -> MemoryReport:
    return vramplan.estimate(Job(model="gpt2", batch_size=2, seq_len=128))


def _trace_like(events: int = 2000) -> MemoryReport:
    """A report shaped like the trace's (timeline, top holders), built without torch."""
    base = vramplan.estimate(Job(model="gpt2", batch_size=1, seq_len=64))
    timeline = [(f"{('forward', 'backward', 'optimizer')[3 * i // events]}:op{i}",
                 GiB + i * MiB) for i in range(events)]
    return base.model_copy(update={
        "engine": "trace", "timeline": timeline,
        "top_modules": [ModuleUsage(name="transformer.h.0.attn", bytes=123 * MiB,
                                    category="activations")]})


def test_report_is_offline_small_and_scriptless(formula_report):
    page = report_html(formula_report, command="vramplan estimate gpt2 --batch-size 2")
    assert_offline(page)
    assert len(page.encode()) < 2 * 1024**2
    assert page.startswith("<!DOCTYPE html>")


def test_report_carries_the_numbers(formula_report):
    r = formula_report
    page = report_html(r)
    # every category in GiB to 3 decimals, as the memory table writes them
    for category in CATEGORIES:
        assert f"{r.categories[category] / GiB:,.3f}" in page
    assert f"{r.device_total / GiB:,.2f} GiB" in page  # the headline figure
    for fit in r.fits:
        assert f">{fit.gpu}<" in page
        assert f"{fit.headroom_bytes / GiB:,.2f}" in page
    l4 = vramplan.hardware.get_gpu("L4")
    assert f"{l4.price_per_hour:.2f}" in page
    # the hover text of the stacked bar explains each category shown
    for category in ("weights", "optimizer_states"):
        assert f"<title>{charts.label(category)}: " in page
        assert CATEGORY_HELP[category] in page
    fitting = sum(f.fits for f in r.fits)  # all but the GPUs without bf16 (T4, V100s)
    assert 0 < fitting < len(r.fits) and f"({fitting} of {len(r.fits)} GPUs)" in page


def test_trace_report_has_timeline_and_holders_under_2mb():
    report = _trace_like()
    page = report_html(report)
    assert_offline(page)
    assert len(page.encode()) < 2 * 1024**2
    assert "Memory over the step" in page and "transformer.h.0.attn" in page
    assert f"{123 * MiB / GiB:,.3f}" in page  # the holder's size in the page's unit
    # one phase marker per phase, with the event where it starts as hover text
    assert page.count("<title>forward starts at event 0") == 1
    # the phase of event i is 3i // 2000: backward from i = 667 (2001 // 2000 = 1), optimizer
    # from i = 1334 (4002 // 2000 = 2)
    assert "<title>backward starts at event 667" in page
    assert "<title>optimizer starts at event 1334" in page
    assert f"<title>peak {(GiB + 1999 * MiB) / GiB:,.3f} GiB at optimizer:op1999" in page


def test_user_strings_are_escaped(formula_report):
    evil = "<script>alert(1)</script>"
    report = formula_report.model_copy(update={
        "model_name": evil, "notes": ['<img src="http://x/y.png">'],
        "job": formula_report.job.model_copy(update={"model": evil})})
    page = report_html(report, command=f"vramplan estimate '{evil}'")
    assert "<script>" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert_offline(page)


def test_sweep_heatmap_with_boundary_per_gpu():
    job = Job(model="gpt2")
    rows = vramplan.sweep(job, vramplan.estimate, [1, 4, 16], [128, 1024])
    limits = {"L4": vramplan.hardware.get_gpu("L4").usable_bytes, "tiny": 5 * GiB}
    page = sweep_html(rows, job=job.model_dump(mode="json"), limits=limits)
    assert_offline(page)
    assert "<title>L4: points left of / below this line fit" in page
    assert "<title>tiny: points left of / below" in page
    for row in rows:
        assert f"{row['device_total'] / GiB:,.3f}" in page
        fits_tiny = "yes" if row["device_total"] <= 5 * GiB else "no"
        assert f"<title>batch {row['batch_size']} x seq {row['seq_len']}: " in page
        assert fits_tiny in page


def test_boundary_staircase():
    # row 0: cells 0-1 fit; row 1: only cell 0 fits -> edges at x = 1.5 and 0.5
    assert charts._boundary([[True, True, False], [True, False, False]]) == (
        [1.5, 1.5, 0.5, 0.5], [-0.5, 0.5, 0.5, 1.5])
    assert charts._boundary([[False, False]]) == ([], [])


def test_compare_shows_errors_against_the_reference(formula_report):
    measured = formula_report.model_copy(update={
        "engine": "measure",
        "categories": {**formula_report.categories,
                       "weights": formula_report.categories["weights"] // 2}})
    page = compare_html({"formula": formula_report, "measure": measured})
    assert_offline(page)
    # formula weights are twice the measured ones: +100.0 %
    assert "+100.0%" in page
    failed = compare_html({"formula": formula_report, "measure": "out of memory: 2 GiB"})
    assert "out of memory: 2 GiB" in failed


def test_search_page():
    job = Job(model="gpt2", seq_len=512, gpu="L4")
    result = vramplan.max_batch_size(job, vramplan.estimate,
                                     vramplan.hardware.get_gpu("L4").usable_bytes)
    page = search_html(result.to_dict(), job=job.model_dump(mode="json"))
    assert_offline(page)
    assert f"Largest batch size that fits: <b>{result.best}</b>" in page


def test_generic_sections_escape_titles_and_cells():
    page = page_html("a <b>", [Section("s & t", table_html(["x<"], [["<i>"]]), "id\"")])
    assert "a &lt;b&gt;" in page and "s &amp; t" in page and "&lt;i&gt;" in page
    assert 'id="id&quot;"' in page


def test_figures_export_png_and_svg(formula_report, tmp_path):
    written = charts.save_report_figures(formula_report, tmp_path / "m.png")
    assert [p.name for p in written] == ["m.png", "m-fit.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = charts.save_report_figures(_trace_like(50), tmp_path / "t.svg")
    assert [p.name for p in svg] == ["t.svg", "t-fit.svg", "t-timeline.svg"]
    assert "<svg" in svg[2].read_text()
    with pytest.raises(vramplan.VramplanError, match=r"\.png, \.svg or \.pdf"):
        charts.save_figure(charts.breakdown_figure(formula_report)[0], tmp_path / "x.gif")


# --- the command that reproduces a job -------------------------------------------------------


def test_flag_table_matches_the_cli():
    from vramplan.cli.options import _JOB_FLAGS

    short = {"tensor_parallel": "--tp", "context_parallel": "--cp",
             "pipeline_parallel": "--pp", "pipeline_schedule": "--pp-schedule"}
    assert {path: short.get(name, f"--{name.replace('_', '-')}")
            for name, (path, _, _) in _JOB_FLAGS.items()} == FLAGS


JOBS = [
    Job(model="gpt2"),
    Job(model="llama-3.2-1b", batch_size=4, seq_len=1024, grad_accum=2, precision="fp32",
        checkpointing="full", gpu="L4", loss="chunked"),
    Job(model="llama-3.2-1b", peft=Peft(method="qlora", rank=8, alpha=16,
                                        target_modules=("q_proj", "v_proj")),
        parallel=Parallel(strategy="fsdp", num_gpus=4), activation_offload=True,
        runtime={"cuda_context_bytes": 1024**3, "allocator_overhead": 0.1}),
]


@pytest.mark.parametrize("job", JOBS, ids=lambda j: j.model)
def test_cli_command_rebuilds_the_same_job(job, run_cli):
    command = cli_command(job)
    words = shlex.split(command)
    assert words[:2] == ["vramplan", "estimate"]
    code, out, err = run_cli(*words[1:], "--json")
    assert code in (0, 1), err  # 1: the job does not fit the --gpu asked for
    assert json.loads(out)["job"] == job.model_dump(mode="json")
    assert settings_without_flag(job) == []


def test_job_yaml_and_settings_without_flag(tmp_path, run_cli):
    job = Job(model="gpt2", batch_size=3, peft=Peft(dropout=0.2, target_modules=("c_attn",)),
              parallel=Parallel(strategy="hybrid-shard", num_gpus=16, gpus_per_node=4))
    # --lora-targets is a flag; dropout and gpus_per_node go through --set
    assert settings_without_flag(job) == ["parallel.gpus_per_node", "peft.dropout"]
    command = cli_command(job)
    assert "--set parallel.gpus_per_node=4" in command and "--set peft.dropout=0.2" in command
    code, out, err = run_cli(*shlex.split(command)[1:], "--json")
    assert code == 0, err
    assert json.loads(out)["job"] == job.model_dump(mode="json")
    path = tmp_path / "job.yaml"
    path.write_text(job_yaml(job))
    code, out, err = run_cli("estimate", "--job", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["job"] == job.model_dump(mode="json")


# --- plans and performance -------------------------------------------------------------------


def test_plan_page_has_the_picks_the_front_and_every_candidate():
    from vramplan.planning.planner import plan
    from vramplan.views.html import plan_html

    job = Job(model="llama-3.2-1b", seq_len=1024)
    result = plan(job, tokens=10**9, gpus=["L4", "A100-80GB", "H100-SXM"], max_gpus=8)
    page = plan_html(result, job=job, command="vramplan plan llama-3.2-1b --tokens 1B")
    assert_offline(page)
    assert len(page.encode()) < 2 * 1024**2
    for choice in (result.cheapest, result.fastest, result.recommended):
        assert f"<b>{choice.label}</b>: {choice.candidate.num_gpus} x " in page
    # one hover point per candidate, with its flags
    for n, candidate in enumerate(result.candidates):
        assert f"{candidate.num_gpus} x {candidate.gpu}" in page
        assert f'<g id="vp-plan-{n}"' in page
    assert "Pareto front" in page


def test_performance_section_when_the_report_has_one():
    from vramplan.planning.performance import performance_for

    job = Job(model="llama-3.2-1b", seq_len=1024, gpu="L4")
    report = vramplan.estimate(job)
    report = report.model_copy(update={"performance": performance_for(job, "L4",
                                                                      tokens=10**8)})
    page = report_html(report)
    from vramplan.views.plan_view import duration, money
    assert "Time and cost on L4" in page
    assert duration(report.performance.training_time_s) in page
    assert money(report.performance.cost_usd) in page
    # the factors' source and every assumption the terminal prints beside the numbers
    from html import escape
    assert f"factors: {escape(report.performance.factors)}" in page
    assert report.performance.notes  # an L4 at 1024 tokens: the attention-shape note at least
    assert all(f"<li>{escape(n)}</li>" in page for n in report.performance.notes)
