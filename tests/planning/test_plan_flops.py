"""The FLOP model against FlopCounterMode on real training steps of tiny models (CPU)."""

from __future__ import annotations

import json

import pytest

from vramplan.job import Job, Peft
from vramplan.models import architecture_from_config
from vramplan.planning.flops import step_flops

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module
import torch  # noqa: E402
from tiny_configs import BERT, DEEPSEEK_V3, GPT2, LLAMA, T5, VIT, WHISPER  # noqa: E402

MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
               num_local_experts=4, num_experts_per_tok=2,
               # the experts' loop of linears: FlopCounterMode has no formula for the
               # grouped matmul transformers runs by default
               experts_implementation="eager")
DEEPSEEK = dict(DEEPSEEK_V3, experts_implementation="eager")
# q/k and v heads of one size: CPU sdpa runs its flash kernel (else its math path)
DEEPSEEK_EQUAL_HEADS = dict(DEEPSEEK, v_head_dim=24)


def _counted(job: Job, config: dict) -> int:
    """FLOPs FlopCounterMode sees in one real training step (sdpa's CPU kernel added)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    from vramplan.training.setup import build_training_setup, train_step

    aten = torch.ops.aten
    torch.manual_seed(0)
    setup = build_training_setup(job, "cpu", model_config=config)

    def forward(q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q, k, v)

    def backward(grad_out, q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, q, k, v)

    # the CUDA kernels' formulas, for the CPU kernel FlopCounterMode does not know
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: forward,
               aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        train_step(setup, job.grad_accum)
    return counter.get_total_flops()


@pytest.mark.parametrize("config,changes", [
    (LLAMA, dict(precision="fp32", attention="eager")),
    (LLAMA, dict(precision="bf16-mixed")),
    (LLAMA, dict(checkpointing="full")),
    (LLAMA, dict(checkpointing="selective")),
    (LLAMA, dict(peft=Peft(rank=4))),
    (LLAMA, dict(peft=Peft(rank=4, target_modules=("v_proj", "down_proj")))),
    (LLAMA, dict(peft=Peft(rank=4), checkpointing="full")),
    # DoRA: the delta lora_B(lora_A(eye)) each forward; with dropout F.linear(dropout(x), W)
    # again and its input gradient
    (LLAMA, dict(peft=Peft(rank=4, dropout=0.0, dora=True))),
    (LLAMA, dict(peft=Peft(rank=4, dora=True, target_modules=("v_proj", "down_proj")),
                 checkpointing="full")),
    (LLAMA, dict(loss="chunked", grad_accum=2)),
    (GPT2, dict(attention="eager")),
    (BERT, dict(task="masked-lm")),
    (BERT, dict(task="seq-classification", peft=Peft(rank=4, target_modules=("query",)))),
    (T5, dict(target_len=16, attention="eager")),
    (WHISPER, dict(seq_len=16)),
    (VIT, dict(batch_size=4, seq_len=None)),  # images: no sequence length
    (MIXTRAL, dict()),
    (DEEPSEEK, dict(attention="eager")),
    (DEEPSEEK, dict(attention="eager", checkpointing="full")),
    (DEEPSEEK, dict(attention="eager", peft=Peft(rank=4, target_modules=(
        "q_a_proj", "kv_b_proj", "o_proj")))),
    (DEEPSEEK_EQUAL_HEADS, dict()),
])
def test_flops_match_flop_counter(tmp_path, config, changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    job = Job(**{"model": str(path), "batch_size": 2, "seq_len": 32, **changes})
    counted = _counted(job, config)
    # FlopCounterMode counts every attention tile, causal or not
    predicted = step_flops(job, dense_attention=True).total * job.grad_accum
    assert predicted == pytest.approx(counted, rel=0.01)


def test_pinned_flops_of_a_tiny_llama():
    """Llama, h=64, 2 layers, q 64->64, k/v 64->32, o 64->64, gate/up 64->128, down 128->64,
    vocab 256, batch 2 x seq 32 = T 64 tokens, full fine-tuning, eager attention.
    Per layer forward: linears 2*T*(4096+2048+2048+4096+3*8192) = 4,718,592;
    attention 2 matmuls x 2*b*heads*s*s*d = 2*2*2*4*32*32*16 = 524,288.
    Head forward 2*T*64*256 = 2,097,152. Backward: 2x every matmul (input and weight grads).
    Total = 3 x (2 x (4,718,592 + 524,288) + 2,097,152) = 37,748,736."""
    arch = architecture_from_config(LLAMA, "tiny")
    job = Job(model="x", batch_size=2, seq_len=32, attention="eager")
    flops = step_flops(job, arch)
    assert flops.total == 37_748_736
    assert flops.model_flops == flops.total  # no recomputation
    # full checkpointing recomputes each block's forward except down_proj (early stop):
    # + 2 x (4,718,592 + 524,288 - 2*T*8192)
    full = step_flops(job.with_changes(checkpointing="full"), arch)
    assert full.total - flops.total == 2 * (4_718_592 + 524_288 - 2 * 64 * 8192)
    assert full.model_flops == flops.model_flops


def test_causal_flash_attention_skips_the_upper_tiles():
    arch = architecture_from_config(LLAMA, "tiny")
    job = Job(model="x", batch_size=1, seq_len=4096)
    flash = step_flops(job, arch).by_class["attention"].forward
    dense = step_flops(job, arch, dense_attention=True).by_class["attention"].forward
    assert flash / dense == pytest.approx((1 + 128 / 4096) / 2)
    eager = step_flops(job.with_changes(attention="eager"), arch).by_class["attention"]
    assert eager.forward == dense  # eager computes the masked scores too


def test_frozen_weights_compute_no_weight_gradients():
    arch = architecture_from_config(LLAMA, "tiny")
    job = Job(model="x", batch_size=2, seq_len=32)
    full = step_flops(job, arch).by_class["linear"]
    lora = step_flops(job.with_changes(peft=Peft(rank=4)), arch).by_class["linear"]
    assert lora.forward == full.forward
    # no weight gradients; the first block's frozen q/k/v/gate/up see an input without grad
    assert lora.backward < full.backward / 2
