"""Tensor parallelism without sequence parallelism (parallel.sequence_parallel=false):
each rank keeps the residual-stream-wide tensors whole and does their work whole."""

import pytest

from vramplan import Job, estimate
from vramplan.errors import JobError
from vramplan.hardware import get_gpu
from vramplan.models import load_architecture
from vramplan.planning.performance import step_terms

TP = 8
B, S = 2, 4096


def _job(sp: bool, **kw) -> Job:
    return Job(model="llama-3.1-8b", batch_size=B, seq_len=S,
               parallel={"num_gpus": TP, "tensor_parallel": TP, "sequence_parallel": sp}, **kw)


def test_full_checkpointing_keeps_every_block_input_and_the_head_input_whole():
    arch = load_architecture("llama-3.1-8b")
    stack = arch.stacks[0]
    n = B * S * stack.hidden_size
    # per block the fp32 block input (bf16-mixed: the residual stream is fp32); outside the
    # blocks the final RMSNorm's fp32 input and normalised tensor (8 B) and the head's
    # 16-bit input; with sequence parallelism each rank keeps 1/TP of them, without all
    whole = stack.num_layers * 4 * n + 8 * n + 2 * n
    on = estimate(_job(True, checkpointing="full"))
    off = estimate(_job(False, checkpointing="full"))
    assert off.phase_peaks["forward"] - on.phase_peaks["forward"] == whole * (TP - 1) / TP
    assert any("without sequence parallelism" in note for note in off.notes)
    assert not any("without sequence parallelism" in note for note in on.notes)


def test_the_hidden_wide_work_runs_whole_on_every_rank():
    """Compiled Llama blocks (training/compiled.py's fusion): per block and forward, the two
    norms read the fp32 residual and write 16-bit (2 x 6 B per element) and the two residual
    adds read 2 and write 1 fp32 tensor (2 x 12 B): 36 B per residual-stream element."""
    arch = load_architecture("llama-3.1-8b")
    stack = arch.stacks[0]
    n = B * S * stack.hidden_size
    gpu = get_gpu("H100-SXM")
    on = {p.phase: p.bytes for p in step_terms(_job(True, compile=True), gpu).phases}
    off = {p.phase: p.bytes for p in step_terms(_job(False, compile=True), gpu).phases}
    wide = stack.num_layers * 36 * n
    assert off["forward"] - on["forward"] == pytest.approx(wide * (TP - 1) / TP)
    assert off["backward"] - on["backward"] == pytest.approx(2 * wide * (TP - 1) / TP)
    assert off["optimizer"] == on["optimizer"]


def test_without_tensor_parallelism_the_setting_changes_nothing():
    one = {"num_gpus": 1}
    a = estimate(Job(model="llama-3.2-1b", parallel={**one, "sequence_parallel": False}))
    b = estimate(Job(model="llama-3.2-1b", parallel=one))
    assert a.phase_peaks == b.phase_peaks


def test_selective_checkpointing_without_sequence_parallelism_is_refused_in_one_line():
    with pytest.raises(JobError, match="sequence_parallel=false is modelled with "
                                       "checkpointing none or full"):
        estimate(_job(False, checkpointing="selective"))
