"""DoRA (peft use_dora) in the formula and the time model: exact bytes and FLOPs for small
jobs, derived here from the shapes (the trace comparison is test_formula_vs_trace.py)."""

from __future__ import annotations

import pytest

from vramplan.engines.formula import dora, estimate
from vramplan.engines.precision import dtypes_for
from vramplan.errors import JobError
from vramplan.hardware import get_gpu
from vramplan.job import Job, Peft
from vramplan.models import load_architecture
from vramplan.planning.flops import step_flops
from vramplan.planning.performance import predict

ARCH = load_architecture("llama-3.2-1b")  # 16 blocks; v_proj 2048 -> 512, down 8192 -> 2048
STACK = ARCH.stacks[0]


def _job(targets=("v_proj",), dropout=0.05, precision="bf16-mixed", **peft) -> Job:
    return Job(model="llama-3.2-1b", batch_size=2, seq_len=128, precision=precision,
               peft=Peft(rank=8, dropout=dropout, target_modules=targets, dora=True, **peft))


def test_what_each_adapted_linear_keeps():
    tokens = 2 * 128
    # autocast: 16-bit base and adapter outputs; with dropout F.linear's 16-bit weight copy
    job = _job()
    assert dora.saved(job, STACK, tokens, dtypes_for(job)) == [
        ("v_proj dora outputs", tokens * 512 * (2 + 2)),
        ("v_proj dora weight copy", 2048 * 512 * 2)]
    # bf16-pure, bf16 adapters, no dropout: the outputs only (the base output is `result`)
    pure = _job(dropout=0.0, precision="bf16-pure")
    assert dora.saved(pure, STACK, tokens, dtypes_for(pure)) == [
        ("v_proj dora outputs", tokens * 512 * (2 + 2))]
    # bf16-pure with fp32 adapters and dropout: F.linear runs in fp32 on an fp32 weight copy
    fp32 = _job(precision="bf16-pure", adapter_dtype="fp32")
    assert dora.saved(fp32, STACK, tokens, dtypes_for(fp32)) == [
        ("v_proj dora outputs", tokens * 512 * (4 + 4)),
        ("v_proj dora weight copy", 2048 * 512 * 4)]


def test_the_forward_transient_is_the_larger_moment():
    job = _job(targets=("down_proj",))  # fp32 adapters and weights under autocast
    eye, n = 8192 ** 2, 8192 * 2048
    building = eye * (4 + 2) + n * 2   # eye(in), autocast's copy, lora_B's 16-bit output
    norm = eye * 2 + 3 * n * 4         # the kept copy, delta, scaled delta, sum (fp32)
    assert dora.transient(job, ARCH, dtypes_for(job)) == max(building, norm) == building
    # without DoRA there is none
    plain = job.with_changes(peft=job.peft.model_copy(update={"dora": False}))
    assert dora.transient(plain, ARCH, dtypes_for(plain)) == 0


def test_the_magnitudes_train_with_the_adapters():
    job = _job(targets=("v_proj", "down_proj"))
    lora = job.with_changes(peft=job.peft.model_copy(update={"dora": False}))
    extra = estimate(job).params_trainable - estimate(lora).params_trainable
    assert extra == 16 * (512 + 2048)  # one magnitude per output feature per block


def test_dora_flops_and_its_slower_step():
    def forward(job: Job) -> float:
        return step_flops(job).by_class["lora"].forward

    base = _job(dropout=0.0)
    lora = base.with_changes(peft=base.peft.model_copy(update={"dora": False}))
    # lora_B(lora_A(eye(2048))): 2 x 2048 x 8 x (2048 + 512) per block
    assert forward(base) - forward(lora) == 16 * 2 * 2048 * 8 * (2048 + 512)
    # dropout: F.linear(dropout(x), W) again, 2 x tokens x 2048 x 512 per block
    dropped = _job(dropout=0.05)
    assert forward(dropped) - forward(base) == 16 * 2 * 256 * 2048 * 512
    l4 = get_gpu("L4")
    times = [predict(j, l4).step_time_s for j in (lora, base, dropped)]
    assert times == sorted(times) and times[0] < times[1] < times[2]


def test_dora_where_it_is_not_modelled_is_refused():
    experts = Job(model="mixtral-8x7b", peft=Peft(target_modules=("w1",), dora=True))
    with pytest.raises(JobError, match="DoRA on the experts"):
        estimate(experts)
    with pytest.raises(JobError, match="DoRA on the experts"):  # the time model too
        predict(experts, get_gpu("H100-SXM"))
    with pytest.raises(JobError, match="DoRA"):
        estimate(_job().with_changes(compile=True))
