"""Eager versus compiled: the tensors a step saves for backward (vramplan/training/compiled.py),
on real CPU tensors of tiny models."""

import pytest

pytestmark = pytest.mark.torch  # without torch, conftest.py does not collect this module
import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

from vramplan.training.compiled import compare_saved, saved_for_backward  # noqa: E402


class GatedMLP(nn.Module):
    """RMSNorm, then down(silu(gate(x)) * up(x)): a Llama MLP block, 64 tokens of width 256."""

    def __init__(self, hidden=256, inner=1024):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        y = self.norm(x)
        return self.down(nn.functional.silu(self.gate(y)) * self.up(y)) + x


def test_eager_saved_tensors_of_a_gated_mlp_are_what_autograd_keeps():
    torch.manual_seed(0)
    model, x = GatedMLP(), torch.randn(1, 64, 256, requires_grad=True)
    saved = saved_for_backward(lambda m: m(x).sum(), model)
    n, f = 64 * 256, 64 * 1024  # elements of a hidden-wide and an inner-wide tensor, fp32
    # x (the norm's input) and its rsqrt [1, 64, 1]; x * rsqrt (saved by the weight's
    # multiply); y, the norm's output (gate's and up's input); gate out (silu's input);
    # silu out and up out (the product's inputs); the product (down's input)
    assert saved.bytes == 4 * (3 * n + 64 + 4 * f)
    assert saved.count == 8


def test_compiled_gated_mlp_recomputes_the_elementwise_chain():
    torch.manual_seed(0)
    model, x = GatedMLP(), torch.randn(1, 64, 256, requires_grad=True)
    eager, compiled = compare_saved(model, lambda m: m(x).sum())
    # (torch 2.13) the min-cut partitioner keeps x, rsqrt, y, gate's and up's outputs and
    # the product, and recomputes x * rsqrt and silu in backward: 4 bytes x (2 hidden-wide,
    # the rsqrt and 3 inner-wide tensors)
    n, f = 64 * 256, 64 * 1024
    assert eager.bytes == 4 * (3 * n + 64 + 4 * f)
    assert compiled.bytes == 4 * (2 * n + 64 + 3 * f) and compiled.count == 6


def test_compiled_tiny_llama_saves_less_than_eager():
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 256, (2, 32))
    eager, compiled = compare_saved(model, lambda m: m(input_ids=ids, labels=ids).loss)
    assert eager.count > 0 and 0 < compiled.bytes < eager.bytes


# --- the trace engine's model of a compiled step ------------------------------------------------

def _forward_graph(model, x):
    """The AOTAutograd forward graph the trace backend runs for model(x).sum()."""
    import functools

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep,
                           decompositions=select_decomp_table(),
                           partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                          compiler="inductor"))
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x).sum().backward()
    return graphs[0]


def test_fusion_keeps_only_what_inductor_writes_to_memory():
    from vramplan.training.compiled import _kind, fused_nodes

    torch.manual_seed(0)
    graph = _forward_graph(GatedMLP(), torch.randn(1, 64, 256, requires_grad=True)).graph
    fused = fused_nodes(graph)
    written = [n for n in graph.nodes if n.op == "call_function" and n not in fused
               and _kind(n) != "view"]
    nbytes = sum(n.meta["val"].untyped_storage().nbytes() for n in written)
    n, f = 64 * 256, 64 * 1024
    # RMSNorm: the mean of squares and its rsqrt [1, 64, 1] (reductions and a saved
    # tensor), the norm's output y (the matmuls' input); gate's and up's outputs (matmuls),
    # silu(gate) * up (down's input; silu is fused into the product), down's output and
    # the residual sum (the graph's output). x^2, x * rsqrt and silu are never written.
    assert nbytes == 4 * (64 + 64 + n + 3 * f + n + n)
    assert {_kind(n) for n in fused} == {"inline"}


def test_fused_results_are_not_counted_by_the_trace():
    # the same step traced eagerly and compiled: compiling a tiny Llama's blocks and loss
    # lowers the forward peak (recomputed norms, fused upcasts, no fp32 log-probabilities)
    from tiny_configs import LLAMA

    from vramplan.engines.trace import run_trace
    from vramplan.job import Job

    fields = dict(model="x", batch_size=2, seq_len=64, precision="bf16-mixed")
    eager = run_trace(Job(**fields), model_config=dict(LLAMA))
    compiled = run_trace(Job(**fields, compile=True), model_config=dict(LLAMA))
    assert any("torch.compile: 2 blocks and the loss" in note for note in compiled.notes)
    assert compiled.peak(rounded=False)[0] < eager.peak(rounded=False)[0]
    # no storage of a fused op is in the event log
    fused_ops = {"pow", "exp", "silu", "sigmoid"}
    assert not any(r.op in fused_ops for _, r in compiled.events if r.phase == "forward"
                   and r.module.startswith("model.layers"))


@pytest.mark.slow
def test_trace_of_a_compiled_step_matches_inductor_on_the_cpu():
    # the ground truth: the same job run for real with Inductor (C++ kernels) on the CPU,
    # its peak read from the profiler's allocator events
    from tiny_configs import LLAMA

    from benchmarks.ground_truth import cpu_profiler_peak
    from vramplan.engines.trace import run_trace
    from vramplan.job import Job

    job = Job(model="x", batch_size=2, seq_len=64, precision="bf16-mixed", compile=True)
    traced = run_trace(job, model_config=dict(LLAMA)).peak(rounded=False)[0]
    assert traced == pytest.approx(cpu_profiler_peak(job, model_config=dict(LLAMA)), rel=0.005)
