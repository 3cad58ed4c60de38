"""The formula's model of a compiled step (engines/activations.py
compiled_block_saved_tensors, formula/loss.py loss_buffers) against the trace, which compiles the
real model (training/compiled.py)."""

import pytest
from tiny_configs import LLAMA

from vramplan.api import estimate
from vramplan.engines import activations as act
from vramplan.engines import step as step_desc
from vramplan.engines.formula import loss
from vramplan.engines.precision import dtypes_for
from vramplan.errors import JobError
from vramplan.job import Job, Peft
from vramplan.models import load_architecture


def test_compiled_llama_block_saves_what_the_partitioner_keeps():
    stack = load_architecture("llama-3.2-1b").stacks[0]
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=512, compile=True)
    saved = act.compiled_block_saved_tensors(stack, act.BlockShape(2, 512), dtypes_for(job))
    tokens, h, f, q, kv = 2 * 512, 2048, 8192, 32 * 64, 8 * 64
    # the fp32 block input; an fp32 rsqrt per token for each of the 2 norms; in bf16 the
    # attention norm's output, q and k after rotation and v, sdpa's output, the out
    # projection's output, the MLP norm's output, gate's and up's outputs and their
    # product; sdpa's fp32 log-sum-exp per head and token
    expected = tokens * (4 * h + 2 * 4 + 2 * h + 2 * (q + 2 * kv) + 2 * q + 2 * h + 2 * h
                         + 3 * 2 * f + 4 * 32)
    assert sum(b for _, b in saved) == expected


def _lora_block_bytes(peft: Peft) -> int:
    """Bytes a compiled Llama-3.2-1B block saves for LoRA `peft` (fp32 adapters,
    bf16-mixed, batch 2 x 512)."""
    from vramplan.engines.step import activation_dtypes

    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=512, compile=True, peft=peft)
    adapters = act.Adapters(frozenset(peft.target_modules), peft.rank, peft.dropout,
                            base_trainable=False)
    saved = act.compiled_block_saved_tensors(load_architecture(job.model).stacks[0],
                                             act.BlockShape(2, 512), activation_dtypes(job),
                                             adapters, fp32_adapters=True)
    return sum(b for _, b in saved)


def test_compiled_lora_block_saves_what_the_adapters_need():
    tokens, h, f, q, kv = 2 * 512, 2048, 8192, 32 * 64, 8 * 64
    # the frozen base keeps the residual stream in bf16: the block input; 2 fp32 rsqrt; q, k
    # (rotated), v; sdpa's output and fp32 log-sum-exp; the residual rebuild; gate's and
    # up's outputs; the attention norm's output (read by the q, k, v adapters); the out
    # projection's input cast for its fp32 adapter; 4 adapters' A outputs of rank 16
    expected = tokens * (2 * h + 2 * 4 + 2 * (q + 2 * kv) + 2 * q + 4 * 32 + 2 * h + 2 * 2 * f
                         + 2 * h + 2 * q + 4 * 2 * 16)
    assert _lora_block_bytes(Peft(rank=16, dropout=0.0)) == expected  # q, k, v, o adapters


def test_compiled_lora_dropout_keeps_each_adapters_input_and_mask():
    tokens, h, f, q, kv = 2 * 512, 2048, 8192, 32 * 64, 8 * 64
    # what every block keeps (as without adapters' inputs), the 3 adapters' A outputs, then
    # per adapter its dropped-out bf16 input and 1-byte mask: q_proj reads the hidden
    # state, o_proj the merged heads, down_proj gate * up; no shared norm output or cast
    expected = tokens * (2 * h + 2 * 4 + 2 * (q + 2 * kv) + 2 * q + 4 * 32 + 2 * h + 2 * 2 * f
                         + 3 * 2 * 16 + 3 * h + 3 * q + 3 * f)
    assert _lora_block_bytes(Peft(rank=16, dropout=0.1, target_modules=(
        "q_proj", "o_proj", "down_proj"))) == expected


@pytest.mark.parametrize("precision, c", [("bf16-mixed", 2), ("fp32", 4)])
def test_compiled_loss_keeps_the_logits_and_two_floats_per_token(precision, c):

    job = Job(model="llama-3.2-1b", batch_size=4, seq_len=256, precision=precision,
              compile=True)
    arch = load_architecture(job.model)
    shapes = step_desc.shapes_of(job, arch, "causal-lm")
    forward, backward = loss.loss_buffers(job, arch, shapes, step_desc.activation_dtypes(job),
                                              "causal-lm")
    t = 4 * 256  # logits for every position (the last one's label is ignored, not cut)
    tv = t * 128256
    # forward: the logits in the compute dtype, the max and log-sum-exp in fp32 per token;
    # backward: the logits' gradient beside the saved logits
    assert (forward, backward) == (c * tv + 8 * t, 2 * c * tv + 8 * t)


pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module
import vramplan.engines.trace as trace_module  # noqa: E402


@pytest.mark.slow  # ten compiled traces; make test on 2 cores neared 10 min: `pytest -m slow`
@pytest.mark.parametrize("fields", [
    dict(precision="bf16-mixed"), dict(precision="fp32"), dict(precision="bf16-pure"),
    dict(precision="bf16-mixed", checkpointing="full"), dict(optimizer="sgd"),
    dict(checkpointing="selective"), dict(checkpointing="selective:torchtitan-op"),
    dict(peft=Peft(rank=8, dropout=0.0)), dict(peft=Peft(rank=8, dropout=0.1)),
    dict(precision="bf16-pure", peft=Peft(rank=8, dropout=0.0, target_modules=("all-linear",))),
], ids=["bf16-mixed", "fp32", "bf16-pure", "full-checkpointing", "sgd", "selective",
        "torchtitan-op-sac", "lora-attention", "lora-dropout",
        "lora-all-linear-bf16-pure"])
def test_formula_follows_the_compiled_trace(fields):
    # four blocks: the first block of a LoRA model saves less (nothing below it trains), a
    # share the formula does not model that shrinks with depth
    config = dict(LLAMA, num_hidden_layers=4)
    job = Job(model="x", batch_size=8, seq_len=256, compile=True, **fields)
    predicted = estimate(job, model_config=config)
    traced = trace_module.trace(job, model_config=config)
    for phase in ("forward", "backward"):
        assert predicted.phase_peaks[phase] == pytest.approx(traced.phase_peaks[phase],
                                                             rel=0.01), phase
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=0.01)


@pytest.mark.parametrize("loss", ["chunked:torchtune-linear", "chunked:torchtune-output"])
def test_torchtune_chunked_losses_compiled_follow_the_trace(loss):
    # torchtune compiles each chunk's projection and cross-entropy (or the cross-entropy
    # of each returned logits chunk): the chunks' 16-bit logits stay, no fp32 log-probs
    config = dict(LLAMA, num_hidden_layers=4)
    job = Job(model="x", batch_size=8, seq_len=256, compile=True, loss=loss)
    predicted = estimate(job, model_config=config)
    traced = trace_module.trace(job, model_config=config)
    for phase in ("forward", "backward"):
        assert predicted.phase_peaks[phase] == pytest.approx(traced.phase_peaks[phase],
                                                             rel=0.01), phase


@pytest.mark.parametrize("fields, reason", [
    (dict(peft=Peft(method="qlora", rank=8, dropout=0.0)), "qlora"),
    (dict(attention="eager"), "eager attention"),
])
def test_formula_sends_what_it_does_not_model_to_the_trace(fields, reason):
    with pytest.raises(JobError, match=f"{reason}.*use --engine trace"):
        estimate(Job(model="llama-3.2-1b", compile=True, **fields))


def test_formula_refuses_compiled_gpt2_blocks():
    with pytest.raises(JobError, match="layernorm, a gelu MLP.*use --engine trace"):
        estimate(Job(model="gpt2", compile=True))


def test_compiled_block_streams_each_tensor_once():
    from vramplan.planning.traffic import _block_forward

    arch = load_architecture("llama-3.2-1b")
    stack = arch.stacks[0]
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=512, compile=True)
    ops, _, kernels = _block_forward(job, arch, stack, 512, dtypes_for(job), "sdpa")
    tokens, h, q, kv, f = 1024, 2048, 2048, 512, 8192
    # 2 norms: read the fp32 residual, write bf16; rotary: read and write q and k in bf16;
    # sdpa: read q, k, v, write o; 2 residual adds: read 2, write 1 in fp32; act(gate) *
    # up: read 2, write 1 in bf16
    assert ops == {"norm": 2 * tokens * h * (4 + 2), "rotary": 2 * 2 * tokens * (q + kv),
                   "attention io": 2 * tokens * (2 * q + 2 * kv),
                   "residual": 2 * 3 * 4 * tokens * h, "activation": 3 * 2 * tokens * f}
    assert kernels == 2 + 1 + 1 + 2 + 1
    eager, _, _ = _block_forward(job.model_copy(update={"compile": False}), arch, stack, 512,
                              dtypes_for(job), "sdpa")
    assert sum(ops.values()) < sum(eager.values())


# --- what is compiled: compile_components (torchtitan's compile.components) ----------------

LLM_VOCAB = 128256  # Llama-3's vocabulary: the logits decide the peak


def _loss_buffers(**fields):

    job = Job(model="llama-3.2-1b", batch_size=1, seq_len=2048, compile=True, **fields)
    arch = load_architecture(job.model)
    return loss.loss_buffers(job, arch, step_desc.shapes_of(job, arch, "causal-lm"),
                                 step_desc.activation_dtypes(job), "causal-lm")


def test_compiling_the_blocks_only_leaves_the_eager_loss():
    t, tv = 2048, 2048 * LLM_VOCAB
    # eager (bf16-mixed): forward keeps the bf16 logits, their fp32 copy and the fp32
    # log-softmax; backward starts with that and two fp32 gradients. Compiled: the logits
    # and two fp32 values per token; backward adds one bf16 gradient
    assert _loss_buffers(compile_components="blocks") == (10 * tv, 12 * tv)
    assert _loss_buffers(compile_components="blocks+loss") == (2 * tv + 8 * t, 4 * tv + 8 * t)
    assert _loss_buffers(compile_components="loss") == (2 * tv + 8 * t, 4 * tv + 8 * t)


def test_compile_flag_alone_keeps_its_meaning():
    job = Job(model="llama-3.2-1b", compile=True)
    assert (job.compile_components, job.compiles_blocks, job.compiles_loss) == (
        "blocks+loss", True, True)
    assert not Job(model="llama-3.2-1b", compile_components="blocks").compiles_blocks


def test_compiling_the_loss_only_models_blocks_the_formula_cannot_compile():
    # QLoRA and GPT-2 blocks stay eager; the compiled loss is still modelled
    for fields in (dict(model="gpt2"), dict(peft=Peft(method="qlora"))):
        job = Job(**{"model": "llama-3.2-1b", **fields}, compile=True,
                  compile_components="loss")
        eager = Job(**{"model": "llama-3.2-1b", **fields})
        assert estimate(job).peak_allocated < estimate(eager).peak_allocated
    with pytest.raises(JobError, match="qlora"):
        estimate(Job(model="llama-3.2-1b", compile=True, peft=Peft(method="qlora")))


def test_hf_trainer_compiles_the_whole_model():
    with pytest.raises(JobError, match="hf-trainer does not support compile_components"):
        Job(framework="hf-trainer", compile=True, compile_components="blocks")
    assert Job(framework="torchtitan", compile=True, compile_components="blocks").compile


@pytest.mark.slow
@pytest.mark.parametrize("components", ["blocks+loss", "blocks", "loss"])
def test_components_at_an_llm_vocabulary_follow_the_trace(components):
    # a narrow model with Llama-3's vocabulary at 2k tokens: the loss decides the peak
    config = dict(LLAMA, vocab_size=LLM_VOCAB, max_position_embeddings=4096)
    job = Job(model="x", batch_size=1, seq_len=2048, compile=True,
              compile_components=components)
    predicted, traced = estimate(job, model_config=config), trace_module.trace(
        job, model_config=config)
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=0.001)
    t, tv = 2048, 2048 * LLM_VOCAB
    blocks_only = job.model_copy(update={"compile_components": "blocks"})
    # at backward's start the eager loss holds 12 bytes per logit, the compiled one 4 and
    # 8 per token: 8 tv - 8 t apart in the formula; the trace agrees within 0.01% (both
    # engines peak there). Compiling the loss only also leaves the blocks eager.
    expected = 0 if components == "blocks" else 8 * tv - 8 * t
    formula_saved = (estimate(blocks_only, model_config=config).peak_allocated
                     - predicted.peak_allocated)
    if components != "loss":
        assert formula_saved == expected
    traced_saved = (trace_module.trace(blocks_only, model_config=config).peak_allocated
                    - traced.peak_allocated)
    assert traced_saved == pytest.approx(formula_saved, rel=1e-4, abs=1)


@pytest.mark.slow
def test_own_chunked_loss_stays_eager_under_compile():
    # vramplan's chunked loss checkpoints each chunk and is not compiled: the trace runs it
    # eagerly beside the compiled blocks, and the formula now models that job
    config = dict(LLAMA, num_hidden_layers=4)
    job = Job(model="x", batch_size=8, seq_len=256, compile=True, loss="chunked")
    predicted = estimate(job, model_config=config)
    traced = trace_module.trace(job, model_config=config)
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=0.01)


def test_compiled_fp8_block_keeps_neither_norm_outputs_nor_the_gated_product():
    stack = load_architecture("llama-3.2-1b").stacks[0]
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=512, compile=True, precision="fp8")
    saved = act.compiled_block_saved_tensors(stack, act.BlockShape(2, 512), dtypes_for(job),
                                             fp8_recipe="tensorwise")
    tokens, h, f, q, kv = 2 * 512, 2048, 8192, 32 * 64, 8 * 64
    # as in bf16 (the test above) less what the weight gradients read only through a
    # float8 cast that backward recomputes: the two norms' outputs and gate * up; plus the
    # out projection's input cast to float8 (1 byte), which is kept
    expected = tokens * (4 * h + 2 * 4 + 2 * (q + 2 * kv) + 2 * q + 2 * h + 2 * 2 * f
                         + 4 * 32 + q)
    assert sum(b for _, b in saved) == expected


def test_compiled_gw_hp_block_keeps_gate_times_up_for_its_16_bit_weight_gradient():
    stack = load_architecture("llama-3.2-1b").stacks[0]
    job = Job(model="llama-3.2-1b", batch_size=2, seq_len=512, compile=True, precision="fp8",
              fp8={"recipe": "rowwise_with_gw_hp"})
    shape, dt = act.BlockShape(2, 512), dtypes_for(job)
    gw_hp = act.compiled_block_saved_tensors(stack, shape, dt, fp8_recipe="rowwise_with_gw_hp")
    rowwise = act.compiled_block_saved_tensors(stack, shape, dt, fp8_recipe="rowwise")
    tokens, f = 2 * 512, 8192
    q = 32 * 64  # rowwise's kept float8 cast of the out projection's input goes
    assert sum(b for _, b in gw_hp) - sum(b for _, b in rowwise) == tokens * (2 * f - q)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_formula_follows_the_compiled_fp8_trace(recipe):
    # the trace compiles torchao's Float8Linear on fake tensors with Inductor's partitioner
    # (its peak within 0.3% of CPU Inductor's where the CPU kernel adds no copies:
    # benchmarks/compile_accuracy.py)
    config = dict(LLAMA, num_hidden_layers=4)
    job = Job(model="x", batch_size=8, seq_len=256, compile=True, precision="fp8",
              fp8={"recipe": recipe})
    predicted = estimate(job, model_config=config)
    traced = trace_module.trace(job, model_config=config)
    for phase in ("forward", "backward"):
        assert predicted.phase_peaks[phase] == pytest.approx(traced.phase_peaks[phase],
                                                             rel=0.01), phase
    assert any("torchao" in note for note in traced.notes)


def test_compiled_mxfp8_blocks_are_refused_by_both_engines():
    job = Job(model="x", batch_size=2, seq_len=128, precision="fp8", compile=True,
              fp8={"recipe": "mxfp8"})
    with pytest.raises(JobError, match="compiled blocks with fp8 recipe mxfp8 are not modelled"):
        estimate(job, model_config=dict(LLAMA))
    from vramplan.errors import EngineError

    with pytest.raises(EngineError, match="compiled blocks with fp8 recipe mxfp8"):
        trace_module.trace(job, model_config=dict(LLAMA))


def test_formula_sends_compiled_fp8_adapters_to_the_trace():
    job = Job(model="x", batch_size=2, seq_len=128, precision="fp8", compile=True,
              peft=Peft(rank=8, dropout=0.0))
    with pytest.raises(JobError, match="fp8 with adapters.*use --engine trace"):
        estimate(job, model_config=dict(LLAMA))


def test_fp8_with_the_loss_compiled_follows_the_trace():
    job = Job(model="x", batch_size=2, seq_len=128, precision="fp8", compile=True,
              compile_components="loss")
    predicted = estimate(job, model_config=dict(LLAMA))
    traced = trace_module.trace(job, model_config=dict(LLAMA))
    assert predicted.peak_allocated == pytest.approx(traced.peak_allocated, rel=0.01)
