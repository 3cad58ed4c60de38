"""CPU offload and paged optimizer states in the trace, against the formula: memory outside
torch's caching allocator (unified memory, host) is reported apart, never in the peak."""

import pytest

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module

from tiny_configs import LLAMA  # noqa: E402

from vramplan import Job, Peft  # noqa: E402
from vramplan.engines.formula import estimate  # noqa: E402
from vramplan.engines.trace import STEPS, _live_at, run_trace, trace  # noqa: E402
from vramplan.errors import EngineError  # noqa: E402

# no cuBLAS workspaces: the tiny model's figures are its tensors only
TINY = dict(model="tiny", batch_size=2, seq_len=64, runtime={"cublas_workspaces": 0})
# tiny Llama with tensors big enough to page (bitsandbytes pages from 1e5 elements):
# embedding and untied head 2048 x 64 = 131,072; gate, up, down 64 x 1600 = 102,400
PAGEABLE = dict(LLAMA, vocab_size=2048, intermediate_size=1600)
PAGED_ELEMENTS = 2 * 2048 * 64 + 2 * 3 * 64 * 1600  # 2 layers x 3 MLP linears = 876,544


def both(model_config=LLAMA, **fields):
    job = Job(**TINY, **fields)
    return trace(job, model_config=model_config), estimate(job, model_config=model_config)


# --- paged optimizer states ----------------------------------------------------------------


@pytest.mark.parametrize("optimizer, per_element", [
    ("paged-adamw-8bit", 2),  # two uint8 codes; the fp32 absmax vectors stay torch tensors
    ("paged-adamw", 8),       # two fp32 states
])
def test_paged_states_are_unified_memory_not_allocator_memory(optimizer, per_element):
    traced, predicted = both(PAGEABLE, optimizer=optimizer)
    assert traced.unified_memory_bytes == predicted.unified_memory_bytes \
        == per_element * PAGED_ELEMENTS
    # and they are not in the allocator's figures: the unpaged layout holds them there
    resident = trace(Job(**TINY, optimizer="adamw-8bit"), model_config=PAGEABLE)
    if optimizer == "paged-adamw-8bit":
        assert (resident.categories["optimizer_states"] - traced.categories["optimizer_states"]
                == 2 * PAGED_ELEMENTS)  # 131,072 and 102,400 bytes are multiples of 512
    assert traced.peak_allocated < resident.peak_allocated + 512 * 64


def test_paged_adamw_keeps_small_tensors_in_torch():
    traced, predicted = both(PAGEABLE, optimizer="paged-adamw")
    # under 1e5 elements: fp32 exp_avg and exp_avg_sq as torch tensors, each rounded to
    # 512 B. Per layer q, o (4096 elements): 2 x 2 x 16,384; k, v (2048): 2 x 2 x 8,192;
    # two norms (64): 2 x 2 x 512; so 100,352 per layer, x 2, + the final norm's 2 x 512
    assert traced.categories["optimizer_states"] == 2 * 100_352 + 1024
    # the formula counts bytes, not 512-byte blocks: the norms' 256 B states round up
    assert predicted.categories["optimizer_states"] == 2 * 100_352 + 1024 - 5 * 2 * 256


# --- activation offload (torchtune's OffloadActivations) ------------------------------------


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_offload_under_checkpointing_frees_exactly_the_block_inputs(checkpointing):
    plain_trace, plain_formula = both(checkpointing=checkpointing)
    off_trace, off_formula = both(checkpointing=checkpointing, activation_offload=True)
    # the hooks see each checkpointed block's input (selective's kept outputs sit in its own
    # cache): 2 blocks x fp32 residual (bf16-mixed) 2 x 64 x 64 x 4 bytes leave the GPU
    inputs = 2 * 2 * 64 * 64 * 4
    assert (plain_trace.phase_peaks["forward"] - off_trace.phase_peaks["forward"]
            == plain_formula.phase_peaks["forward"] - off_formula.phase_peaks["forward"]
            == inputs)
    assert any("host memory" in note for note in off_trace.notes)


def test_offload_without_checkpointing_keeps_only_small_tensors_and_the_stash():
    job = Job(**TINY, activation_offload=True)
    result = run_trace(job, model_config=LLAMA)
    backward = next(i for i, step, phase in sorted(result.marks)
                    if step == STEPS and phase == "backward")
    left = [r for r in _live_at(result.events, backward - 1)
            if r.step == STEPS and r.phase == "forward" and ".layers." in r.module]
    # what stays of the blocks: tensors under 1 KiB (the norms' rsqrt, 2 x 64 x 4 bytes) and
    # the last block's output, which the final norm saves among the last 5 packed tensors
    assert sorted((r.module, r.nbytes) for r in left if r.nbytes >= 1024) == [
        ("model.layers.1", 2 * 64 * 64 * 4)]
    assert all(r.nbytes == 2 * 64 * 4 for r in left if r.nbytes < 1024)


@pytest.mark.slow  # three traces; make test on 2 cores neared 10 min: `pytest -m slow`
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_formula_matches_trace_with_activation_offload(checkpointing):
    job = Job(model="qwen2.5-0.5b", batch_size=1, seq_len=512, peft=Peft(),
              checkpointing=checkpointing, activation_offload=True)
    traced, predicted = trace(job), estimate(job)
    # measured on this code: forward 0.19 / 0.29 / 0.24 %, peak 0.09 / 0.01 / 0.01 %
    assert predicted.phase_peaks["forward"] == pytest.approx(traced.phase_peaks["forward"],
                                                             rel=0.004)
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=0.002)


# --- optimizer and parameter offload --------------------------------------------------------


def test_offloaded_optimizer_leaves_no_state_or_step_on_the_gpu():
    kept, offloaded = both(), both(offload={"optimizer": True})
    assert offloaded[0].categories["optimizer_states"] == 0
    assert kept[0].categories["optimizer_states"] > 0
    assert offloaded[0].phase_peaks["optimizer"] < kept[0].phase_peaks["optimizer"]
    note = next(n for n in offloaded[0].notes if n.startswith("host memory"))
    # fp32 AdamW: two states of 4 bytes for each of the tiny model's 106,816 parameters
    host_mib = float(note.split("at most ")[1].split(" MiB")[0].replace(",", ""))
    assert host_mib >= 8 * 106_816 / 2**20


def test_formula_matches_trace_with_optimizer_offload():
    job = Job(model="qwen2.5-0.5b", batch_size=1, seq_len=256, offload={"optimizer": True})
    traced, predicted = trace(job), estimate(job)
    assert traced.categories["optimizer_states"] == predicted.categories["optimizer_states"] == 0
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=1e-4)


@pytest.mark.slow  # over 10 s on 2 cores: `pytest -m slow` runs it
def test_offloaded_parameters_leave_the_sharded_weights_and_gradients_on_the_host():
    fsdp = dict(model="qwen2.5-0.5b", batch_size=1, seq_len=256,
                parallel={"strategy": "fsdp", "num_gpus": 4})
    optimizer_only = trace(Job(**fsdp, offload={"optimizer": True}))
    both_off = trace(Job(**fsdp, offload={"optimizer": True, "params": True}))
    formula = estimate(Job(**fsdp, offload={"optimizer": True}))
    # the sharded parameters (a quarter of the fp32 model) leave the GPU: the formula's
    # per-GPU weights
    moved = optimizer_only.categories["weights"] - both_off.categories["weights"]
    assert moved == pytest.approx(formula.categories["weights"], rel=1e-4)
    assert both_off.categories["gradients"] == 0


def test_trace_refuses_parameter_offload_without_optimizer_offload():
    job = Job(**TINY, parallel={"strategy": "fsdp", "num_gpus": 2}, offload={"params": True})
    with pytest.raises(EngineError, match="set offload.optimizer too"):
        trace(job, model_config=LLAMA)
