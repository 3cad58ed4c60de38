"""QLoRA's dequantising by library (peft.quant_library): bitsandbytes' fused kernel, or
torchao's NF4Tensor (torchtune's QLoRA), whose eager get_original_weight moves about 13x the
bytes in 13 kernels."""

import pytest

from vramplan import Job
from vramplan.hardware import get_gpu
from vramplan.models import load_architecture
from vramplan.planning.performance import predict
from vramplan.planning.traffic import step_traffic

ARCH = load_architecture("llama-3.2-1b")  # 16 blocks of 7 linears
# per block: q and o 2048 x 2048, k and v 2048 x 512, gate, up and down 2048 x 8192
LINEAR_PARAMS = 16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192)
# torchao 0.18 get_original_weight, bytes per weight element: >> 4 (r 0.5 w 0.5), to long
# (r 0.5 w 4), & 15 (r 0.5 w 0.5), to long (r 0.5 w 4), two table lookups (r 4 w 1 each),
# the scalers (int8 per 64 weights: / factor into bf16, + mean), two flattened copies of
# the expanded scalers (w 1 each), two multiplies (r 2 w 1 each), stack (r 2 w 2)
TORCHAO_BYTES = 1 + 4.5 + 1 + 4.5 + 10 + (3 + 4) / 64 + (4 / 64 + 2) + 6 + 4


def _qlora(framework="plain", **peft) -> Job:
    return Job(model="llama-3.2-1b", batch_size=2, seq_len=512, framework=framework,
               checkpointing="full", peft={"method": "qlora", **peft})


def test_torchtune_quantises_with_torchao_the_hf_stack_with_bitsandbytes():
    assert _qlora("torchtune").peft.quant_library == "torchao"
    assert _qlora("hf-trainer").peft.quant_library == "bitsandbytes"
    assert _qlora().peft.quant_library == "bitsandbytes"
    assert _qlora("torchtune", quant_library="bitsandbytes").peft.quant_library == (
        "bitsandbytes")
    # a torchtune job that turns to QLoRA later takes torchao's too
    lora = Job(model="llama-3.2-1b", framework="torchtune", peft={"method": "lora"})
    assert lora.with_changes(peft={"method": "qlora"}).peft.quant_library == "torchao"


@pytest.mark.parametrize(("library", "per_weight"), [
    ("bitsandbytes", 0.5 + 2), ("torchao", TORCHAO_BYTES)])
def test_each_pass_dequantises_every_block_linear_at_its_librarys_cost(library, per_weight):
    traffic = step_traffic(_qlora(quant_library=library), ARCH)
    for phase in ("forward", "recompute", "backward"):
        assert traffic.by_op_phase[("dequantise", phase)] == pytest.approx(
            LINEAR_PARAMS * per_weight)


def test_torchao_launches_13_kernels_a_linear_where_bitsandbytes_launches_2():
    torchao, bnb = (step_traffic(_qlora(quant_library=q), ARCH)
                    for q in ("torchao", "bitsandbytes"))
    for phase in ("forward", "recompute", "backward"):
        assert torchao.kernels[phase] - bnb.kernels[phase] == (13 - 2) * 16 * 7


def test_torchaos_eager_dequantising_costs_time_and_says_so():
    gpu = get_gpu("RTX-4090")
    torchao, bnb = (predict(_qlora(quant_library=q), gpu) for q in ("torchao", "bitsandbytes"))
    assert torchao.step_time_s > bnb.step_time_s
    assert any(n.startswith("torchao's NF4 weights dequantise in 13 eager kernels")
               for n in torchao.notes)
    assert not any("torchao's NF4" in n for n in bnb.notes)
    # LoRA on a 16-bit base dequantises nothing: the field changes nothing
    lora = Job(model="llama-3.2-1b", batch_size=2, seq_len=512, peft={"method": "lora"})
    assert predict(lora, gpu).step_time_s == predict(
        lora.with_changes(peft={"method": "lora", "quant_library": "torchao"}), gpu).step_time_s


def test_torchaos_dequantising_holds_12_bytes_a_weight_more_at_the_peak():
    from vramplan.engines.registry import get_engine

    formula = get_engine("formula")
    bnb, torchao = (formula.run(_qlora("torchtune", quant_library=q))
                    for q in ("bitsandbytes", "torchao"))
    largest = 2048 * 8192  # the MLP's linears
    # int64 index halves 8, looked-up and scaled halves 2 + 2, the 16-bit result 2: 14
    # bytes a weight, where bitsandbytes' kernel holds the 16-bit result alone
    assert torchao.peak_allocated - bnb.peak_allocated == (14 - 2) * largest
    assert any("torchao's 4-bit NF4" in n for n in torchao.notes)


def test_the_trace_says_it_ran_bitsandbytes_layers_for_a_torchao_job():
    from vramplan.engines.registry import get_engine

    job = Job(model="llama-3.2-1b", framework="torchtune", batch_size=1, seq_len=128,
              peft={"method": "qlora"})
    notes = get_engine("trace").run(job).notes
    assert any(n.startswith("QLoRA run with bitsandbytes' 4-bit layers: torchao's")
               for n in notes)
