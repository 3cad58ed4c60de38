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
    tensors = traffic._trainable_tensors(job, arch)
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
