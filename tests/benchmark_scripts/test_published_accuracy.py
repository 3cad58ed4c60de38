"""benchmarks/published_accuracy.py: the interval's width (the tail share whose interval
covers each source's rows, held out, closest to 80% of the time) and the scaling families."""

import pytest

from benchmarks import published_accuracy as pa


def _rows(source, errors):
    return [{"source": source, "log_error": e} for e in errors]


# eleven rows of one source at 0.00, 0.01 ... 0.10 and one row of another at 0.0935: the
# first source's interval from t to 1 - t ends at 0.1 (1 - t), which reaches 0.0935 for
# t <= 0.065; the other source's one row makes an interval of zero width, which none of the
# first source's rows hits
WIDE = _rows("a", [i / 100 for i in range(11)])
ONE = _rows("b", [0.0935])


@pytest.mark.parametrize("tail, inside", [(0.10, False), (0.07, False), (0.06, True),
                                          (0.02, True)])
def test_a_row_is_covered_by_the_other_sources_interval(tail, inside):
    assert pa._covers(WIDE + ONE, tail, ONE[0]) is inside


def test_the_tail_share_is_the_one_closest_to_the_coverage_target():
    # coverage is 1/12 for t <= 0.06 and 0 above: the widest t that reaches 1/12 (closest to
    # 0.8) is 0.06
    rows = WIDE + ONE
    assert pa._tail(rows) == 0.06


def test_one_source_keeps_the_10th_to_90th_percentiles():
    assert pa._tail(WIDE) == pa.PLAIN_TAIL == 0.10


def test_equal_coverage_takes_the_narrower_interval():
    # b's interval is the point 0, which holds one of a's rows; a's interval holds all of
    # b's: 4 of 6 at every tail share
    rows = _rows("a", [-0.1, 0.0, 0.1]) + _rows("b", [0.0, 0.0, 0.0])
    coverages = {t: pa._share([pa._covers(rows, t, r) for r in rows]) for t in pa.TAILS}
    assert all(c == pytest.approx(4 / 6) for c in coverages.values())
    assert pa._tail(rows) == max(pa.TAILS) == 0.20


def _run(id_, gpus, batch, measured, predicted):
    from vramplan.job import Job, Parallel
    parallel = Parallel(strategy="ddp" if gpus > 1 else "none", num_gpus=gpus)
    return {"id": id_, "source": "s", "gpu": "H100-SXM", "measured_tps_gpu": measured,
            "loso_tps_gpu": predicted,
            "job": Job(model="gpt2", batch_size=batch, seq_len=64, parallel=parallel)}


def test_scaling_divides_each_count_by_the_fewest_of_its_family():
    runs = [_run("a8", 8, 4, 90.0, 99.0), _run("a1", 1, 4, 100.0, 100.0),
            _run("b1", 1, 2, 50.0, 50.0)]  # another batch: a family of one, left out
    (family,) = pa.scaling(runs)
    assert family["ids"] == ["a1", "a8"] and family["gpus"] == [1, 8]
    assert family["measured"] == [1.0, 0.9] and family["predicted"] == [1.0, 0.99]


def test_scaling_summary_scores_the_ratio_at_the_most_gpus():
    families = [{"measured": [1.0, 0.9], "predicted": [1.0, 0.99]},
                {"measured": [1.0, 0.95, 0.8], "predicted": [1.0, 0.9, 0.8]}]
    summary = pa.scaling_summary(families)
    # errors 0.99 / 0.9 - 1 = 0.1 and 0; perfect scaling 1 / 0.9 - 1 and 1 / 0.8 - 1
    assert summary["families"] == 2
    assert summary["median_abs"] == pytest.approx(0.05)
    assert summary["perfect_scaling_median_abs"] == pytest.approx((1 / 0.9 - 1 + 0.25) / 2)


def test_one_source_fits_the_matmul_share_alone():
    # rows of one source whose measured rate wants a lower attention share than the start:
    # one source cannot tell attention from matmul, so only the matmul share may move
    from vramplan.hardware import get_gpu
    from vramplan.job import Job
    from vramplan.planning.performance import step_terms

    gpu = get_gpu("H100-SXM")
    runs = []
    for seq in (1024, 8192):  # device-bound steps (host time does not hide the change)
        job = Job(model="llama-3.2-1b", batch_size=8, seq_len=seq, attention="sdpa")
        run = {"id": str(seq), "source": "s", "job": job, "terms": step_terms(job, gpu),
               "arch": "hopper", "gpu_name": gpu.name}
        run["measured_tps_gpu"] = pa.predicted_tps_gpu(run, {**pa.START,
                                                             "attention_share": 0.35})
        runs.append(run)
    shares = pa.fit(runs, rounds=2)
    assert shares["matmul_share"] != pa.START["matmul_share"]
    assert {k: shares[k] for k in pa.SHARES if k != "matmul_share"} == \
        {k: pa.START[k] for k in pa.SHARES if k != "matmul_share"}


def test_megatron_loss_moves_the_bytes_of_its_unfused_cross_entropy():
    # bf16 logits (c = 2): Megatron's forward moves 2c + 36 = 40 bytes a logit where the
    # eager loss counts 2c + 16 = 20; its backward c + 12 = 14 where the eager one counts 22
    from vramplan.hardware import get_gpu
    from vramplan.job import Job
    from vramplan.planning.performance import step_terms
    from vramplan.planning.traffic import step_traffic

    gpu = get_gpu("H100-SXM")
    job = Job(model="gpt2", batch_size=2, seq_len=64, precision="bf16-master")
    loss = step_traffic(job).by_op_phase
    before = {p.phase: p.bytes for p in step_terms(job, gpu).phases}
    after = {p.phase: p.bytes for p in pa._megatron_loss(step_terms(job, gpu), job, gpu).phases}
    assert after["forward"] - before["forward"] == pytest.approx(loss["loss", "forward"])
    assert after["backward"] - before["backward"] == pytest.approx(
        -8 / 22 * loss["loss", "backward"])
    assert after["optimizer"] == before["optimizer"]


def test_the_fits_loss_breaks_ties_in_the_attention_share_toward_one(monkeypatch):
    # rows predicted exactly (no error): the loss is the tie-breaker alone, 0.01 x log(a)^2,
    # so a share the rows cannot tell apart settles at 1.0
    runs = [{"source": s, "measured_tps_gpu": 100.0} for s in ("a", "a", "b")]
    monkeypatch.setattr(pa, "predicted_tps_gpu", lambda run, shares: 100.0)
    base = {"matmul_share": 0.8, "memory": 0.7, "kernel_us": 20.0, "overlap": 0.3}
    assert pa._loss(runs, {**base, "attention_share": 1.0}) == 0.0
    assert pa._loss(runs, {**base, "attention_share": 1.25}) == pytest.approx(
        0.01 * 0.22314355 ** 2)
    fitted = pa.fit(runs, start={**base, "attention_share": 1.5},
                    fixed={"kernel_us": 20.0})
    assert fitted["attention_share"] == pytest.approx(1.0, abs=0.02)
