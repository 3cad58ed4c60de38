"""Calibration on measured runs: fit, store in the config folder, used by later predictions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramplan.errors import JobError
from vramplan.hardware import get_gpu
from vramplan.job import Job
from vramplan.planning.calibrate import calibrate, load_runs
from vramplan.planning.efficiency import factors_for
from vramplan.planning.performance import predict

RUNS = Path(__file__).parents[2] / "benchmarks" / "results" / "gpu_validation.json"


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMPLAN_CONFIG_DIR", str(tmp_path))
    return tmp_path


def _one_run(tmp_path: Path, scale: float = 1.0) -> Path:
    """A measure-style report of the first H200 run, its step time scaled."""
    row = json.loads(RUNS.read_text())["rows"][0]
    report = {"job": row["job"], "measured": {"step_time_median_s":
                                              scale * row["measured"]["step_time_median_s"],
                                              "device_name": "NVIDIA H200"}}
    path = tmp_path / f"run{scale}.json"
    path.write_text(json.dumps(report))
    return path


def test_one_run_scales_the_factors_to_match_it(config_dir):
    path = _one_run(config_dir, scale=2.0)  # a GPU twice as slow as our H200 run
    result = calibrate([path])
    assert result.gpu == "H200" and result.runs == 1
    assert result.median_error_after < 0.02 < result.median_error_before


def test_stored_factors_are_used_and_named(run_cli, config_dir):
    path = _one_run(config_dir, scale=2.0)
    job = Job.model_validate(json.loads(path.read_text())["job"])
    before = predict(job, get_gpu("H200")).step_time_s
    code, out, err = run_cli("calibrate", str(path))
    assert code == 0, err and "stored in" in out
    assert (config_dir / "efficiency.toml").is_file()
    assert "calibrated on 1 of your runs" in factors_for(get_gpu("H200")).source
    assert factors_for(get_gpu("H200")).calibrated  # read back from the stored table
    stored = (config_dir / "efficiency.toml").read_text().splitlines()
    assert not [line for line in stored if line.startswith("calibrated")]  # not a factor
    after = predict(job, get_gpu("H200")).step_time_s
    assert after == pytest.approx(2 * json.loads(RUNS.read_text())["rows"][0]["measured"][
        "step_time_median_s"], rel=0.02)
    assert after > 1.5 * before
    # other GPUs keep the shipped factors
    assert "calibrated" not in factors_for(get_gpu("H100-SXM")).source
    assert not factors_for(get_gpu("H100-SXM")).calibrated


def test_a_stored_table_from_an_older_version_takes_the_factors_it_lacks_shipped(run_cli,
                                                                                  config_dir):
    code, _, err = run_cli("calibrate", str(_one_run(config_dir, scale=2.0)))
    assert code == 0, err
    stored = config_dir / "efficiency.toml"
    text = stored.read_text()
    # before host_link was a share of the GPU's own link, the table stored GB/s
    older = "\n".join("host_link_gb_s = 25.0" if line.startswith("host_link =") else line
                      for line in text.splitlines())
    assert older != text
    stored.write_text(older)
    factors = factors_for(get_gpu("H200"))
    assert factors.calibrated and "invalid" not in factors.source
    assert factors.host_link == factors_for(get_gpu("H200"), calibrated=False).host_link


def test_many_runs_fit_three_factors(config_dir):
    runs = load_runs([RUNS])
    assert len(runs) == 19
    result = calibrate([RUNS])
    assert result.gpu == "H200" and result.runs == 19


def test_calibration_narrows_the_interval_to_your_runs_spread(config_dir):
    from vramplan.planning.calibrate import save
    from vramplan.planning.efficiency import interval
    from vramplan.planning.performance import step_terms, step_time

    result = calibrate([RUNS])
    low, high = result.factors.interval
    shipped_low, shipped_high = interval("single_gpu")  # the runs are single-GPU
    assert shipped_low <= low <= 1 <= high <= shipped_high
    # the interval is the spread of measured / predicted over the runs, clipped to the shipped
    gpu = get_gpu("H200")
    ratios = [m / step_time(step_terms(job, gpu), result.factors)
              for job, m, _ in load_runs([RUNS])]
    assert low == pytest.approx(max(shipped_low, min(ratios)))
    assert high == pytest.approx(min(shipped_high, max(ratios)))
    save(result)
    perf = predict(Job(model="llama-3.2-1b", batch_size=2, seq_len=1024), gpu)
    assert perf.step_time_range_s == pytest.approx((perf.step_time_s * low,
                                                    perf.step_time_s * high))


def test_bad_files(config_dir):
    with pytest.raises(JobError, match="does not exist"):
        calibrate([config_dir / "missing.json"])
    bad = config_dir / "bad.json"
    bad.write_text(json.dumps({"job": {"model": "llama-3.2-1b"}, "measured": {}}))
    with pytest.raises(JobError, match="no job with a measured step time"):
        calibrate([bad])


def test_fit_finds_the_module_term_it_was_given():
    # runs generated with 20 us per nn.Module call: the fit over (0, 20, 40) finds it
    from vramplan.hardware import get_gpu
    from vramplan.job import Job
    from vramplan.planning.calibrate import fit
    from vramplan.planning.efficiency import factors_for
    from vramplan.planning.performance import step_terms, step_time

    gpu = get_gpu("H200")
    base = factors_for(gpu, calibrated=False)
    truth = base.model_copy(update={"module_us": 20.0})
    jobs = [Job(model="bert-base-uncased", batch_size=8, seq_len=128),
            Job(model="gpt2", batch_size=2, seq_len=256),
            Job(model="llama-3.2-1b", batch_size=4, seq_len=2048)]
    terms = [step_terms(job, gpu) for job in jobs]
    measured = [step_time(t, truth) for t in terms]
    assert measured[0] > step_time(terms[0], base)  # the term matters for a small model
    assert fit(base, terms, measured, module_us=(0.0, 20.0, 40.0)).module_us == 20.0
