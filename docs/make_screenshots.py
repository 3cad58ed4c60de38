"""Screenshots of the web app's main views and of an HTML report, for the README.

    PYTHONPATH=. python docs/make_screenshots.py   # writes docs/web-*.png and docs/report-html.png

Needs the `web` extra, playwright and Debian's chromium (/usr/bin/chromium).
"""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import sync_playwright

from vramplan.web.server import running_server

HERE = Path(__file__).resolve().parent
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
JOB = "?model=llama-3.2-1b&batch_size=4&seq_len=2048&peft=qlora&gpu="


def main() -> None:
    with running_server() as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url + JOB)
        page.wait_for_selector("#chart-breakdown svg")
        page.screenshot(path=HERE / "web-memory.png")
        page.click("button[data-view=fit]")
        page.wait_for_selector("#chart-fit svg")
        page.screenshot(path=HERE / "web-fit.png")
        page.goto(url + "?model=gpt2&seq_len=256&view=trace")
        page.click("#run-trace")
        page.wait_for_selector("#trace-result:not([hidden])", timeout=300_000)
        page.locator("#view-trace").screenshot(path=HERE / "web-trace.png")
        page.goto(url + JOB + "&view=sweep")
        page.fill("#sweep-batches", "1,2,4,8,16,32")
        page.fill("#sweep-seqs", "512,1024,2048,4096")
        page.fill("#sweep-gpus", "L4,A100-40GB,H100-SXM")
        page.click("#run-sweep")
        page.wait_for_selector("#chart-sweep svg")
        page.locator("#view-sweep").screenshot(path=HERE / "web-sweep.png")
        page.goto(url + "?model=llama-3.1-8b&seq_len=2048&view=plan&plan_tokens=2B"
                  "&plan_max_gpus=16")
        page.wait_for_selector("#chart-plan svg", timeout=120_000)
        page.locator("#view-plan").screenshot(path=HERE / "web-plan.png")
        page.goto(url + JOB)
        page.wait_for_selector("#chart-breakdown svg")
        with page.expect_download() as download:
            page.click("#dl-html")
        report = Path(download.value.path())
        page.goto(report.as_uri())
        page.screenshot(path=HERE / "report-html.png")
        browser.close()


if __name__ == "__main__":
    main()
