"""How fast a fused attention kernel runs at a step's own shape (sequence length, head size,
causal mask) beside the reference shape its rate is quoted at (efficiency.toml
[attention_shape]): with a causal mask FlashAttention-2 at 512 tokens runs 0.56-0.71x its
16k-token rate (backward, forward), so one rate for every job overstates short sequences."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from vramplan.engines.step import Step
from vramplan.planning.efficiency import attention_shape_table
from vramplan.planning.flops import CAUSAL_TILE


@dataclass(frozen=True)
class ShapeRates:
    """A kernel's rate at the step's shape over its rate at the reference, per executed
    FLOP: `forward` for the forward and its recomputation, `backward` for the backward."""

    forward: float = 1.0
    backward: float = 1.0
    note: str = ""


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """ys at x, linear in log2(x) between the points, the nearest point outside them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            t = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + t * (y1 - y0)
    raise AssertionError("unreachable: x is inside the points")


def _executed(seq: float) -> float:
    """Executed FLOPs of a causal kernel over the mask's half (flops.py's whole diagonal
    tiles): a published causal rate times this is the rate per executed FLOP."""
    return 1 + CAUSAL_TILE / seq if seq > CAUSAL_TILE else 2.0


def _rate(curves: dict, seqs: list[int], direction: str, seq: float, head_dim: float,
          causal: bool) -> float:
    """TFLOP/s per executed FLOP at (seq, head_dim), interpolated over the head sizes too."""
    def at(dim: int) -> float:
        plain = _interpolate(seqs, curves[f"{direction}_{dim}"], seq)
        if not causal:
            return plain
        if direction == "forward":
            return _interpolate(seqs, curves[f"forward_causal_{dim}"], seq) * _executed(seq)
        # no causal backward measured: the forward's causal / non-causal ratio carries over
        forward = _interpolate(seqs, curves[f"forward_{dim}"], seq)
        causal_forward = _interpolate(seqs, curves[f"forward_causal_{dim}"], seq)
        return plain * causal_forward * _executed(seq) / forward
    return _interpolate([64, 128], [at(64), at(128)], head_dim)


@functools.lru_cache(maxsize=256)
def shape_rates(kernel: str, seq: int, head_dim: int, causal: bool) -> ShapeRates:
    """`kernel`'s (attention_kernel's name) rates at this shape over the reference's; 1 for
    a kernel without measured curves."""
    table = attention_shape_table()
    curves = table.get(kernel)
    if curves is None:
        return ShapeRates()
    seqs, ref = table["seq"], table["reference"]
    rates = [_rate(curves, seqs, d, seq, head_dim, causal)
             / _rate(curves, seqs, d, ref["seq"], ref["head_dim"], ref["causal"])
             for d in ("forward", "backward")]
    note = ""
    if min(rates) < 0.9 or max(rates) > 1.1:
        mask = "causal" if causal else "no mask"
        note = (f"attention at {seq} tokens, head size {head_dim}, {mask}: {kernel} runs "
                f"{rates[0]:.2f}x (forward) and {rates[1]:.2f}x (backward) its rate at "
                f"{ref['seq']} tokens, head size {ref['head_dim']}, causal (efficiency.toml "
                "[attention_shape]")
        if seq < seqs[0]:
            note += f"; below {seqs[0]} tokens, the fewest measured, at {seqs[0]}'s rate"
        note += ")"
    return ShapeRates(*rates, note)


def step_shape_rates(kernel: str, step: Step) -> ShapeRates:
    """The rates of the step's first stack's self-attention (the one flops.py times with a
    causal mask in a decoder), per context-parallel rank's share of the sequence."""
    arch, job = step.arch, step.job
    if not arch.stacks:
        return ShapeRates()
    stack = arch.stacks[0]
    mla = stack.latent_attention
    head_dim = mla.qk_head_dim if mla else stack.head_dim
    seq = max(1, step.shapes.stack_seq[0] // job.parallel.context_parallel)
    causal = stack.role == "decoder" and arch.kind != "vision"
    return shape_rates(kernel, seq, head_dim, causal)
