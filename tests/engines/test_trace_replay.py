"""The trace's allocator replay of sharded jobs starts from the built (sharded) model: the
unsharded weights the trace builds before fully_shard never reach a GPU's cache."""

import pytest
from tiny_configs import LLAMA

from vramplan.units import MiB

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module
import vramplan.engines.trace as trace_module  # noqa: E402

Storage = trace_module.Storage


def _events():
    whole = Storage(100 * MiB, 0, "build", "", "empty")   # the unsharded weight
    shard = Storage(25 * MiB // 2, 0, "build", "", "empty")  # its shard on this rank
    act = Storage(20 * MiB, 1, "forward", "", "mm")
    return [(1, whole), (1, shard), (-1, whole), (1, act), (-1, act)]


def test_replay_from_the_built_state_skips_the_build_transients():
    events = _events()
    # from the start: the shard gets a 14 MiB segment (12.5 rounded to 2 MiB) beside the
    # 100 MiB one, which stays cached and takes the activation
    assert trace_module._replay(events, 0, 0).peak_reserved == (100 + 14) * MiB
    # from the built state: the 12.5 MiB shard alone gets a segment rounded to 2 MiB (14),
    # the activation its own 20 MiB
    assert trace_module._replay(events, 0, 0, built=3).peak_reserved == (14 + 20) * MiB


@pytest.mark.slow
def test_fsdp_trace_reserves_less_than_replayed_with_the_unsharded_build():
    from vramplan.job import Job

    config = dict(LLAMA, hidden_size=256, intermediate_size=1024, num_hidden_layers=8)
    job = Job(model="x", batch_size=1, seq_len=16, runtime=dict(cublas_workspaces=0),
              parallel=dict(strategy="fsdp", num_gpus=8))
    result = trace_module.run_trace(job, model_config=config)
    from_start = trace_module._replay(result.events, 0, 0).peak_reserved
    # replayed from the start, the segments of the fp32 model built whole stay reserved
    assert from_start >= 4 * result.params_total
    assert result.report(job).peak_reserved < from_start


@pytest.mark.slow
def test_compiled_fsdp_llama_8b_engines_agree_on_reserved():
    # issue 19: Llama-3.1-8B, FSDP over 8, 2 x 8192, torchtitan's op SAC, compiled. The trace
    # ran its compiled blocks without checkpointing under FSDP (peak allocated 90.0 GiB)
    # and replayed the unsharded build (reserved 101.5 GiB); the formula said 49.6 / 54.2
    from vramplan.api import estimate
    from vramplan.job import Job

    job = Job(model="llama-3.1-8b", batch_size=2, seq_len=8192, compile=True,
              checkpointing="selective:torchtitan-op",
              parallel=dict(strategy="fsdp", num_gpus=8))
    predicted, traced = estimate(job), trace_module.trace(job)
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=0.02)
    assert predicted.peak_reserved == pytest.approx(traced.peak_reserved, rel=0.05)
