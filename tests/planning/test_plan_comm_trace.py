"""Communication volumes of the performance model against the collectives the trace's
fake process group sees (FSDP2 on a tiny Llama, CPU)."""

from __future__ import annotations

import json

import pytest

from vramplan.hardware import get_gpu
from vramplan.job import Job, Parallel
from vramplan.models import architecture_from_config
from vramplan.planning.comm import collectives

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_collective_buffers_equal_the_traced_ones(tmp_path, monkeypatch, strategy):
    import torch.distributed as dist

    from vramplan.engines.trace import trace

    seen = []
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather(output_tensor, input_tensor, *args, **kwargs):
        seen.append(("all-gather", output_tensor.numel() * output_tensor.element_size()))
        return gather(output_tensor, input_tensor, *args, **kwargs)

    def reduce_scatter(output, input, *args, **kwargs):
        seen.append(("reduce-scatter", input.numel() * input.element_size()))
        return scatter(output, input, *args, **kwargs)

    monkeypatch.setattr(dist, "all_gather_single", all_gather)
    monkeypatch.setattr(dist, "reduce_scatter_single", reduce_scatter)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    n = 4
    job = Job(model=str(path), batch_size=2, seq_len=32,
              parallel=Parallel(strategy=strategy, num_gpus=n))
    trace(job, model_config=LLAMA)

    units = LLAMA["num_hidden_layers"] + 1  # each block and the root is an FSDP unit
    steps = sum(kind == "reduce-scatter" for kind, _ in seen) / units
    traced = {kind: sum(b for k, b in seen if k == kind) / steps
              for kind in ("all-gather", "reduce-scatter")}
    modelled = {"all-gather": 0.0, "reduce-scatter": 0.0}
    for c in collectives(job, architecture_from_config(LLAMA, "tiny"), get_gpu("H100-SXM")):
        kind = "all-gather" if "all-gather" in c.name else "reduce-scatter"
        modelled[kind] += c.bytes_per_gpu * n / (n - 1)  # ring share back to the buffer
    assert traced == pytest.approx(modelled)
