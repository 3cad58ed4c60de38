"""The web page in a real browser: Playwright driving Debian's chromium (headless).

Skipped when playwright or /usr/bin/chromium is missing (.ci/run installs chromium; the
playwright package cannot download its own browser here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
playwright_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("VRAMPLAN_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
if not Path(CHROMIUM).exists():
    pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium)",
                allow_module_level=True)

TINY_LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1000, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def server():
    from vramplan.web.server import running_server

    with running_server() as url:
        yield SimpleNamespace(url=url)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1300, "height": 1000},
                                  accept_downloads=True)
    pg = context.new_page()
    pg.problems = []
    pg.on("console", lambda m: m.type == "error" and pg.problems.append(m.text))
    pg.on("pageerror", lambda e: pg.problems.append(str(e)))
    yield pg
    context.close()


def api(server, path: str, body: dict) -> dict:
    import httpx

    r = httpx.post(server.url + "api/v1/" + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


class Held:
    """Requests to `pattern` wait here until release() (with first_only, the first one only;
    the later ones go through), so a test can order the page's answers."""

    def __init__(self, page, pattern: str, first_only: bool = False):
        self.page, self.routes, self.released = page, [], False

        def hold(route):
            if self.released or (first_only and self.routes):
                route.continue_()
            else:
                self.routes.append(route)
        page.route(pattern, hold)

    def wait(self) -> None:
        while not self.routes:
            self.page.wait_for_timeout(20)

    def release(self) -> None:
        self.released = True
        for route in self.routes:
            route.continue_()


def shown_bytes(page, kpi: str = "kpi-peak_allocated") -> int | None:
    value = page.get_attribute(f"#{kpi}", "data-bytes")
    return int(value) if value else None


def wait_for_bytes(page, expected: int, kpi: str = "kpi-peak_allocated", seconds: float = 15):
    page.wait_for_function(
        "([id, v]) => document.getElementById(id).dataset.bytes === String(v)",
        arg=[kpi, expected], timeout=seconds * 1000)


def test_page_loads_and_shows_the_apis_numbers(page, server):
    from vramplan.engines.memory_report import CATEGORY_HELP

    requested = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(server.url)
    expected = api(server, "estimate", {"job": {"model": "llama-3.2-1b", "batch_size": 1,
                                                "grad_accum": 1, "parallel": {
                                                    "num_gpus": 1, "strategy": "none",
                                                    "tensor_parallel": 1}}})["report"]
    wait_for_bytes(page, expected["peak_allocated"])
    assert shown_bytes(page, "kpi-device_total") == expected["device_total"]
    assert page.inner_text("#kpi-device_total") == f"{expected['device_total'] / 2**30:.2f} GiB"
    # each category's words are the terminal's and the HTML report's (CATEGORY_HELP)
    shown = {row.get_attribute("data-name"): row.query_selector_all("td")[3].inner_text()
             for row in page.query_selector_all("#categories tbody tr")}
    assert shown == {name: CATEGORY_HELP[name] for name in expected["categories"]}
    page.wait_for_selector("#chart-breakdown svg")
    assert page.problems == []
    assert requested and all(u.startswith(server.url) for u in requested)  # nothing else


def test_changing_model_and_batch_updates_the_numbers(page, server):
    page.goto(server.url)
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    page.fill("#model", "qwen2.5-0.5b")
    page.fill("#batch_size", "4")
    page.fill("#seq_len", "512")
    expected = api(server, "estimate", {"job": {"model": "qwen2.5-0.5b", "batch_size": 4,
                                                "seq_len": 512}})["report"]
    wait_for_bytes(page, expected["peak_allocated"])
    assert shown_bytes(page, "kpi-peak_reserved") == expected["peak_reserved"]
    # the fit table has one row per GPU with the API's bytes
    rows = page.query_selector_all("#fit-table tbody tr")
    assert len(rows) == len(expected["fits"])
    required = {r.get_attribute("data-gpu"): int(r.get_attribute("data-required")) for r in rows}
    assert required == {f["gpu"]: f["required_bytes"] for f in expected["fits"]}
    # the URL now encodes the job: opening it shows the same job
    assert "batch_size=4" in page.url and "model=qwen2.5-0.5b" in page.url
    other = page.context.new_page()
    other.goto(page.url)
    wait_for_bytes(other, expected["peak_allocated"])
    assert other.input_value("#batch_size") == "4"
    assert page.problems == []


def test_modules_trained_beside_lora_reach_the_api_and_bad_ones_their_field(page, server):
    page.goto(server.url)
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    page.fill("#model", "qwen2.5-0.5b")
    page.fill("#seq_len", "256")
    page.select_option("#peft", "lora")
    page.fill("#modules_to_save", "embed_tokens, lm_head")
    expected = api(server, "estimate", {"job": {
        "model": "qwen2.5-0.5b", "seq_len": 256,
        "peft": {"method": "lora", "rank": 16, "modules_to_save": ["embed_tokens", "lm_head"]}}})
    wait_for_bytes(page, expected["report"]["peak_allocated"])
    page.select_option("#dora", "dora")  # DoRA on the same adapters
    dora = api(server, "estimate", {"job": {
        "model": "qwen2.5-0.5b", "seq_len": 256, "peft": {
            "method": "lora", "rank": 16, "modules_to_save": ["embed_tokens", "lm_head"],
            "dora": True}}})
    assert dora["report"]["peak_allocated"] > expected["report"]["peak_allocated"]
    wait_for_bytes(page, dora["report"]["peak_allocated"])
    assert "--dora" in page.inner_text("#cli-command")
    page.fill("#modules_to_save", "norm")
    page.wait_for_function(
        "() => document.getElementById('err-modules_to_save').textContent !== ''")
    assert "embed_tokens" in page.inner_text("#err-modules_to_save")


def test_bad_value_shows_a_message_beside_its_field(page, server):
    page.goto(server.url)
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    page.fill("#batch_size", "0")
    page.wait_for_function("() => document.getElementById('err-batch_size').textContent !== ''")
    assert "greater than or equal to 1" in page.inner_text("#err-batch_size")
    assert "bad" in page.get_attribute("#f-batch_size", "class")
    assert page.input_value("#batch_size") == "0"  # nothing the user typed is lost
    page.fill("#batch_size", "abc")
    page.wait_for_function("() => document.getElementById('err-batch_size').textContent"
                           ".includes('valid integer')")
    page.fill("#batch_size", "2")
    page.wait_for_function("() => document.getElementById('err-batch_size').textContent === ''")
    page.fill("#model", "no-such-model")
    page.wait_for_function("() => document.getElementById('err-model').textContent !== ''")
    assert "not a catalog model" in page.inner_text("#err-model")


def test_uploaded_config_works(page, server, tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY_LLAMA))
    page.goto(server.url)
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    page.fill("#seq_len", "128")
    page.set_input_files("#config-file", str(path))
    expected = api(server, "estimate", {"job": {"model": "tiny", "seq_len": 128},
                                        "config": TINY_LLAMA})["report"]
    wait_for_bytes(page, expected["peak_allocated"])
    assert "uploaded config (llama)" in page.inner_text("#config-state")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**TINY_LLAMA, "model_type": "custom_code"}))
    page.set_input_files("#config-file", str(bad))
    page.wait_for_function("() => document.getElementById('err-config').textContent !== ''")
    assert "is not supported" in page.inner_text("#err-config")


def test_a_too_large_upload_gets_the_servers_refusal_beside_its_field(page, server, tmp_path):
    """The page keeps no size limit of its own: the API's (MAX_CONFIG_BYTES) speaks."""
    path = tmp_path / "big.json"
    path.write_text(json.dumps({**TINY_LLAMA, "pad": "x" * (1024**2 + 1)}))
    page.goto(server.url)
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    page.set_input_files("#config-file", str(path))
    page.wait_for_function("() => document.getElementById('err-config').textContent !== ''")
    assert page.inner_text("#err-config") == "config.json is larger than 1 MiB"


def test_downloads(page, server):
    page.goto(server.url + "?model=gpt2&batch_size=2")
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    expected = api(server, "estimate", {"job": {"model": "gpt2", "batch_size": 2}})
    wait_for_bytes(page, expected["report"]["peak_allocated"])
    files = {}
    for button in ("dl-json", "dl-html", "dl-yaml", "dl-cli"):
        with page.expect_download() as info:
            page.click(f"#{button}")
        files[button] = Path(info.value.path()).read_text()
    assert json.loads(files["dl-json"]) == expected["report"]
    assert files["dl-html"].startswith("<!DOCTYPE html>") and "gpt2" in files["dl-html"]
    assert files["dl-yaml"] == "model: gpt2\nbatch_size: 2\n"
    assert files["dl-cli"] == "vramplan estimate gpt2 --batch-size 2\n"


def test_html_report_renders_offline_without_errors(page, server, tmp_path):
    response = api_html(server, {"job": {"model": "gpt2", "batch_size": 2}})
    path = tmp_path / "report.html"
    path.write_text(response)
    requested = []
    page.route("**/*", lambda route: (requested.append(route.request.url), route.continue_()))
    page.goto(path.as_uri())
    assert [u for u in requested if not u.startswith("file:")] == []
    assert page.query_selector_all("svg") and page.problems == []


def api_html(server, body: dict) -> str:
    import httpx

    return httpx.post(server.url + "api/v1/estimate?format=html", json=body, timeout=30).text


def test_search_and_sweep_views(page, server):
    page.goto(server.url + "?model=gpt2&seq_len=512&view=search")
    page.select_option("#search-gpu", "L4")
    page.click("#run-search")
    page.wait_for_selector("#search-trials tbody tr")
    expected = api(server, "search", {"job": {"model": "gpt2", "seq_len": 512, "gpu": "L4"}})
    assert page.get_attribute("#search-answer", "data-best") == str(expected["best"])
    page.click("button[data-view=sweep]")
    page.fill("#sweep-batches", "1,4")
    page.fill("#sweep-seqs", "128,256")
    page.fill("#sweep-gpus", "L4")
    page.click("#run-sweep")
    page.wait_for_selector("#chart-sweep svg")
    assert len(page.query_selector_all("#sweep-table tbody tr")) == 4
    assert page.problems == []
    # the link of the sweep view carries its grid and shows the same sweep when opened
    assert "sweep_batches=1%2C4" in page.url and "view=sweep" in page.url
    other = page.context.new_page()
    other.goto(page.url)
    other.wait_for_selector("#chart-sweep svg")
    assert len(other.query_selector_all("#sweep-table tbody tr")) == 4


@pytest.mark.torch
def test_trace_completes_and_shows_its_timeline(page, server):
    page.goto(server.url + "?model=gpt2&seq_len=64&view=trace")
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    page.click("#run-trace")
    page.wait_for_selector("#trace-result:not([hidden])", timeout=180_000)
    assert page.query_selector("#chart-timeline svg") is not None
    assert len(page.query_selector_all("#holders tbody tr")) > 0
    assert "done in" in page.inner_text("#trace-state")
    assert page.problems == []


def test_plan_view(page, server):
    page.goto(server.url + "?model=llama-3.2-1b&seq_len=1024&view=plan&plan_tokens=1B"
              "&plan_max_gpus=8&plan_gpus=L4%2CA100-80GB")
    page.wait_for_selector("#chart-plan svg", timeout=60_000)  # the link runs the plan
    expected = api(server, "plan", {"job": {"model": "llama-3.2-1b", "seq_len": 1024,
                                            "batch_size": 1, "grad_accum": 1, "parallel": {
                                                "num_gpus": 1, "strategy": "none",
                                                "tensor_parallel": 1}},
                                    "tokens": 10**9, "max_gpus": 8,
                                    "gpus": ["L4", "A100-80GB"]})["plan"]
    assert len(page.query_selector_all("#plan-table tbody tr")) == len(expected["candidates"])
    recommended = expected["recommended"]["candidate"]
    pick = page.inner_text("#plan-picks p[data-label=recommended]")
    assert f"{recommended['num_gpus']} x {recommended['gpu']}" in pick
    low, high = recommended["training_time_range_s"]  # the 80% interval, around the estimate
    assert low < recommended["training_time_s"] < high
    assert f"(80%: {low / 3600:.1f}–{high / 3600:.1f} h" in pick
    assert page.problems == []
    page.fill("#plan-max-gpus", "0")  # refused by the API: the message sits beside the field
    page.click("#run-plan")
    page.wait_for_function("() => document.getElementById('err-max_gpus').textContent !== ''")
    assert "greater than or equal to 1" in page.inner_text("#err-max_gpus")


def test_the_page_shows_the_one_estimates_verdict_time_cost_and_fixes(page, server):
    # the same estimate as the CLI and vramplan.estimate (tests/planning/test_one_estimate.py)
    import vramplan

    page.goto(server.url)
    page.wait_for_selector("#gpu option[value='L4']", state="attached")
    page.fill("#model", "llama-3.1-8b")
    page.fill("#seq_len", "")
    page.select_option("#gpu", "L4")
    job = vramplan.Job(model="llama-3.1-8b", gpu="L4")
    expected = vramplan.estimate(job)
    wait_for_bytes(page, expected.peak_allocated)
    page.wait_for_function("() => document.getElementById('fixes').children.length > 0")
    fit = expected.fits[0]
    assert page.inner_text("#verdict").startswith(
        f"Does not fit on L4: needs {fit.required_bytes / 2**30:.1f} of "
        f"{fit.usable_bytes / 2**30:.1f} GiB usable (5% kept free)")
    perf = expected.performance
    lo, hi = perf.step_time_range_s
    assert page.inner_text("#kpi-step_time") == (
        f"{perf.step_time_s:.3f} s (80%: {lo:.3f}–{hi:.3f} s)")
    assert page.inner_text("#kpi-cost") == f"${perf.cost_per_million_tokens_usd:.3f} / M tokens"
    shown = [li.inner_text() for li in page.query_selector_all("#fixes li")]
    assert [s.split(" — ")[0] for s in shown] == [f"To fit: {f.flags}" for f in expected.to_fit]
    # the time model's factors and assumptions, as the CLI prints them under its table
    assert page.inner_text("#perf-factors") == f"Time model factors: {perf.factors}"
    notes = [li.inner_text() for li in page.query_selector_all("#perf-notes li")]
    assert notes == perf.notes and notes
    assert page.problems == []


# --- issue 19, section 3 -----------------------------------------------------------------


def test_a_refused_job_leaves_no_stale_numbers(page, server):
    page.goto(server.url)
    page.wait_for_selector("#chart-breakdown svg")
    page.fill("#batch_size", "-4")
    page.wait_for_function("() => document.getElementById('err-batch_size').textContent !== ''")
    page.wait_for_function("() => document.getElementById('chart-breakdown').innerHTML === ''")
    assert page.inner_text("#kpi-peak_allocated") == "-" and shown_bytes(page) is None
    assert page.inner_text("#cli-command") == ""
    assert page.query_selector_all("#fit-table tbody tr") == []


def test_shared_links_keep_allow_and_time_limit_and_name_unknown_values(page, server):
    page.goto(server.url + "?precision=bogus&time_limit_s=30&view=plan&plan_gpus=L4"
              "&plan_max_gpus=1")
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    assert page.input_value("#precision") == "bf16-mixed"  # not blanked
    assert "precision=bogus" in page.inner_text("#link-state")
    assert page.input_value("#time_limit_s") == "30"
    page.check(".plan-allow[value=lora]")
    assert "plan_allow=lora" in page.url
    other = page.context.new_page()
    other.goto(page.url)
    other.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    assert other.is_checked(".plan-allow[value=lora]")
    assert not other.is_checked(".plan-allow[value=qlora]")


def test_fit_table_says_why_a_gpu_is_refused(page, server):
    page.goto(server.url + "?view=fit")
    page.wait_for_selector("#fit-table tbody tr[data-gpu=V100-16GB]")
    assert "no bf16" in page.inner_text("#fit-table tbody tr[data-gpu=V100-16GB]")


def test_a_bad_gpu_in_the_sweep_list_shows_beside_that_list(page, server):
    page.goto(server.url + "?view=sweep&sweep_gpus=L4%2CH9000")
    page.wait_for_function("() => document.getElementById('err-gpus').textContent"
                           ".includes('H9000')")
    assert page.inner_text("#err-gpu") == ""


def test_the_live_estimate_answering_late_keeps_the_sweeps_refusal(page, server):
    """CI once saw the page's own estimate answer after the sweep's refusal and wipe it: hold
    the estimate until the sweep has answered, then let it through."""
    estimate = Held(page, "**/api/v1/estimate")
    page.goto(server.url + "?view=sweep&sweep_gpus=L4%2CH9000")
    page.wait_for_function("() => document.getElementById('err-gpus').textContent"
                           ".includes('H9000')")
    estimate.wait()
    estimate.release()
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    assert "H9000" in page.inner_text("#err-gpus")
    assert "bad" in page.get_attribute("#f-gpus", "class")


def test_the_live_estimate_keeps_a_views_general_message_and_clears_its_own(page, server):
    page.goto(server.url)
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    says = page.evaluate("""() => {
        const view = {errors: [{field: "", message: "the view's refusal"}]};
        const own = {errors: [{field: "", message: "the estimate's refusal"}]};
        const general = () => document.getElementById("err-general").textContent;
        const form = document.getElementById("job-form");  // what the live estimate clears
        showErrors(view); clearErrors(form); const afterView = general();
        clearErrors(); showErrors(own, {}, "estimate"); clearErrors(form);
        return [afterView, general()];
    }""")
    assert says == ["the view's refusal ", ""]


def test_plan_never_plans_an_uploaded_configs_file_name(page, server, tmp_path):
    """The link's own plan (the default job) answers after the uploaded file's refusal: the
    page keeps the refusal (CI once saw the late answer fill the table)."""
    path = tmp_path / "gpt2.json"  # named like a catalog model
    path.write_text(json.dumps(TINY_LLAMA))
    plan = Held(page, "**/api/v1/plan", first_only=True)  # the plan the link starts
    page.goto(server.url + "?view=plan")
    plan.wait()
    page.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    default = page.get_attribute("#kpi-peak_allocated", "data-bytes")
    page.set_input_files("#config-file", str(path))
    page.wait_for_function("() => document.getElementById('config-state').textContent !== ''")
    page.wait_for_function(  # the uploaded model's estimate is on screen
        f"() => document.getElementById('kpi-peak_allocated').dataset.bytes !== '{default}'")
    page.click("#run-plan")
    page.wait_for_function("() => document.getElementById('err-general').textContent"
                           ".includes('catalog models only')")
    with page.expect_response("**/api/v1/plan"):
        plan.release()
    page.wait_for_timeout(300)  # time for the page to handle the late answer
    assert page.query_selector_all("#plan-table tbody tr") == []
    assert "catalog models only" in page.inner_text("#err-general")


def test_usable_at_390_px(browser, server):
    context = browser.new_context(viewport={"width": 390, "height": 844})
    pg = context.new_page()
    pg.goto(server.url)
    pg.wait_for_selector("#kpi-peak_allocated[data-bytes]", state="attached")
    width = pg.evaluate("() => document.documentElement.scrollWidth")
    form, main = (pg.eval_on_selector(s, "e => e.getBoundingClientRect().width")
                  for s in ("#job-form", "main"))
    context.close()
    assert width <= 392 and form > 300 and main > 300


def test_plan_allow_boxes_come_from_the_techniques_table_and_global_batch_is_sent(page, server):
    from vramplan.planning.options import ALLOW

    page.goto(server.url + "?model=llama-3.2-1b&view=plan&plan_max_gpus=8&plan_gpus=L4"
              "&plan_global_batch_tokens=4M&plan_allow=global-batch")
    page.wait_for_selector("#chart-plan svg", timeout=60_000)
    boxes = page.query_selector_all(".plan-allow")
    assert [b.get_attribute("value") for b in boxes] == list(ALLOW)
    assert [b.get_attribute("value") for b in boxes if b.is_checked()] == ["global-batch"]
    expected = api(server, "plan", {"job": {"model": "llama-3.2-1b"}, "tokens": 10**9,
                                    "max_gpus": 8, "gpus": ["L4"], "allow": ["global-batch"],
                                    "global_batch_tokens": 4_000_000})["plan"]
    rows = page.query_selector_all("#plan-table tbody tr")
    assert len(rows) == len(expected["candidates"]) > 0
    assert page.problems == []
    page.fill("#plan-global-batch-tokens", "-5")  # refused: the message sits beside the field
    page.click("#run-plan")
    page.wait_for_function(
        "() => document.getElementById('err-global_batch_tokens').textContent !== ''")


def _set_fields(page, values: dict[str, str]) -> None:
    """Set several fields in one JavaScript task, so that the page's debounced request only
    sees them all set: one at a time, a slow machine can send a job in between (8 GPUs
    before their strategy or pipeline is set) and get a 422 for it."""
    page.evaluate("""values => {
        for (const [id, value] of Object.entries(values)) {
            const el = document.getElementById(id);
            el.value = value;
            el.dispatchEvent(new Event("input", {bubbles: true}));
            el.dispatchEvent(new Event("change", {bubbles: true}));
        }
    }""", values)


def _llama_on_8_gpus(page, server, grad_accum: int, **fields: str) -> None:
    """The page, its selects filled from the API, with llama-3.2-1b on 8 GPUs (and `fields`,
    set with them)."""
    page.goto(server.url)
    page.wait_for_selector("#gpu option[value='H100-SXM']", state="attached")
    page.wait_for_selector("#pipeline_schedule option[value='gpipe']", state="attached")
    page.wait_for_selector("#strategy option[value='fsdp']", state="attached")
    _set_fields(page, {"model": "llama-3.2-1b", "num_gpus": "8",
                       "grad_accum": str(grad_accum), **fields})


def test_a_pipelined_job_on_the_page_is_the_cli_and_apis_job(page, server):
    """The page's pipeline fields reach the Job: the same numbers as vramplan.estimate and
    the CLI line that reproduces them (interleaved's chunks through --set)."""
    import vramplan

    _llama_on_8_gpus(page, server, grad_accum=8, pipeline_parallel="4", context_parallel="2")
    assert page.is_disabled("#pipeline_chunks")  # 1F1B runs one chunk per GPU
    page.select_option("#pipeline_schedule", "interleaved")
    page.fill("#pipeline_chunks", "4")
    page.select_option("#gpu", "H100-SXM")
    job = vramplan.Job(model="llama-3.2-1b", grad_accum=8, gpu="H100-SXM",
                       parallel={"num_gpus": 8, "pipeline_parallel": 4, "context_parallel": 2,
                                 "pipeline_schedule": "interleaved", "pipeline_chunks": 4})
    expected = vramplan.estimate(job)
    wait_for_bytes(page, expected.peak_allocated)
    assert shown_bytes(page, "kpi-device_total") == expected.device_total
    assert page.inner_text("#kpi-step_time").startswith(
        f"{expected.performance.step_time_s:.3f} s")
    line = page.inner_text("#cli-command")
    assert "--pp 4" in line and "--cp 2" in line and "--pp-schedule interleaved" in line
    assert "parallel.pipeline_chunks=4" in line
    # a shared link keeps the pipeline
    other = page.context.new_page()
    other.goto(page.url)
    wait_for_bytes(other, expected.peak_allocated)
    assert other.input_value("#pipeline_schedule") == "interleaved"
    assert page.problems == []
    # more chunks than blocks allow: the message stands beside the field it names
    page.fill("#pipeline_chunks", "64")
    page.wait_for_function("() => document.getElementById('err-pipeline_chunks').textContent"
                           ".includes('at most 4 chunks per GPU')")


def test_fsdp_kept_gathered_after_forward_on_the_page_is_the_apis(page, server):
    """The resharding select reaches parallel.reshard_after_forward (SHARD_GRAD_OP): the
    same bytes as vramplan.estimate and the CLI's --no-reshard-after-forward; it is off for
    the strategies that keep whole parameters (zero2 included)."""
    import vramplan

    _llama_on_8_gpus(page, server, grad_accum=1, strategy="zero2")
    page.select_option("#gpu", "H100-SXM")
    zero2 = vramplan.estimate(vramplan.Job(model="llama-3.2-1b", gpu="H100-SXM",
                                           parallel={"num_gpus": 8, "strategy": "zero2"}))
    wait_for_bytes(page, zero2.peak_allocated)
    assert page.is_disabled("#fsdp_reshard")
    page.select_option("#strategy", "fsdp")
    page.select_option("#fsdp_reshard", "keep")
    kept = vramplan.estimate(vramplan.Job(
        model="llama-3.2-1b", gpu="H100-SXM",
        parallel={"num_gpus": 8, "strategy": "fsdp", "reshard_after_forward": False}))
    wait_for_bytes(page, kept.peak_allocated)
    assert "--no-reshard-after-forward" in page.inner_text("#cli-command")
    page.select_option("#fsdp_reshard", "reshard")
    resharded = vramplan.estimate(vramplan.Job(
        model="llama-3.2-1b", gpu="H100-SXM", parallel={"num_gpus": 8, "strategy": "fsdp"}))
    assert resharded.peak_allocated < kept.peak_allocated
    wait_for_bytes(page, resharded.peak_allocated)
    assert page.problems == []


def test_fsdps_gradient_sync_on_the_page_is_the_apis(page, server):
    """The FSDP gradient-sync select reaches parallel.fsdp_no_sync: holding whole fp32
    gradients between micro-batches gives vramplan.estimate's bytes and the CLI's flag; it
    is off for strategies without FSDP."""
    import vramplan

    _llama_on_8_gpus(page, server, grad_accum=4, strategy="ddp")
    page.select_option("#gpu", "H100-SXM")
    ddp = vramplan.estimate(vramplan.Job(model="llama-3.2-1b", grad_accum=4, gpu="H100-SXM",
                                         parallel={"num_gpus": 8, "strategy": "ddp"}))
    wait_for_bytes(page, ddp.peak_allocated)
    assert page.is_disabled("#fsdp_sync")
    page.select_option("#strategy", "fsdp")
    page.select_option("#fsdp_sync", "last")
    job = vramplan.Job(model="llama-3.2-1b", grad_accum=4, gpu="H100-SXM",
                       parallel={"num_gpus": 8, "strategy": "fsdp", "fsdp_no_sync": True})
    held = vramplan.estimate(job)
    wait_for_bytes(page, held.peak_allocated)
    assert "--fsdp-no-sync" in page.inner_text("#cli-command")
    page.select_option("#fsdp_sync", "each")
    synced = vramplan.estimate(job.with_changes(parallel={**job.parallel.model_dump(),
                                                          "fsdp_no_sync": False}))
    assert synced.peak_allocated < held.peak_allocated
    wait_for_bytes(page, synced.peak_allocated)
    assert page.problems == []
