"""Headroom: the largest knob values that fit, larger models, what-if comparisons."""

from __future__ import annotations

import json

import pytest

from vramplan.engines.formula import estimate as formula
from vramplan.errors import JobError
from vramplan.hardware import get_gpu
from vramplan.job import Job, Peft
from vramplan.planning.amount import TrainingAmount
from vramplan.planning.headroom import compare, headroom, parse_changes, what_if

L4 = get_gpu("L4")


def _fits(job: Job, gpu=L4) -> bool:
    fit = formula(job, gpus=[gpu]).fits[0]
    return fit.required_bytes <= 0.95 * fit.usable_bytes


def test_sequence_stops_at_the_models_positions():
    # Qwen2.5-0.5B (rotary) reads 32,768 positions (its config's max_position_embeddings);
    # with full checkpointing and a chunked loss an H200 holds more than that
    job = Job(model="qwen2.5-0.5b", seq_len=1024, checkpointing="full", loss="chunked")
    h200 = get_gpu("H200")
    assert _fits(job.with_changes(seq_len=65536), h200)
    knob = next(k for k in headroom(job, h200).knobs if k.name == "seq_len")
    assert knob.largest == 32768 and knob.at_search_limit


def test_each_knob_stops_exactly_where_memory_runs_out():
    job = Job(model="llama-3.2-1b", batch_size=1, seq_len=1024, peft=Peft(rank=8))
    room = headroom(job, L4)
    knobs = {k.name: k for k in room.knobs}
    b = knobs["batch_size"].largest
    assert _fits(job.with_changes(batch_size=b)) and not _fits(job.with_changes(batch_size=b + 1))
    s = knobs["seq_len"].largest
    assert _fits(job.with_changes(seq_len=s)) and not _fits(job.with_changes(seq_len=s + 1))
    # a rank above the model's width (2048, its config's hidden_size) adds nothing: the
    # search stops there, though memory would allow more
    rank = knobs["peft.rank"]
    assert rank.largest == 2048 and rank.at_search_limit
    assert _fits(job.with_changes(peft=Peft(rank=4096)))
    larger = [m.model for m in room.larger_models]
    assert larger[0] == "llama-3.2-3b" and "llama-3.1-405b" in larger


def test_a_job_that_does_not_fit_gets_the_largest_smaller_value():
    job = Job(model="llama-3.2-1b", batch_size=64, seq_len=2048)
    knob = headroom(job, L4).knobs[0]
    assert knob.current == 64 and (knob.largest is None or knob.largest < 64)


def test_what_if_compares_memory_time_and_cost():
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024)
    result = what_if(job, get_gpu("H100-SXM"), "seq_len=4096,peft.method=lora",
                     TrainingAmount(tokens=10**9))
    assert result.after.job.seq_len == 4096 and result.after.job.peft.method == "lora"
    assert result.before.required_bytes != result.after.required_bytes
    assert result.before.cost_usd > 0 and result.after.training_time_s > 0


def test_parse_changes():
    assert parse_changes("seq_len=8192, model=llama-3.1-70b,peft.rank=64") == {
        "seq_len": 8192, "model": "llama-3.1-70b", "peft": {"rank": 64}}
    with pytest.raises(JobError, match="KEY=VALUE"):
        parse_changes("seq_len")


def test_headroom_cli(run_cli):
    code, out, err = run_cli("headroom", "llama-3.2-1b", "-b", "2", "--gpu", "L4")
    assert code == 1, err  # a full fine-tune of 1B at batch 2 does not fit an L4
    assert "batch_size: 2 now, up to" in out
    code, out, err = run_cli("headroom", "llama-3.2-1b", "-b", "2", "--peft", "lora", "--gpu",
                             "L4")
    assert code == 0, err
    code, _, err = run_cli("headroom", "llama-3.2-1b")
    assert code == 2 and "--gpu" in err


def test_headroom_exits_1_when_the_job_does_not_fit(run_cli):
    code, out, _ = run_cli("headroom", "llama-3.1-8b", "--gpu", "L4")
    assert code == 1 and "does not fit" in out
    code, out, _ = run_cli("headroom", "llama-3.1-8b", "--gpu", "L4", "--what-if",
                           "peft.method=qlora")
    assert code == 1  # the job itself does not fit, whatever the variant does


def test_several_what_ifs_side_by_side(run_cli):
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024)
    h100 = get_gpu("H100-SXM")
    result = compare(job, L4, ["seq_len=4096", "peft.method=lora,batch_size=8", "gpu=H100-SXM"])
    assert [v.side.job.seq_len for v in result.variants] == [4096, 1024, 1024]
    assert result.variants[1].side.job.batch_size == 8
    # gpu= is honoured: that variant is judged on an H100
    on_h100 = result.variants[2].side
    assert on_h100.gpu == "H100-SXM"
    assert on_h100.required_bytes == formula(job.with_changes(gpu="H100-SXM"),
                                             gpus=[h100]).fits[0].required_bytes
    code, out, err = run_cli("headroom", "llama-3.2-1b", "-b", "2", "-s", "1024", "--peft",
                             "lora", "--gpu", "L4", "--what-if", "seq_len=4096", "--what-if",
                             "batch_size=8", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert [v["changes"] for v in data["variants"]] == [{"seq_len": 4096}, {"batch_size": 8}]
    code, out, _ = run_cli("headroom", "llama-3.2-1b", "-b", "2", "-s", "1024", "--gpu", "L4",
                           "--what-if", "seq_len=4096", "--what-if", "batch_size=8")
    assert "seq_len=4096" in out and "batch_size=8" in out and "needs GiB" in out


def test_what_if_fits_uses_the_margin():
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024, peft=Peft(method="lora"))
    knob = next(k for k in headroom(job, L4).knobs if k.name == "batch_size")
    # the largest batch fits with 5% free; with a 40% margin it does not
    side = compare(job, L4, [f"batch_size={knob.largest}"], margin=0.4).variants[0].side
    fit = formula(side.job, gpus=[L4]).fits[0]
    assert fit.required_bytes > 0.6 * fit.usable_bytes and side.fits is False
    assert compare(job, L4, [f"batch_size={knob.largest}"]).variants[0].side.fits is True


@pytest.mark.parametrize(("text", "words"), [
    ("seq_len=[", "seq_len='['"),
    ("[1,2]", "KEY=VALUE"),
    ("foo=1", "unknown key 'foo'"),
    ("batch_size.x=1", "'batch_size' is a value"),
    ("seq_len=[1,2]", "valid integer"),
    ("peft={a: 1}", "not a mapping"),
    (",", "got nothing"),
])
def test_what_if_parse_errors_are_one_line(run_cli, text, words):
    code, out, err = run_cli("headroom", "llama-3.2-1b", "--gpu", "L4", "--what-if", text)
    assert code == 2 and err.count("\n") == 1 and words in err and "Traceback" not in err


def test_a_comma_inside_a_list_does_not_split():
    assert parse_changes("peft.target_modules=[q_proj,v_proj],seq_len=512") == {
        "peft": {"target_modules": ["q_proj", "v_proj"]}, "seq_len": 512}
