"""--html and --plot on the commands, and `vramplan serve`."""

from __future__ import annotations

import json

import pytest

from vramplan.units import GiB

pytest.importorskip("matplotlib")

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 500, "max_position_embeddings": 256}


def _offline(page: str) -> bool:
    return "<script" not in page and 'src="http' not in page and 'href="http' not in page


def test_estimate_html_plot_and_json_stay_apart(run_cli, tmp_path):
    html, plot = tmp_path / "r.html", tmp_path / "m.svg"
    code, out, err = run_cli("estimate", "gpt2", "-b", "2", "--json", "--html", str(html),
                             "--plot", str(plot))
    assert code == 0, err
    report = json.loads(out)  # stdout is still only the JSON document
    page = html.read_text()
    assert _offline(page) and "vramplan estimate gpt2 --batch-size 2" in page
    assert f"{report['device_total'] / GiB:,.3f}" in page
    assert plot.read_text().lstrip().startswith("<?xml") or "<svg" in plot.read_text()
    assert (tmp_path / "m-fit.svg").exists()


def test_html_path_is_checked_before_running(run_cli, tmp_path):
    code, _, err = run_cli("estimate", "gpt2", "--html", str(tmp_path / "no" / "r.html"))
    assert code == 2 and "does not exist" in err


def test_search_and_sweep_html(run_cli, tmp_path):
    page = tmp_path / "s.html"
    code, out, err = run_cli("search", "batch-size", "gpt2", "-s", "512", "--gpu", "L4",
                             "--html", str(page), "--json")
    assert code == 0, err
    best = json.loads(out)["best"]
    assert f"Largest batch size that fits: <b>{best}</b>" in page.read_text()
    assert "vramplan search batch-size gpt2 --seq-len 512 --gpu L4" in page.read_text()
    sweep = tmp_path / "w.html"
    code, out, err = run_cli("sweep", "gpt2", "--batch-sizes", "1,8", "--seq-lens", "128,512",
                             "--gpu", "L4", "--html", str(sweep), "--json")
    assert code == 0, err
    text = sweep.read_text()
    assert _offline(text) and "<title>L4: points left of / below this line fit" in text
    assert "vramplan sweep gpt2 --gpu L4 --batch-sizes 1,8 --seq-lens 128,512" in text
    for row in json.loads(out):
        assert f"{row['device_total'] / GiB:,.3f}" in text


@pytest.mark.torch
def test_compare_and_measure_html(run_cli, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    page = tmp_path / "c.html"
    code, out, err = run_cli("compare", str(config), "-b", "2", "-s", "32", "--engines",
                             "formula,trace", "--html", str(page), "--json")
    assert code == 0, err
    rows = {r["figure"]: r for r in json.loads(out)["rows"]}
    error = rows["peak allocated"]["formula_error"]
    assert f"{100 * error:+.1f}%" in page.read_text()
    assert "Memory over the step" in page.read_text()  # the trace's timeline
    measured = tmp_path / "m.html"
    code, out, err = run_cli("measure", str(config), "-b", "2", "-s", "32", "--steps", "1",
                             "--warmup", "1", "--device", "cpu", "--html", str(measured),
                             "--json")
    assert code == 0, err
    assert "Measured" in measured.read_text() and _offline(measured.read_text())


def test_serve_prints_the_url_and_warns_off_localhost(run_cli, monkeypatch):
    pytest.importorskip("fastapi")
    calls = []
    monkeypatch.setattr("vramplan.web.server.serve", lambda *a, **k: calls.append((a, k)))
    code, out, err = run_cli("serve")
    assert code == 0, err
    assert "http://127.0.0.1:8000/" in out and "warning" not in out
    assert calls[-1] == (("127.0.0.1", 8000), {"max_queued_traces": 3})
    code, out, err = run_cli("serve", "--host", "0.0.0.0", "--port", "9000")
    assert "http://0.0.0.0:9000/" in out and "warning" in out and "not localhost" in out


def test_report_and_web_import_neither_torch_nor_each_other():
    # the HTML report needs matplotlib only; the web app answers estimates without torch
    import subprocess
    import sys

    code = ("import sys, vramplan; from vramplan.views.html import report_html; "
            "report_html(vramplan.estimate(vramplan.Job(model='gpt2'))); "
            "assert 'fastapi' not in sys.modules and 'torch' not in sys.modules; "
            "from vramplan.web import create_app; create_app(); "
            "assert 'torch' not in sys.modules, 'web imported torch'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_plan_html(run_cli, tmp_path):
    page = tmp_path / "p.html"
    code, out, err = run_cli("plan", "llama-3.2-1b", "-s", "1024", "--tokens", "1B", "--gpus",
                             "L4,A100-80GB", "--max-gpus", "8", "--html", str(page), "--json")
    assert code == 0, err
    plan = json.loads(out)
    text = page.read_text()
    assert _offline(text)
    assert "vramplan plan llama-3.2-1b --seq-len 1024 --tokens 1B --gpus L4,A100-80GB " \
           "--max-gpus 8" in text
    assert f"<b>recommended</b>: {plan['recommended']['candidate']['num_gpus']} x " in text
