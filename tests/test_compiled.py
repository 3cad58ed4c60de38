"""Eager versus compiled: the tensors a step saves for backward (vramplan/training/compiled.py),
on real CPU tensors of tiny models."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

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
