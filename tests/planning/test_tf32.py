"""tf32: fp32 matmuls on TF32 tensor cores change an fp32 job's step time, never its memory."""

from vramplan import Job, estimate
from vramplan.hardware import get_gpu
from vramplan.planning.efficiency import fp32_ratio
from vramplan.planning.performance import step_terms


def _job(**kw) -> Job:
    return Job(**{"model": "bert-large-uncased", "batch_size": 8, "seq_len": 384,
                  "precision": "fp32", **kw})


def test_fp32_matmuls_run_at_the_tf32_peak_where_the_gpu_has_one():
    gpu = get_gpu("A100-80GB")
    plain, tf32 = step_terms(_job(), gpu), step_terms(_job(tf32=True), gpu)
    assert (plain.dtype, tf32.dtype) == ("fp32", "tf32")
    assert tf32.peak == gpu.tflops["tf32"] * 1e12
    forward = {p.phase: p for p in plain.phases}["forward"]
    faster = {p.phase: p for p in tf32.phases}["forward"]
    # 8x the peak, and plain fp32's CUDA cores reach their own share of theirs
    # (fp32_ratio); planning/gemm.py's per-GEMM overhead (fixed microseconds) keeps it from
    # being exactly that much less time
    ratio = gpu.tflops["fp32"] / gpu.tflops["tf32"] * fp32_ratio(gpu)[0]
    assert ratio < faster.matmul_s / forward.matmul_s < 1.05 * ratio
    assert faster.memory_s == forward.memory_s  # the memory-bound work is the same
    assert estimate(_job(tf32=True)).categories == estimate(_job()).categories


def test_without_tf32_tensor_cores_or_fp32_matmuls_the_setting_changes_nothing():
    v100 = get_gpu("V100-32GB")  # Volta: no TF32
    assert "tf32" not in v100.tflops
    terms = step_terms(_job(tf32=True), v100)
    assert terms.dtype == "fp32" and any("no TF32 tensor cores" in n for n in terms.notes)
    h100 = get_gpu("H100-SXM")
    assert step_terms(_job(precision="bf16-mixed", tf32=True), h100) == step_terms(
        _job(precision="bf16-mixed"), h100)
