"""benchmarks/host_ops.py: the host scale of a selective checkpointing policy."""

import pytest

from benchmarks import host_ops


def test_the_policy_scale_is_its_extra_over_full_checkpointings_two_forwards(monkeypatch):
    # a block: forward 1.5 ms and backward 0.5 ms of host work; full checkpointing runs the
    # forward twice (3.5 ms); a policy at 5.0 ms adds 1.5 ms over those two forwards (3 ms)
    times = {"none": 2.0, "full": 3.5, "selective": 5.0, "selective:torchtitan-op": 5.6}
    monkeypatch.setattr(host_ops, "_block_host_ms", lambda model, ckpt: times[ckpt])
    monkeypatch.setattr(host_ops, "QUICK", False)
    result = host_ops.sac_host_scale()
    assert [r["model"] for r in result["rows"]] == list(host_ops.SAC_MODELS)
    assert result["rows"][0]["scale"] == pytest.approx(
        {"selective": 1 + 1.5 / 3.0, "selective:torchtitan-op": 1 + 2.1 / 3.0})
    assert result["median"] == pytest.approx((1.5 + 1.7) / 2)


def test_the_shipped_scale_is_the_committed_measurement():
    import json
    from pathlib import Path

    from vramplan.planning.efficiency import sac_host_scale
    result = json.loads((Path(host_ops.__file__).parent / "results" / "host_ops.json")
                        .read_text())
    assert sac_host_scale() == round(result["selective_checkpointing"]["median"], 2)
