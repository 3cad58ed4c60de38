"""benchmarks/traffic_vs_dispatch.py: bytes charged to dispatched ops, and traffic.py's LoRA
count against a real peft step."""

import pytest
import torch

from benchmarks import traffic_vs_dispatch as tvd


def test_each_op_is_charged_its_inputs_and_outputs_and_views_nothing():
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    bias = torch.ones(8, dtype=torch.float32).expand(4, 8)  # broadcast: 8 distinct elements
    with tvd._Bytes() as counter:
        y = x.float()        # r 64, w 128
        y = y + bias         # r 128 + 32, w 128
        y.t()                # a view
        y.view(-1)           # a view
    assert counter.bytes["forward"] == (64 + 128) + (128 + 32 + 128)
    assert dict(counter.by_op) == {("forward", "_to_copy"): 192, ("forward", "add"): 288}


def test_matmuls_are_compute_unless_one_side_is_the_adapter_rank():
    a, w, lora_a = torch.ones(16, 32), torch.ones(32, 16), torch.ones(32, tvd.RANK)
    with tvd._Bytes() as counter:
        a @ w       # compute-bound: FLOPs only
        a @ lora_a  # x @ A: streamed
    assert counter.flops["forward", "linear"] == 2 * 16 * 32 * 16
    assert counter.bytes["forward"] == 4 * (16 * 32 + 32 * tvd.RANK + 16 * tvd.RANK)


@pytest.mark.parametrize("label", [
    "LoRA q,k,v,o, dropout 0.05, bf16 autocast (our H200 runs)",
    "QLoRA q,v, no dropout, pure bf16, fp32 adapters (optimum-benchmark)",
])
def test_traffic_counts_a_peft_block_as_the_step_dispatches_it(label):
    row = tvd.compare(label, tvd.JOBS[label])
    assert row["ratio"]["forward"] == pytest.approx(1.0, abs=0.03)
    assert row["ratio"]["backward"] == pytest.approx(1.0, abs=0.03)
    # the frozen linears' matmuls: forward, then only their input gradients
    flops = row["linear_flops"]
    assert flops["forward"]["dispatched"] == flops["forward"]["modelled"] > 0
    assert flops["backward"]["dispatched"] == flops["backward"]["modelled"] == flops[
        "forward"]["modelled"]
