"""MemoryReport's JSON forms read back into the same report."""

import json

from vramplan import Job, MemoryReport, estimate


def test_json_reports_round_trip():
    report = estimate(Job(model="gpt2", batch_size=2, seq_len=64))
    assert MemoryReport.model_validate_json(report.model_dump_json()) == report
    # the documented document adds three sums; reading it back checks and drops them
    document = json.loads(json.dumps(report.to_json_dict()))
    assert MemoryReport.model_validate(document) == report


def test_a_lora_job_round_trips():
    # the job's LoRA target_modules were a tuple in the report and a list read back
    report = estimate(Job(model="gpt2", batch_size=2, seq_len=64,
                          peft={"rank": 4, "target_modules": ["c_attn"]}))
    assert MemoryReport.model_validate_json(report.model_dump_json()) == report
