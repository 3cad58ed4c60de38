"""The optimizer step's memory traffic and kernels, per implementation (planning/traffic.py)."""

import pytest

from vramplan.job import Job
from vramplan.models import load_architecture
from vramplan.planning import traffic

MODEL = "llama-3.2-1b"


def _optimizer_step(optimizer: str, **fields) -> tuple[float, float, int, int]:
    """(bytes, kernels) of the optimizer phase, the trainable elements and tensors."""
    job = Job(model=MODEL, batch_size=1, seq_len=256, optimizer=optimizer, **fields)
    arch = load_architecture(MODEL)
    t = traffic.step_traffic(job, arch)
    tensors = sum(traffic._trainable_tensors(job, arch))
    from vramplan.engines.step import describe_step
    trainable = describe_step(job, arch).params.trainable
    return t.bytes["optimizer"], t.kernels["optimizer"], trainable, tensors


@pytest.mark.parametrize("optimizer, state_bytes, loops", [
    # torchao AdamWFp8: read p g, write p (fp32: 12) + both fp8 states read and written (4);
    # 4 loop nests per compiled call (benchmarks/torchao_optim_codegen.py)
    ("adamw-fp8", 4, 4),
    # AdamW4bit: 4-bit states (2) + the int64 code index and fp32 block copy Inductor
    # materialises per state (50); 12 loop nests
    ("adamw-4bit", 52, 12),
])
def test_torchao_low_bit_adamw_moves_its_states_at_their_width(optimizer, state_bytes, loops):
    nbytes, kernels, trainable, tensors = _optimizer_step(optimizer)
    clip = traffic.CLIP_PASSES * 4 * trainable
    assert nbytes == pytest.approx(clip + (12 + state_bytes) * trainable)
    assert kernels == 4 + loops * tensors  # clip's 4, then one compiled call per tensor


def test_paged_adamw_is_bitsandbytes_32_bit_kernel_not_torch_foreach():
    nbytes, kernels, trainable, tensors = _optimizer_step("paged-adamw")
    clip = traffic.CLIP_PASSES * 4 * trainable
    assert nbytes == pytest.approx(clip + (12 + 16) * trainable)  # read p g m v, write p m v
    assert kernels == 4 + tensors
    foreach, _, _, _ = _optimizer_step("adamw")
    assert foreach == pytest.approx(clip + 20 * 4 * trainable)  # torch's 20 passes
    assert nbytes < foreach


def test_bf16_pure_halves_the_parameter_and_gradient_bytes():
    nbytes, _, trainable, _ = _optimizer_step("adamw-fp8", precision="bf16-pure")
    clip = traffic.CLIP_PASSES * 2 * trainable
    assert nbytes == pytest.approx(clip + (6 + 4) * trainable)


# Llama 3.2 1B trained whole: 16 blocks of 7 weights and 2 norms, the tied embedding (counted
# with a head), the final norm: 114 matrices, 33 vectors
MATRICES, VECTORS = 16 * 7 + 2, 16 * 2 + 1


def test_a_for_loop_launches_each_ops_kernels_per_tensor():
    _, kernels, _, tensors = _optimizer_step("adamw", optimizer_impl="loop")
    assert traffic._trainable_tensors(Job(model=MODEL), load_architecture(MODEL)) == (
        MATRICES, VECTORS)
    assert kernels == 4 + 8 * tensors  # clip's 4; mul_ (decay), lerp_, mul_, addcmul_,
    #                                    sqrt, div, add_, addcdiv_ per tensor


def test_foreach_launches_fill_with_chunks_or_tensors_whichever_first():
    # 1.24e9 elements: 18,857 chunks of 65536 plus 73 partial last ones; a launch takes
    # 320 chunks under CUDA 12, 2240 under CUDA 13
    elements, tensors = 1_235_814_400, MATRICES + VECTORS
    chunks = -(-elements // 65536) + tensors // 2
    assert traffic.foreach_launches(elements, tensors, 3, cuda=12) == -(-chunks // 320) == 60
    assert traffic.foreach_launches(elements, tensors, 3, cuda=13) == -(-chunks // 2240) == 9
    # 256 LoRA tensors of 65536 elements or fewer: the tensor limit (48 of 3 lists under
    # CUDA 12) fills first; under CUDA 13 (336) one launch takes them all
    assert traffic.foreach_launches(256 * 40_000, 256, 3, cuda=12) == -(-256 // 48) == 6
    assert traffic.foreach_launches(256 * 40_000, 256, 3, cuda=13) == 1
    _, kernels, _, _ = _optimizer_step("adamw")  # 8 foreach ops of 1-3 lists, chunk-bound
    assert kernels == 4 + 8 * 9
    _, kernels, _, _ = _optimizer_step("adamw", runtime={"torch_cuda": 12})
    assert kernels == 4 + 8 * 60


def test_transformers_adafactor_runs_a_loop_of_its_own_and_upcasts_16_bit_weights():
    nbytes, kernels, trainable, _ = _optimizer_step("adafactor", optimizer_impl="loop")
    clip = traffic.CLIP_PASSES * 4 * trainable
    assert nbytes == pytest.approx(clip + 84 * trainable)
    assert kernels == 4 + 24 * MATRICES + 16 * VECTORS
    nbytes, kernels, trainable, _ = _optimizer_step("adafactor", optimizer_impl="loop",
                                                    precision="bf16-pure")
    assert nbytes == pytest.approx(traffic.CLIP_PASSES * 2 * trainable + 102 * trainable)
    assert kernels == 4 + 27 * MATRICES + 19 * VECTORS


def test_bitsandbytes_synchronises_after_every_tensor_so_host_and_device_add():
    from vramplan.hardware import get_gpu
    from vramplan.planning.performance import job_factors, phase_times, step_terms

    job = Job(model=MODEL, batch_size=1, seq_len=256, optimizer="adamw-8bit",
              precision="bf16-pure")
    assert traffic.step_traffic(job).synchronised
    assert not traffic.step_traffic(job.with_changes(optimizer="adamw")).synchronised
    gpu = get_gpu("H100-SXM")
    terms, factors = step_terms(job, gpu), job_factors(job, gpu)
    optimizer = terms.phases[-1]
    device = optimizer.memory_s / factors.memory
    host = optimizer.kernels * factors.kernel_us * 1e-6
    assert phase_times(terms, factors)[0][-1].time_s == pytest.approx(device + host)
    assert optimizer.kernels == 4 + MATRICES + VECTORS  # clip's 4, one update per tensor


def test_torchao_adamw_8bit_is_its_compiled_step_not_bitsandbytes_kernel():
    # torchao AdamW8bit: read p g, write p (fp32: 12) + two 8-bit states read and written (4)
    # + two fp32 intermediates Inductor materialises (16); 11 loop nests per compiled call
    nbytes, kernels, trainable, tensors = _optimizer_step("adamw-8bit-torchao")
    clip = traffic.CLIP_PASSES * 4 * trainable
    assert nbytes == pytest.approx(clip + (12 + 4 + 16) * trainable)
    assert kernels == 4 + 11 * tensors
    job = Job(model=MODEL, batch_size=1, seq_len=256, optimizer="adamw-8bit-torchao")
    assert not traffic.step_traffic(job).synchronised  # no per-tensor sync, unlike bnb's
    assert traffic.step_traffic(job.with_changes(optimizer="adamw-8bit")).synchronised
