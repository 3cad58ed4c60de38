"""QLoRA on GPT-2: transformers' replace_with_bnb_linear quantises its Conv1D layers too, so
the trace's NF4 stand-in packs them (they stayed fp32: the trace's weights were 1.8x)."""

import pytest

from vramplan.engines.formula import estimate
from vramplan.job import Job

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module
import vramplan.engines.trace as trace_module  # noqa: E402

# 128 wide: the 512-byte rounding of the 4-bit layers' small absmax tensors stays under 1%
GPT2 = dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=2048,
            n_positions=512)


def test_gpt2_conv1d_layers_are_stored_in_nf4():
    job = Job(model="x", batch_size=1, seq_len=16, precision="fp32", peft={
        "method": "qlora", "rank": 8, "target_modules": ["all-linear"]},
        runtime={"cublas_workspaces": 0})
    traced = trace_module.trace(job, model_config=dict(GPT2))
    predicted = estimate(job, model_config=dict(GPT2))
    assert traced.categories["weights"] == pytest.approx(predicted.categories["weights"],
                                                         rel=0.01)
