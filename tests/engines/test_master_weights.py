"""Precision bf16-master / fp16-master: a 16-bit model whose optimizer keeps fp32 master
weights and fp32 states (DeepSpeed's bf16 / fp16, Apex AMP O2)."""

import pytest

from vramplan import Job, estimate
from vramplan.engines.runtime import workspaces_bytes
from vramplan.errors import JobError
from vramplan.fit import precision_problem
from vramplan.hardware import get_gpu
from vramplan.models import load_architecture
from vramplan.planning.performance import step_terms
from vramplan.planning.traffic import OPTIMIZER_STEPS

MODEL = "llama-3.2-1b"
N = load_architecture(MODEL).total_params("causal-lm")


def _job(**kw) -> Job:
    return Job(**{"model": MODEL, "batch_size": 1, "seq_len": 256, "optimizer_impl": "fused",
                  "precision": "bf16-master", **kw})


def _workspaces() -> int:
    """The cuBLAS workspaces, in every phase's temporary."""
    return workspaces_bytes(_job().runtime, None)


def test_a_parameter_costs_2_bytes_of_weight_12_of_state_and_6_of_gradients_at_the_step():
    report = estimate(_job())
    c = report.categories
    assert report.peak_phase == "optimizer"
    assert c["weights"] == 2 * N
    assert c["optimizer_states"] == (8 + 4) * N  # fp32 exp_avg, exp_avg_sq and master copy
    # fused AdamW has no temporaries of its own: the peak is the copy, when the 16-bit
    # gradients and their fp32 copies are both alive
    assert c["gradients"] == 2 * N
    assert c["temporary"] - _workspaces() == 4 * N


def test_foreach_adam_peaks_after_the_16_bit_gradients_are_freed():
    c = estimate(_job(optimizer_impl="foreach")).categories
    # foreach AdamW's sqrt(exp_avg_sq) of every parameter, fp32 (the masters'), outlives
    # the 16-bit gradients: fp32 gradients + that temporary
    assert c["gradients"] == 0
    assert c["temporary"] - _workspaces() == (4 + 4) * N


def test_zero_shards_the_master_copy_with_the_states_and_offload_moves_both():
    sharded = estimate(_job(parallel={"num_gpus": 4, "strategy": "zero2"}))
    assert sharded.categories["optimizer_states"] == pytest.approx(12 * N / 4, abs=1)
    offloaded = estimate(_job(offload={"optimizer": True}))
    assert offloaded.categories["optimizer_states"] == 0
    # the step runs on the CPU: no fp32 gradients on the GPU
    assert offloaded.phase_peaks["optimizer"] < estimate(_job()).phase_peaks["optimizer"]


def test_fp16_master_keeps_the_same_bytes_and_runs_at_the_fp16_rate():
    assert estimate(_job(precision="fp16-master")).categories == estimate(_job()).categories
    gpu = get_gpu("V100-32GB")  # fp16 tensor cores, no bf16
    assert precision_problem("fp16-master", gpu) == ""
    assert "no bf16 tensor cores" in precision_problem("bf16-master", gpu)
    terms = step_terms(_job(precision="fp16-master"), gpu)
    assert (terms.dtype, terms.peak) == ("fp16", gpu.tflops["fp16"] * 1e12)


def test_the_step_moves_the_master_copies():
    """Per parameter, beyond bf16-pure's step: the 16-bit gradient read and its fp32 copy
    written (6 B), the updated master read and written back in 16-bit (6 B), and fused
    AdamW's passes over fp32 instead of bf16 tensors."""
    gpu = get_gpu("H100-SXM")
    master = {p.phase: p.bytes for p in step_terms(_job(), gpu).phases}
    pure = {p.phase: p.bytes for p in step_terms(_job(precision="bf16-pure"), gpu).phases}
    fused = OPTIMIZER_STEPS[("adamw", "fused")]  # read p g m v, write p m v: 7 passes
    assert (fused.bytes_fp32, fused.bytes_16bit) == (7 * 4, 7 * 2)
    assert master["optimizer"] - pure["optimizer"] == pytest.approx(
        (12 + fused.bytes_fp32 - fused.bytes_16bit) * N)
    assert master["forward"] == pure["forward"] and master["backward"] == pure["backward"]


@pytest.mark.parametrize("kw, words", [
    (dict(optimizer="adamw-8bit"), "keeps low-bit states of its own"),
    (dict(optimizer_in_backward=True), "drop optimizer_in_backward"),
])
def test_what_a_master_weight_step_cannot_run_is_refused_in_one_line(kw, words):
    with pytest.raises(JobError, match=words):
        _job(**kw)
