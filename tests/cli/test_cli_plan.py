"""`vramplan plan` and estimate's time and cost flags, run in-process."""

from __future__ import annotations

import json

import pytest

from vramplan.errors import JobError
from vramplan.planning.amount import parse_count, parse_duration


def test_plan_prints_the_picks_and_exits_0(run_cli):
    code, out, err = run_cli("plan", "llama-3.2-1b", "-s", "2048", "--tokens", "1B", "--gpus",
                             "L4,H100-SXM", "--max-gpus", "8")
    assert code == 0, err
    assert "recommended:" in out and "cheapest:" in out and "fastest:" in out
    assert "--optimizer-impl fused" in out


def test_plan_ranks_by_the_central_estimate_and_gives_each_pick_its_range(run_cli):
    from vramplan.planning.efficiency import interval, interval_bucket
    from vramplan.views.plan_view import duration, money
    args = ("plan", "llama-3.2-1b", "-s", "2048", "--tokens", "1B", "--gpus", "L4,H100-SXM",
            "--max-gpus", "8")
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    plan = json.loads(out)
    for c in plan["candidates"]:
        # one GPU and several have their own (a Llama trains its own weights here)
        low, high = interval(interval_bucket(c["num_gpus"], decoder=True, adapters=False))
        assert c["training_time_range_s"] == pytest.approx(
            [c["training_time_s"] * low, c["training_time_s"] * high])
        assert c["cost_range_usd"] == pytest.approx([c["cost_usd"] * low, c["cost_usd"] * high])
    times = [c["training_time_s"] for c in plan["candidates"]]
    assert times == sorted(times)  # the table's order: central estimates
    code, out, _ = run_cli(*args)
    pick = plan["cheapest"]["candidate"]
    t, c = pick["training_time_range_s"], pick["cost_range_usd"]
    text = " ".join(out.split())
    assert (f"(80%: {duration(t[0])}-{duration(t[1])}, {money(c[0])}-{money(c[1])})"
            in text)


def test_plan_json_and_nothing_fits_exits_1(run_cli):
    code, out, _ = run_cli("plan", "llama-3.1-70b", "-s", "2048", "--tokens", "1B", "--gpus",
                           "L4", "--max-gpus", "2", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["status"] == "nothing-fits" and data["closest_miss"].startswith("L4")


@pytest.mark.parametrize("args,message", [
    (("--tokens", "-5"), "positive count"),
    (("--tokens", "1B", "--gpus", "H1OO"), "H1OO"),
    (("--tokens", "1B", "--allow", "magic"), "magic"),
    (("--tokens", "1B", "--deadline", "soon"), "duration"),
])
def test_plan_bad_input_exits_2(run_cli, args, message):
    code, _, err = run_cli("plan", "llama-3.2-1b", "--max-gpus", "2", *args)
    assert code == 2 and message in err and err.count("\n") == 1


def test_plan_cost_nobody_meets_exits_2(run_cli):
    code, out, _ = run_cli("plan", "llama-3.2-1b", "--tokens", "1B", "--gpus", "H100-SXM",
                           "--max-gpus", "2", "--max-cost", "0.01")
    assert code == 2 and "Nothing meets" in out


def test_estimate_with_gpu_and_tokens_shows_time_and_cost(run_cli):
    code, out, err = run_cli("estimate", "llama-3.2-1b", "-b", "2", "-s", "1024", "--gpu",
                             "H100-SXM", "--tokens", "100M", "--price-per-hour", "2")
    assert code == 0, err
    assert "Performance on 1 x H100-SXM" in out and "at $2/GPU-hour" in out
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "-b", "2", "--gpu", "H100-SXM",
                           "--tokens", "100M", "--json")
    perf = json.loads(out)["performance"]
    assert perf["training_time_s"] > 0 and perf["cost_usd"] > 0


def test_counts_and_durations():
    assert parse_count("2B") == 2_000_000_000 and parse_count("1.5M") == 1_500_000
    assert parse_count("500k") == 500_000 and parse_count("1234") == 1234
    assert parse_duration("24h") == 86400 and parse_duration("90m") == 5400
    assert parse_duration("2d") == 172800 and parse_duration("600") == 600
    with pytest.raises(JobError):
        parse_count("2X")


def test_estimate_without_gpu_adds_time_and_cost_per_gpu_sorted(run_cli):
    code, out, err = run_cli("estimate", "llama-3.2-1b", "-b", "2", "-s", "1024", "--tokens",
                             "1B", "--sort", "cost")
    assert code == 0, err
    assert "tokens/s" in out and "H100-SXM" in out
    code, _, err = run_cli("estimate", "llama-3.2-1b", "--sort", "price")
    assert code == 2 and "sort must be one of cost, time, headroom" in err


def test_per_gpu_rows_that_fit_come_first_by_cost():
    from vramplan.engines.formula import estimate
    from vramplan.job import Job
    from vramplan.planning.amount import TrainingAmount
    from vramplan.planning.performance import per_gpu

    job = Job(model="llama-3.2-1b", batch_size=4, seq_len=2048)
    rows = per_gpu(job, estimate(job).fits, TrainingAmount(tokens=10**9), "cost")
    fits = [fit.fits for fit, _ in rows]
    assert fits == sorted(fits, reverse=True)
    priced = [perf.cost_usd for fit, perf in rows if fit.fits and perf.cost_usd is not None]
    assert priced == sorted(priced)


def test_search_num_gpus_json_out_and_exit_codes(run_cli, tmp_path):
    out_file = tmp_path / "n.json"
    code, out, err = run_cli("search", "num-gpus", "llama-3.1-8b", "-s", "2048",
                             "--checkpointing", "full", "--gpu", "H100-SXM", "--json",
                             "--out", str(out_file))
    assert code == 0, err
    data = json.loads(out)
    assert data["fits"] and data["best"] > 1 and data["strategy"] in ("zero2", "fsdp")
    assert json.loads(out_file.read_text()) == data
    # 2 GPUs fit with the fused optimizer step the planner uses (foreach needs 4)
    assert data["best"] == 2 and data["flags"] == ("--optimizer-impl fused --num-gpus 2 "
                                                  "--strategy fsdp")
    code, out, _ = run_cli("search", "num-gpus", "llama-3.1-405b", "--gpu", "L4",
                           "--max-gpus", "4")
    assert code == 1 and "does not fit on up to 4 L4 GPUs" in out
    code, _, err = run_cli("search", "num-gpus", "llama-3.1-8b")
    assert code == 2 and "--gpu" in err


def test_plan_global_batch_tokens_flag(run_cli):
    code, out, err = run_cli("plan", "llama-3.2-1b", "-s", "2048", "--tokens", "1B", "--gpus",
                             "H100-SXM", "--max-gpus", "8", "--global-batch-tokens", "64k",
                             "--json")
    assert code == 0, err
    data = json.loads(out)
    # 64,000 tokens / 2048 = 31.25 samples -> 32 (a multiple of 32, 2.4% away)
    assert data["global_batch"] == 32
    assert all(c["job"]["batch_size"] * c["job"]["grad_accum"]
               * c["num_gpus"] // (c["job"]["parallel"]["tensor_parallel"]
                                   * c["job"]["parallel"]["context_parallel"]) == 32
               for c in data["candidates"])


def test_estimate_json_carries_the_fixes_when_it_does_not_fit(run_cli):
    from vramplan.engines.formula import estimate as formula
    from vramplan.engines.memory_report import MemoryReport
    from vramplan.hardware import get_gpu

    code, out, _ = run_cli("estimate", "qwen2.5-0.5b", "-b", "8", "-s", "2048", "--gpu", "L4",
                           "--json")
    assert code == 1
    data = json.loads(out)
    report = MemoryReport.model_validate(data)
    assert report.to_json_dict() == data  # a valid MemoryReport that round-trips
    assert report.to_fit and not report.to_fit[0].changes_maths
    for fix in report.to_fit:  # every fix really fits the L4 with the 5% safety margin
        fit = formula(fix.job, gpus=[get_gpu("L4")]).fits[0]
        assert fit.fits and fit.required_bytes == fix.device_total_bytes
        assert fix.flags.startswith("--")
    code, out, _ = run_cli("estimate", "llama-3.2-1b", "-s", "2048", "--gpu", "H100-SXM",
                           "--json")
    assert code == 0 and json.loads(out)["to_fit"] == []
