"""A fused attention kernel's rate at the step's own shape (planning/attention_shape.py),
derived here from the measured points of efficiency.toml [attention_shape]."""

import math
import tomllib
from pathlib import Path

import pytest

import vramplan
from vramplan.hardware import get_gpu
from vramplan.job import Job
from vramplan.planning import performance
from vramplan.planning.attention_shape import _interpolate, ring_rates, shape_rates
from vramplan.planning.efficiency import CUDNN, FLASH_2
from vramplan.planning.flops import step_flops

TOML = Path(vramplan.__file__).parent / "planning" / "efficiency.toml"
TABLE = tomllib.loads(TOML.read_text())["attention_shape"]
FA2 = TABLE[FLASH_2]
SEQ = TABLE["seq"]


def _at(curve: str, seq: int) -> float:
    return FA2[curve][SEQ.index(seq)]


def test_the_reference_shape_is_one():
    ref = TABLE["reference"]
    for kernel in (FLASH_2, CUDNN, "FlashAttention-3"):
        rates = shape_rates(kernel, ref["seq"], ref["head_dim"], ref["causal"])
        assert (rates.forward, rates.backward) == pytest.approx((1.0, 1.0))
        assert rates.note == ""


def test_a_causal_step_at_2048_tokens():
    """Published causal rates count the mask's half of the FLOPs; flops.py counts whole
    128-wide diagonal tiles, so each is x (1 + 128 / s). The backward (not measured with a
    mask) takes the forward's causal / non-causal ratio."""
    def forward(seq):
        return _at("forward_causal_128", seq) * (1 + 128 / seq)

    def backward(seq):
        return _at("backward_128", seq) * forward(seq) / _at("forward_128", seq)

    rates = shape_rates(FLASH_2, 2048, 128, True)
    assert rates.forward == pytest.approx(forward(2048) / forward(16384))
    assert rates.backward == pytest.approx(backward(2048) / backward(16384))
    # 298 x 1.0625 / (335 x 1.0078): FlashAttention-2 is 6% slower at 2k than at 16k
    assert rates.forward == pytest.approx(298 * 1.0625 / (335 * (1 + 128 / 16384)))


def test_no_mask_and_head_size_64():
    ref = _at("forward_causal_128", 16384) * (1 + 128 / 16384)
    rates = shape_rates(FLASH_2, 1024, 64, False)
    assert rates.forward == pytest.approx(_at("forward_64", 1024) / ref)
    ref_back = _at("backward_128", 16384) * ref / _at("forward_128", 16384)
    assert rates.backward == pytest.approx(_at("backward_64", 1024) / ref_back)
    assert "head size 64, no mask" in rates.note  # 0.73x forward: worth saying
    assert "fewest measured" not in rates.note
    assert shape_rates(FLASH_2, 197, 64, False).note.endswith(
        "below 512 tokens, the fewest measured, at 512's rate)")


def test_between_and_beyond_the_measured_points():
    # linear in log2: 1024 lies halfway between 512 and 2048
    assert _interpolate([512, 2048], [100.0, 200.0], 1024) == pytest.approx(150.0)
    assert _interpolate([512, 2048], [100.0, 200.0], 64) == 100.0
    assert _interpolate([512, 2048], [100.0, 200.0], 10**6) == 200.0
    # head size 256 takes 128's curve; 90.5 (2^6.5) is halfway between 64 and 128
    assert shape_rates(FLASH_2, 4096, 256, True) == shape_rates(FLASH_2, 4096, 128, True)
    mid = shape_rates(FLASH_2, 4096, 2 ** 6.5, True).forward
    ends = [shape_rates(FLASH_2, 4096, d, True).forward for d in (64, 128)]
    assert mid == pytest.approx(sum(ends) / 2)
    assert math.isclose(shape_rates("no such kernel", 512, 64, True).forward, 1.0)


def test_the_step_times_its_attention_at_its_own_shape():
    """attention time = attention FLOPs / (peak x rate at the shape): the time per FLOP of
    each phase, times its rate, is the same at 512 and at 16384 tokens."""
    h100 = get_gpu("H100-SXM")
    long = Job(model="llama-3.2-1b", batch_size=1, seq_len=16384, attention="flash-attn-2")
    short = long.with_changes(batch_size=32, seq_len=512)  # the same tokens per step
    for phase in ("forward", "backward"):
        per_flop = []
        for job in (long, short):
            terms = {p.phase: p for p in performance.step_terms(job, h100).phases}
            flops = getattr(step_flops(job).by_class["attention"], phase)
            rate = getattr(shape_rates(FLASH_2, job.seq_len, 64, True), phase)
            per_flop.append(terms[phase].attention_s * rate / flops)
        assert per_flop[0] == pytest.approx(per_flop[1])
    notes = performance.step_terms(short, h100).notes
    assert any("attention at 512 tokens, head size 64, causal" in n for n in notes)


def test_ring_attention_runs_one_causal_call_and_the_rest_unmasked():
    """Over 16 ranks, 131k tokens: the rank's causal call over its own 8192 tokens holds
    (1 + 128 / 8192) / (1 + 128 / 131072) / 16 of its executed FLOPs, the unmasked calls the
    rest; their times add."""
    share = (1 + 128 / 8192) / (1 + 128 / 131072) / 16
    causal = shape_rates(FLASH_2, 8192, 128, True)
    plain = shape_rates(FLASH_2, 8192, 128, False)
    rates = ring_rates(FLASH_2, 131072, 16, 128)
    for d in ("forward", "backward"):
        expected = 1 / (share / getattr(causal, d) + (1 - share) / getattr(plain, d))
        assert getattr(rates, d) == pytest.approx(expected)
    # a job split so: its step's attention takes these rates, not the local causal curve's;
    # one GPU at the local length takes the causal curve (time per FLOP x rate: the same)
    job = Job(model="llama-3.1-8b", seq_len=131072, attention="flash-attn-2",
              parallel={"num_gpus": 16, "context_parallel": 16})
    one = Job(model="llama-3.1-8b", seq_len=8192, attention="flash-attn-2")
    h100 = get_gpu("H100-SXM")
    per_flop = []
    for j, r in ((job, rates), (one, causal)):
        terms = {p.phase: p for p in performance.step_terms(j, h100).phases}
        flops = step_flops(j).by_class["attention"].forward / j.parallel.context_parallel
        per_flop.append(terms["forward"].attention_s * r.forward / flops)
    assert per_flop[0] == pytest.approx(per_flop[1])
    # 2048 tokens a rank of 8: the causal call holds 1.0625 / 1.0078 / 8 = 13% of the FLOPs
    assert "2048 tokens a rank of 8 (ring attention: 87% of its FLOPs unmasked)" in ring_rates(
        CUDNN, 16384, 8, 128).note
