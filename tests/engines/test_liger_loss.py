"""Liger-Kernel's fused linear cross-entropy (loss chunked:liger): its buffers derived here
from its chunking rule, and the readers and engines that take or refuse it."""

from __future__ import annotations

import math

import pytest

from vramplan.engines.formula import estimate
from vramplan.engines.formula.loss import liger_loss_buffers
from vramplan.engines.precision import dtypes_for
from vramplan.errors import EngineError, JobError
from vramplan.hardware import get_gpu
from vramplan.job import Job
from vramplan.planning.performance import predict
from vramplan.planning.traffic import step_traffic

V, H = 128256, 2048  # llama-3.2-1b


def test_the_buffers_follow_ligers_chunking():
    lora = Job(model="llama-3.2-1b", batch_size=2, seq_len=1024, peft={"rank": 8})
    dt = dtypes_for(lora)
    t = 2 * 1023
    # inc_factor = ceil(V / H) = 63; chunk = next_pow2(ceil(t / 63)) = next_pow2(33) = 64
    assert math.ceil(V / H) == 63 and math.ceil(t / 63) == 33
    kept = t * H * dt.residual                      # grad_input; the frozen head: no grad_weight
    forward = kept + 64 * V * dt.compute + 64 * H * dt.compute + 4 * t
    assert liger_loss_buffers(lora, t, V, H, dt) == (forward, kept, kept)
    full = lora.with_changes(peft=None)
    kept_full = t * H * dtypes_for(full).residual + V * H * dtypes_for(full).weight
    assert liger_loss_buffers(full, t, V, H, dtypes_for(full))[1] == kept_full


def test_no_logits_are_kept_and_the_step_moves_fewer_bytes():
    job = Job(model="llama-3.2-1b", batch_size=4, seq_len=2048, checkpointing="full",
              peft={"rank": 8})
    liger = job.with_changes(loss="chunked:liger")
    assert estimate(liger).peak_allocated < estimate(job).peak_allocated
    assert step_traffic(liger).by_op["loss"] < step_traffic(job).by_op["loss"] / 4
    l4 = get_gpu("L4")
    assert predict(liger, l4).step_time_s < predict(job, l4).step_time_s


def test_where_it_does_not_apply_it_is_refused():
    with pytest.raises(JobError, match="causal LM"):
        estimate(Job(model="bert-base-uncased", loss="chunked:liger"))
    with pytest.raises(JobError, match="torchtune"):
        Job(model="llama-3.2-1b", framework="torchtune", loss="chunked:liger")
    with pytest.raises(JobError, match="compile"):
        Job(model="llama-3.2-1b", loss="chunked:liger", compile=True)


@pytest.mark.torch
def test_the_torch_engines_say_it_is_the_formulas():
    from vramplan.engines.trace import trace

    with pytest.raises(EngineError, match="formula engine only"):
        trace(Job(model="llama-3.2-1b", seq_len=64, loss="chunked:liger"))
