"""How much of a GPU's best matmul rate the step's own matmul shapes reach.

A GEMM of M x K @ K x N runs as output tiles spread over the streaming multiprocessors:

  * tile and wave quantisation: ceil(M/tm) x ceil(N/tn) tiles run in whole waves of
    `sm_count` tiles, so a last, partly filled wave costs a full one (the better of
    128 x 256 tiles and 128 x 128 tiles at 0.9 of their rate, as cuBLAS picks);
  * the reduction length: each tile pays a fixed prologue and epilogue, worth `k0` steps
    of K, so time grows as (K + k0) / K (a fixed time: more steps of K the faster the SM);
  * split-K: a GEMM with too few tiles to fill the SMs and a long K splits K into S parts
    (each at least SPLIT_MIN_K long), S x the tiles in the waves, each part paying its own
    k0, and one more launch adds the parts (cuBLAS's split-K / stream-K kernels);
  * a fixed cost per GEMM (`overhead_us`: launch ramp and tail on the device).

The constants are checked on measured GEMM rates by shape (benchmarks/data/gemm_xla.csv,
OpenXLA's table: 375 shapes from 256 to 4096 per side each; benchmarks/gemm_shape_fit.py,
which also refits them). On the H100's bf16, where k0 was set: median |error| 6.9%, p90
19.9% (without split-K, whose misses were the few-tile, long-K shapes, 9.8% / 39.4% on
its 148-shape subset). k0 grows with the GPU's dense peak per SM for the dtype where it
exceeds the H100's bf16 (efficiency.gemm_model): out of sample, the B200's bf16 8.8% / 19.0%
and fp8 14.8% / 29.6% (12.5% / 33.5% and 33.3% / 62.2% unscaled). The result is relative to
the reference
shape at which a GPU's best rate (MAMF, efficiency.toml) was measured, so a large square
GEMM has a factor near 1 and a batch-1 LoRA GEMM of rank 16 one near 0.1.

Each GEMM of a step is counted in its three passes (forward M x N x K, input gradient
M x K x N, weight gradient K x N x M), with tensor parallelism's split of N (column-
parallel: q/k/v, up/gate) or K (row-parallel: o, down) and a MoE expert's share of tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from vramplan.engines.step import Step, describe_step
from vramplan.job import Job
from vramplan.models import Architecture

COLUMN_PARALLEL = {"attn_in", "mlp_in", "shared_in", "cross_q", "cross_kv", "attn_latent"}
ROW_PARALLEL = {"attn_out", "mlp_out", "shared_out", "cross_out"}
REFERENCE = (8192, 8192, 4096)  # a large, aligned GEMM: the shape class MAMF is measured on


@dataclass(frozen=True)
class GemmModel:
    k0: float            # reduction steps' worth of fixed work per output tile
    overhead_us: float   # fixed device time per GEMM
    tile: tuple[int, int] = (128, 256)


SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)  # the K splits tried (cuBLAS's split-K heuristics)
SPLIT_MIN_K = 128                     # no part shorter than one 128-deep K block chain


def _filled(m: float, n: float, splits: int, sms: int | None, tile: tuple[int, int]) -> float:
    """The share of the waves' SM slots the tiles (x the K splits) fill."""
    if not sms:
        return 1.0
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1]) * splits
    return tiles / (math.ceil(tiles / sms) * sms)


def gemm_seconds(m: float, n: float, k: float, rate: float, model: GemmModel,
                 sms: int | None) -> float:
    """Time of one m x k @ k x n GEMM at `rate` FLOP/s for the reference shape: the best
    tile shape and K split (each part's reduction ramp its own; a split adds the launch
    that sums the parts)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    ref_ramp = REFERENCE[2] / (REFERENCE[2] + model.k0)
    best = math.inf
    for splits in SPLITS if sms else (1,):
        part = k / splits
        if splits > 1 and part < SPLIT_MIN_K:
            break
        ramp = min(part / (part + model.k0) / ref_ramp, 1.0)
        filled = max(_filled(m, n, splits, sms, model.tile),
                     0.9 * _filled(m, n, splits, sms, (128, 128)))
        launches = 2 if splits > 1 else 1
        best = min(best, flops / (rate * filled * ramp) + launches * model.overhead_us * 1e-6)
    return best


def experts_reached(routed: int, experts: int) -> float:
    """How many of `experts` receive at least one of `routed` token-to-expert assignments,
    expected under balanced routing: experts x (1 - (1 - 1/experts)^routed). 48 tokens of
    DeepSeek-V3 (8 of 256 experts each) reach 199 experts with 1.9 tokens each; before, every
    expert was given floor(48 x 8 / 256) = 1 token, so twice the tokens timed faster."""
    return experts * -math.expm1(routed * math.log1p(-1 / experts))


def shapes(job: Job, arch: Architecture, step: Step | None = None
           ) -> list[tuple[float, int, int, float]]:
    """(m, n, k, copies per step per GPU) of every linear GEMM of one micro-batch's forward;
    the backward's input- and weight-gradient GEMMs are derived from them. Each stack's
    tokens are the step description's (an encoder's, a decoder's target, a ViT's patches)."""
    par = job.parallel
    tp = par.tensor_parallel
    stack_seq = (step or describe_step(job, arch)).shapes.stack_seq
    out: list[tuple[int, int, int, float]] = []
    lora = job.peft.rank if job.peft is not None else 0
    targets = set(job.peft.target_modules) if job.peft is not None else set()
    tokens = 1
    for stack, seq in zip(arch.stacks, stack_seq):
        tokens = max(1, job.batch_size * seq // par.context_parallel)
        for ln in stack.linears:
            m, runs = float(tokens), float(ln.count)
            if ln.count > 1 and stack.num_experts > 1:
                # each expert that gets tokens runs its own GEMM over its share of them
                routed = tokens * stack.experts_per_token
                runs = experts_reached(routed, ln.count)
                m = routed / runs
            n, k = ln.out_features, ln.in_features
            if ln.role in COLUMN_PARALLEL:
                n = max(1, n // tp)
            elif ln.role in ROW_PARALLEL:
                k = max(1, k // tp)
            copies = stack.num_layers * runs
            out.append((m, n, k, copies))
            if lora and ln.name in targets:
                out.append((m, lora, k, copies))   # x @ A
                out.append((m, n, lora, copies))   # (x A) @ B
    if arch.vocab_size:  # the head reads the last stack's tokens
        h = arch.stacks[-1].hidden_size if arch.stacks else 0
        out.append((tokens, max(1, arch.vocab_size // tp), h, 1.0))
    return out


def shape_efficiency(job: Job, arch: Architecture, model: GemmModel, sms: int | None,
                     rate: float, step: Step | None = None) -> float:
    """The FLOP-weighted share of the reference GEMM rate (`rate`, FLOP/s) the step's
    linears reach, in (0, 1]."""
    return _efficiency(tuple(shapes(job, arch, step)), job.peft is None, model, sms, rate)


@functools.lru_cache(maxsize=4096)
def _efficiency(gemms: tuple[tuple[float, int, int, float], ...], trains_weights: bool,
                model: GemmModel, sms: int | None, rate: float) -> float:
    """shape_efficiency of a list of GEMMs, memoised: the planner's jobs that differ only in
    checkpointing or accumulation share their shapes on every GPU type."""
    flops = seconds = 0.0
    for m, n, k, copies in gemms:
        passes = [(m, n, k), (m, k, n)] + ([(k, n, m)] if trains_weights else [])
        for a, b, c in passes:
            flops += copies * 2.0 * a * b * c
            seconds += copies * gemm_seconds(a, b, c, rate, model, sms)
    if not flops or not seconds:
        return 1.0
    return min(1.0, flops / (seconds * rate))
