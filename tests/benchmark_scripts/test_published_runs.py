"""benchmarks/published_runs.py: published training runs as Jobs, with their measured rates."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import published_runs  # noqa: E402

from vramplan.models import load_architecture  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return {r["id"]: r for r in published_runs.load_rows()}


def test_every_row_once_and_every_row_a_job(rows):
    assert len(rows) == 77 + 216 - 36 + 14  # the 36 llm-foundry rows in both files once
    skipped = [c for c in published_runs.cases() if c.job is None]
    assert skipped == []


@pytest.mark.parametrize("row_id", [
    "llmfoundry_mpt125m_a100_80gb_8gpu_seq2048_amp_bf16",
    "llmfoundry_mpt7b_h100_80gb_8gpu_seq65536_amp_bf16",
    "llmfoundry_mpt70b_h100_80gb_512gpu_seq2048_amp_bf16",
])
def test_mpt_parameters_equal_llm_foundry_s_own_count(rows, row_id):
    row = rows[row_id]
    arch = load_architecture(published_runs.case(row).job.model)
    assert arch.total_params() == row["model_config"]["num_params"]


def test_megatron_mfu_rows_become_tokens_per_second_with_the_source_s_flop_count(rows):
    row = rows["megatron_h100_weak_gpt_1.7b_48gpu"]
    layers, h, s, v = 24, 2048, 4096, 131072
    per_token = 12 * layers * h * h * (6 + s / h + v / (2 * layers * h))
    case = published_runs.case(row)
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(408.8e12 / per_token)
    assert case.job.parallel.num_gpus == 48 and case.job.seq_len == 4096
    # 192 sequences over 48 data-parallel GPUs at the assumed micro-batch 1
    assert case.job.grad_accum == 4 and "micro-batch 1" in case.assumed


def test_megatron_2021_counts_the_recomputed_forward(rows):
    row = rows["megatron_a100_2021_gpt_1.7b_32gpu"]
    layers, h, s, v = 24, 2304, 2048, 51200
    per_token = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    case = published_runs.case(row)
    assert case.measured_tokens_per_s_per_gpu == pytest.approx(137e12 / per_token)
    assert case.job.checkpointing == "full" and case.job.precision == "fp16-mixed"


def test_kempnerforge_rows_match_the_report_s_own_counts(rows):
    # the report: 7B 8.03B, 13B 14.84B, 70B 70.55B parameters; tokens per step per
    # data-parallel rank = batch x accumulation x 4096
    for row_id, params in (("kempnerforge_01_7b_1xh200_single", 8.03e9),
                           ("kempnerforge_08_13b_8xh200_fsdp8", 14.84e9),
                           ("kempnerforge_14_70b_32xh200_tp4_fsdp8", 70.55e9)):
        case = published_runs.case(rows[row_id])
        arch = load_architecture(case.job.model)
        assert arch.total_params() == pytest.approx(params, rel=5e-3)
        dp = case.job.parallel.num_gpus // case.job.parallel.tensor_parallel
        tokens = case.job.batch_size * case.job.grad_accum * case.job.seq_len * dp
        step = rows[row_id]["also_reported"]["step_time_s"]
        total = rows[row_id]["also_reported"]["tokens_per_s_total"]
        assert tokens / step == pytest.approx(total, rel=0.01)
