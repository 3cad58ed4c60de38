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
from vramplan.planning.flops import causal_tile_fraction


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
    return 2 * causal_tile_fraction(seq)


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


def _note(kernel: str, shape: str, rates: tuple[float, float], below: int | None) -> str:
    """The report's line where a rate is more than 10% off the reference's."""
    if 0.9 <= min(rates) and max(rates) <= 1.1:
        return ""
    ref = attention_shape_table()["reference"]
    note = (f"attention at {shape}: {kernel} runs {rates[0]:.2f}x (forward) and "
            f"{rates[1]:.2f}x (backward) its rate at {ref['seq']} tokens, head size "
            f"{ref['head_dim']}, causal (efficiency.toml [attention_shape]")
    if below is not None:
        note += f"; below {below} tokens, the fewest measured, at {below}'s rate"
    return note + ")"


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
    shape = f"{seq} tokens, head size {head_dim}, {'causal' if causal else 'no mask'}"
    return ShapeRates(*rates, _note(kernel, shape, rates, seqs[0] if seq < seqs[0] else None))


@functools.lru_cache(maxsize=256)
def ring_rates(kernel: str, seq: int, ranks: int, head_dim: int) -> ShapeRates:
    """A causal attention split over `ranks` context-parallel ranks (ring attention: torch's
    context_parallel, Megatron's): each rank runs one causal call over its own chunk of the
    sequence and unmasked calls against the other ranks' chunks (the ones a causal mask
    leaves whole; the rest are skipped). Of the rank's executed FLOPs (flops.py's count / ranks)
    the causal call's share is (1 + 128 / local) / (1 + 128 / seq) / ranks."""
    local = max(1, seq // ranks)
    causal, plain = shape_rates(kernel, local, head_dim, True), shape_rates(
        kernel, local, head_dim, False)
    share = min(1.0, _executed(local) / _executed(seq) / ranks)
    rates = [1 / (share / getattr(causal, d) + (1 - share) / getattr(plain, d))
             for d in ("forward", "backward")]
    shape = (f"{local} tokens a rank of {ranks} (ring attention: {1 - share:.0%} of its FLOPs "
             f"unmasked), head size {head_dim}")
    below = attention_shape_table()["seq"][0]
    return ShapeRates(*rates, _note(kernel, shape, rates, below if local < below else None))


def step_shape_rates(kernel: str, step: Step) -> ShapeRates:
    """The rates of the step's first stack's self-attention (the one flops.py times with a
    causal mask in a decoder); a causal one split over context-parallel ranks as
    ring_rates runs it."""
    arch, job = step.arch, step.job
    if not arch.stacks:
        return ShapeRates()
    stack = arch.stacks[0]
    mla = stack.latent_attention
    head_dim = mla.qk_head_dim if mla else stack.head_dim
    seq, ranks = step.shapes.stack_seq[0], job.parallel.context_parallel
    causal = stack.role == "decoder" and arch.kind != "vision"
    if ranks > 1 and causal:
        return ring_rates(kernel, seq, ranks, head_dim)
    return shape_rates(kernel, max(1, seq // ranks), head_dim, causal)
