"""Which fused attention kernel a job runs on each GPU, and how fast (planning/efficiency.py
attention_kernel): torch's SDPA, the flash-attn package and cuDNN keep the same tensors and
differ in speed only."""

import tomllib
from pathlib import Path

import pytest

import vramplan
from vramplan.errors import JobError
from vramplan.hardware import get_gpu
from vramplan.job import Job
from vramplan.planning import performance
from vramplan.planning.attention_shape import shape_rates
from vramplan.planning.efficiency import CUDNN, FLASH_2, attention_kernel

TOML = Path(vramplan.__file__).parent / "planning" / "efficiency.toml"
HOPPER = tomllib.loads(TOML.read_text())["architectures"]["hopper"]
BLACKWELL = tomllib.loads(TOML.read_text())["architectures"]["blackwell"]
FUSED = ("sdpa", "flash-attn-2", "flash-attn-3", "cudnn")


@pytest.mark.parametrize(("attention", "gpu", "speedup", "note"), [
    # torch's SDPA takes cuDNN's kernel first on compute capability 9.0 and 10.0 only
    ("sdpa", "H100-SXM", HOPPER["cudnn_attention"], "SDPA runs cuDNN's attention"),
    ("sdpa", "B200", BLACKWELL["cudnn_attention"], "SDPA runs cuDNN's attention"),
    ("sdpa", "GB300", 1.0, ""),  # 10.3: FlashAttention-2
    ("sdpa", "A100-80GB", 1.0, ""),
    ("sdpa", "RTX-5090", 1.0, ""),
    ("sdpa", "L40S", 1.0, ""),
    ("sdpa", "MI300X", 1.0, ""),
    # the flash-attn package's FlashAttention-2 everywhere from compute capability 8.0
    ("flash-attn-2", "H100-SXM", 1.0, ""),
    ("flash-attn-2", "L40S", 1.0, ""),
    ("flash-attn-2", "V100-SXM2-32GB", 1.0, "cannot run attention flash-attn-2"),
    # FlashAttention-3 on Hopper only
    ("flash-attn-3", "H200", HOPPER["flash_attn_3"], "FlashAttention-3"),
    ("flash-attn-3", "A100-80GB", 1.0, "whose kernels are Hopper's (9.0) only"),
    ("flash-attn-3", "B200", 1.0, "cannot run attention flash-attn-3"),
    # cuDNN's own kernel (Transformer Engine): its architecture's rate, GB300 included
    ("cudnn", "GB300", BLACKWELL["cudnn_attention"], "cuDNN's fused attention"),
    ("cudnn", "A100-80GB", 1.0, "not measured on Ampere"),
    ("cudnn", "T4", 1.0, "cannot run attention cudnn"),
    ("cudnn", "MI300X", 1.0, "has no cuDNN"),
])
def test_the_kernel_each_attention_runs(attention, gpu, speedup, note):
    kernel = attention_kernel(attention, get_gpu(gpu))
    assert kernel.speedup == speedup
    assert (note in kernel.note) if note else kernel.note == ""


def test_kernels_change_the_attention_time_only():
    """On an H100 the attention term divides by the kernel's speedup over FlashAttention-2
    and by its rate at the job's shape (2048 tokens, head size 64, causal) over
    FlashAttention-2's, each over its own at the reference shape; the matmuls, the
    memory-bound work and the memory estimate stay the same."""
    base = Job(model="llama-3.2-1b", batch_size=2, seq_len=2048, attention="flash-attn-2")
    h100 = get_gpu("H100-SXM")
    reference = performance.step_terms(base, h100)
    flash_2 = shape_rates(FLASH_2, 2048, 64, True)
    for attention, kernel, ratio in (("sdpa", CUDNN, HOPPER["cudnn_attention"]),
                                     ("cudnn", CUDNN, HOPPER["cudnn_attention"]),
                                     ("flash-attn-3", "FlashAttention-3",
                                      HOPPER["flash_attn_3"])):
        job = base.with_changes(attention=attention)
        terms = performance.step_terms(job, h100)
        assert terms.fused_attention
        rates = shape_rates(kernel, 2048, 64, True)
        for ref, p in zip(reference.phases, terms.phases, strict=True):
            shape = (rates.backward / flash_2.backward if p.phase == "backward"
                     else rates.forward / flash_2.forward)
            assert p.attention_s == pytest.approx(ref.attention_s / ratio / shape)
            assert (p.matmul_s, p.memory_s) == (ref.matmul_s, ref.memory_s)
        assert vramplan.estimate(job).peak_allocated == vramplan.estimate(base).peak_allocated
    # eager attention is timed at the matmul factor (no kernel, no note)
    eager = performance.step_terms(base.with_changes(attention="eager"), h100)
    assert not eager.fused_attention
    assert not any("FlashAttention" in n for n in eager.notes)


@pytest.mark.parametrize("tf32", [False, True])
def test_fp32_sdpa_takes_no_cudnn_kernel(tf32):
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=2048, precision="fp32", tf32=tf32)
    notes = " ".join(performance.step_terms(job, get_gpu("H100-SXM")).notes)
    assert "cuDNN" not in notes


def test_gemma2_keeps_flash_attention_fused_and_sdpa_eager():
    """transformers runs Gemma-2's soft-capped attention eagerly under sdpa, while
    flash_attention_2 takes the cap (integrations/flash_attention.py softcap)."""
    job = Job(model="gemma-2-2b", batch_size=2, seq_len=2048, peft={"method": "lora"})
    sdpa, flash = vramplan.estimate(job), vramplan.estimate(job.with_changes(
        attention="flash-attn-2"))
    assert flash.peak_allocated < sdpa.peak_allocated
    assert vramplan.estimate(job.with_changes(attention="eager")).peak_allocated == \
        sdpa.peak_allocated


@pytest.mark.parametrize("attention", ["flash-attn-2", "flash-attn-3", "cudnn"])
def test_flash_kernels_refuse_fp32(attention):
    with pytest.raises(JobError, match=f"attention {attention} runs in fp16 / bf16 only"):
        Job(model="gpt2", precision="fp32", attention=attention)
    Job(model="gpt2", precision="fp32", attention="sdpa")  # SDPA has fp32 kernels


def test_a_gpu_that_cannot_run_the_kernel_does_not_fit():
    """The fit table (what every surface and the planner read) marks the GPUs a kernel does
    not run on, whatever their memory; with --gpu such a job is refused in one line."""
    job = Job(model="gpt2", batch_size=1, seq_len=512, attention="flash-attn-3")
    fits = {f.gpu: f for f in vramplan.estimate(job).fits}
    assert fits["H100-SXM"].supported and fits["H100-SXM"].fits
    for name in ("A100-80GB", "B200", "MI300X"):
        assert not fits[name].supported and not fits[name].fits, name
        assert "cannot run attention flash-attn-3" in fits[name].problem
    assert all(f.supported for f in vramplan.estimate(  # fp16: every catalog GPU runs it
        job.with_changes(attention="sdpa", precision="fp16-mixed")).fits)
    with pytest.raises(JobError, match="cannot run attention flash-attn-2, which needs "
                       "compute capability 8.0 or newer: use sdpa"):
        vramplan.estimate(job.with_changes(attention="flash-attn-2", precision="fp16-mixed",
                                           gpu="V100-32GB"))
