"""The trace runs the named checkpointing policies, kept gradients and adapter dtypes the
way the formula models them (tests/frameworks/test_frameworks.py pins the formula's arithmetic)."""

import pytest

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module

from vramplan import Job, Peft  # noqa: E402
from vramplan.engines.formula import estimate  # noqa: E402
from vramplan.engines.trace import trace  # noqa: E402

BASE = dict(model="qwen2.5-0.5b", batch_size=1, seq_len=256)


@pytest.mark.parametrize("fields", [
    dict(checkpointing="selective:torchtitan-op"),
    dict(checkpointing="selective:every-2nd-layer"),
    dict(checkpointing="selective:torchtitan-op", peft=Peft(target_modules=(
        "q_proj", "k_proj", "v_proj", "o_proj"))),
    dict(keep_grads_between_steps=True),
    dict(precision="bf16-pure", peft=Peft(adapter_dtype="fp32")),
    dict(precision="bf16-pure", peft=Peft(adapter_dtype="model")),
], ids=["torchtitan-op", "every-2nd-layer", "torchtitan-op-lora", "keep-grads",
        "fp32-adapters-bf16-model", "bf16-adapters"])
def test_formula_matches_trace(fields):
    job = Job(**BASE, **fields)
    traced, predicted = trace(job), estimate(job)
    # the forward's peak holds what each policy keeps (at the step's peak, the optimizer,
    # activations are gone). With LoRA the engines differ by 4 MB (0.26%) under every
    # checkpointing policy alike, full included: not a policy's doing
    assert predicted.phase_peaks["forward"] == pytest.approx(traced.phase_peaks["forward"],
                                                             rel=0.003)
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=0.005)


@pytest.mark.slow  # over 10 s on 2 cores: `pytest -m slow` runs it
def test_trace_keeps_fewer_tensors_under_the_torchtitan_op_policy():
    selective = trace(Job(**BASE, checkpointing="selective")).phase_peaks["forward"]
    op = trace(Job(**BASE, checkpointing="selective:torchtitan-op")).phase_peaks["forward"]
    # Qwen2's q, k and v projections have biases: aten.addmm, always kept and not counted.
    # The counted mms are o (1st, kept), gate (2nd, recomputed), up (3rd, kept) and down
    # (4th, recomputed): 24 layers x bf16 x 256 tokens x (gate 4864 + down 896 wide)
    dropped = 24 * 2 * 256 * (4864 + 896)
    formula = (estimate(Job(**BASE, checkpointing="selective")).phase_peaks["forward"]
               - estimate(Job(**BASE, checkpointing="selective:torchtitan-op"))
               .phase_peaks["forward"])
    assert formula == dropped
    assert selective - op == pytest.approx(dropped, rel=0.001)


@pytest.mark.parametrize("fields", [
    dict(framework="torchtune"),                                    # LinearCrossEntropyLoss
    dict(framework="torchtune", loss="chunked:torchtune-output"),   # CEWithChunkedOutputLoss
    dict(framework="torchtune", checkpointing="none"),
], ids=["torchtune", "torchtune-chunked-output", "torchtune-no-checkpointing"])
def test_torchtune_losses_match(fields):
    # Llama-3.2-1B (tied embeddings: the backward ends with both head gradients alive)
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=512, **fields)
    traced, predicted = trace(job), estimate(job)
    assert predicted.phase_peaks["forward"] == pytest.approx(traced.phase_peaks["forward"],
                                                             rel=0.002)
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=0.01)




@pytest.mark.slow  # over 10 s on 2 cores: `pytest -m slow` runs it
@pytest.mark.parametrize("optimizer", ["adamw-4bit", "adamw-fp8"])
def test_torchao_state_layouts_match(optimizer):
    full = Job(**BASE, optimizer=optimizer)
    traced, predicted = trace(full), estimate(full)
    assert predicted.categories["optimizer_states"] == pytest.approx(
        traced.categories["optimizer_states"], rel=0.001)
    # LoRA's many small tensors: the trace counts each code map and scale vector rounded up
    # to the allocator's 512-byte blocks, the formula their exact bytes
    lora = Job(**BASE, optimizer=optimizer, peft=Peft())
    assert estimate(lora).categories["optimizer_states"] == pytest.approx(
        trace(lora).categories["optimizer_states"], rel=0.06)
