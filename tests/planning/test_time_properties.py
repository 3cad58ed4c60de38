"""Properties of the step-time model over random jobs on catalog GPUs (hypothesis).

Each is one a user relies on when comparing two plans: more work per step never takes less
time, recomputation never saves time, compiling or a fused optimizer never costs time, a
step's time lies inside its own range, and the training time and cost are the step time's
multiples. Three relations a user might expect
hold only where the physics allows, on purpose:
  * selective checkpointing can be slower than full checkpointing on a host-bound step:
    torch's op-level policy (SAC) dispatches every op of the forward and the recomputation
    through a Python mode (efficiency.toml [selective_checkpointing] host_scale, measured by
    benchmarks/host_ops.py), so it is not compared;
  * a paged optimizer's step depends on the memory the rest of the step leaves free
    (planning/paging.py): checkpointing can speed it up (its states stay on the GPU) and
    accumulation more than double it (they no longer do), so paged optimizers are left
    out of those two relations;
  * on a switchless full mesh (MI300X's Infinity Fabric, a GH200 board) more GPUs in the
    node use more links each (comm.mesh_share), so the per-GPU rate may rise with the
    count: the DDP relation is checked behind a switch.
"""

from __future__ import annotations

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vramplan import Job, VramplanError  # noqa: E402
from vramplan.hardware import get_gpu, list_gpus  # noqa: E402
from vramplan.models.catalog import list_models  # noqa: E402
from vramplan.planning.amount import TrainingAmount  # noqa: E402
from vramplan.planning.comm import mesh_share  # noqa: E402
from vramplan.planning.performance import predict  # noqa: E402
from vramplan.planning.results import Performance  # noqa: E402

MODELS = sorted(e.name for e in list_models())
GPUS = sorted(g.name for g in list_gpus())
SHARDING = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hybrid-shard")
FAST = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
AMOUNT = TrainingAmount(tokens=10**9, price_per_hour=2.0)
# Doubling a DDP job's GPUs may lift its per-GPU rate by a hair: NCCL's tree all-reduce
# takes fewer latency steps on some counts than the ring did on fewer GPUs (the largest
# seen, 0.012%: qwen2.5-1.5b on 2 -> 4 GH200).
DDP_LATENCY_SLACK = 1e-3


@st.composite
def jobs(draw) -> tuple[dict, str]:
    fields = dict(
        model=draw(st.sampled_from(MODELS)),
        batch_size=draw(st.integers(1, 16)),
        seq_len=draw(st.sampled_from([16, 128, 512, 1024, 2048])),
        grad_accum=draw(st.sampled_from([1, 2, 4])),
        precision=draw(st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure",
                                        "fp8"])),
        optimizer=draw(st.sampled_from(["adamw", "sgd", "adamw-8bit", "adafactor", "lion",
                                        "paged-adamw-8bit"])),
        optimizer_impl=draw(st.sampled_from(["foreach", "fused", "loop"])),
        checkpointing=draw(st.sampled_from(["none", "selective", "full"])),
        attention=draw(st.sampled_from(["sdpa", "eager"])),
        compile=draw(st.booleans()),
    )
    if draw(st.booleans()):
        fields["peft"] = {"method": draw(st.sampled_from(["lora", "qlora"])),
                          "rank": draw(st.sampled_from([4, 16, 64]))}
    if draw(st.booleans()):
        fields["parallel"] = {"strategy": draw(st.sampled_from(SHARDING)),
                              "num_gpus": draw(st.sampled_from([2, 4, 8, 16, 64]))}
    return fields, draw(st.sampled_from(GPUS))


def timed(fields: dict, gpu: str) -> Performance | None:
    """The prediction, or None where the job is refused or not timed (CNNs)."""
    try:
        return predict(Job.model_validate(fields), get_gpu(gpu), AMOUNT)
    except VramplanError:
        return None


def first(fields: dict, gpu: str) -> Performance:
    perf = timed(fields, gpu)
    assume(perf is not None)
    return perf


def both(fields: dict, gpu: str, **changes) -> tuple[Performance, Performance]:
    """The job's prediction and that of the job with `changes`, both timed (else the
    example is discarded)."""
    changed = timed({**fields, **changes}, gpu)
    assume(changed is not None)
    return first(fields, gpu), changed


@FAST
@given(jobs())
def test_a_prediction_is_finite_inside_its_range_and_adds_up(case):
    perf = first(*case)
    assert all(math.isfinite(v) and v > 0 for v in (
        perf.step_time_s, perf.tokens_per_s, perf.mfu, perf.training_time_s, perf.cost_usd))
    assert perf.mfu <= 1.0
    low, high = perf.step_time_range_s
    assert low <= perf.step_time_s <= high
    assert perf.training_time_s == pytest.approx(perf.steps * perf.step_time_s)
    assert perf.cost_usd == pytest.approx(perf.gpu_hours * AMOUNT.price_per_hour)
    assert perf.gpu_hours == pytest.approx(perf.training_time_s * perf.num_gpus / 3600)
    assert perf.training_time_range_s == pytest.approx(
        (perf.steps * low, perf.steps * high))


@FAST
@given(jobs(), st.sampled_from([("compile", True), ("optimizer_impl", "fused")]))
def test_compiling_or_a_fused_optimizer_never_costs_time(case, change):
    """torch.compile fuses memory-bound work (fewer bytes, fewer launches); a fused
    optimizer step launches fewer kernels than foreach's or a loop's, for the same bytes."""
    fields, gpu = case
    key, value = change
    perf, faster = both({**fields, key: {"compile": False, "optimizer_impl": "loop"}[key]},
                        gpu, **{key: value})
    assert faster.step_time_s <= perf.step_time_s * (1 + 1e-9)


@FAST
@given(jobs(), st.sampled_from(["batch_size", "seq_len"]))
def test_a_larger_micro_batch_never_takes_less_time(case, key):
    fields, gpu = case
    perf, larger = both(fields, gpu, **{key: fields[key] * 2})
    assert larger.step_time_s >= perf.step_time_s * (1 - 1e-9)


@FAST
@given(jobs())
def test_twice_the_micro_batches_take_between_one_and_two_steps(case):
    fields, gpu = case
    assume("paged" not in fields["optimizer"])
    perf, more = both(fields, gpu, grad_accum=fields["grad_accum"] * 2)
    assert perf.step_time_s * (1 - 1e-9) <= more.step_time_s <= 2 * perf.step_time_s * (1 + 1e-9)


@FAST
@given(jobs())
def test_full_checkpointing_never_saves_time(case):
    fields, gpu = case
    assume("paged" not in fields["optimizer"])
    plain, recomputed = both({**fields, "checkpointing": "none"}, gpu, checkpointing="full")
    assert recomputed.step_time_s >= plain.step_time_s * (1 - 1e-9)


@FAST
@given(jobs())
def test_more_ddp_replicas_never_raise_the_rate_per_gpu(case):
    fields, gpu = case
    catalog = get_gpu(gpu)
    assume(mesh_share(catalog, catalog.gpus_per_node, 2) == 1.0)  # behind a switch
    n = (fields.get("parallel") or {}).get("num_gpus", 1)
    fields = {**fields, "parallel": {"strategy": "ddp", "num_gpus": n}}
    perf, more = both(fields, gpu, parallel={"strategy": "ddp", "num_gpus": 2 * n})
    assert more.tokens_per_s_per_gpu <= perf.tokens_per_s_per_gpu * (1 + DDP_LATENCY_SLACK)
