"""Step-time accuracy on published training runs, leave one source out.

The runs: benchmarks/data/published_runs/ (llm-foundry, Megatron-LM, NeMo / Megatron-Bridge
tables; benchmarks/published_runs.py turns each row into a Job) and our own H200 runs
(benchmarks/results/gpu_validation.json). The performance model's training shares
(efficiency.toml [training]: matmul_share, attention_share, memory, kernel_us, overlap) are
fitted on them, so every figure is scored **leave one source out**: the shares are fitted on
the other sources and the left-out one is predicted. Our own runs, not a published source,
are scored leave one run out, with a host time per kernel of their own (OWN_HOST: the VM
they ran on is slower per kernel than the published runs' hosts). The shipped host time is
the single-GPU fit's, for every job. In-sample figures are labelled.

Also reported, on the same rows: a fixed MFU rule (tokens/s = r x dense peak / model FLOPs
per token, r = 0.35 and 0.45), and the coverage of the 80% interval (quantiles of the
other sources' out-of-sample errors, as wide as covers 80% of a source held out).

    PYTHONPATH=. python benchmarks/published_accuracy.py          # score, write results
    PYTHONPATH=. python benchmarks/published_accuracy.py --fit    # also print the shares
    PYTHONPATH=. python benchmarks/published_accuracy.py --write-interval  # ship the interval

The shipped intervals (efficiency.toml [interval]: one GPU; several GPUs training a decoder's
own weights; several GPUs training an encoder or adapters) are quantiles of their rows'
out-of-sample errors, as far out as covers 80% of each pool source's rows held out
(intervals(); the never-fitted sources test that width, never set it);
--write-interval writes this run's into efficiency.toml.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import QUICK, machine_line, results_dir  # noqa: E402
from published_runs import UNFUSED_LOSS, cases  # noqa: E402

from vramplan.engines.precision import dtypes_for  # noqa: E402
from vramplan.engines.step import describe_step  # noqa: E402
from vramplan.hardware import get_gpu  # noqa: E402
from vramplan.job import Job  # noqa: E402
from vramplan.models import load_architecture  # noqa: E402
from vramplan.planning.efficiency import (  # noqa: E402
    INTERVAL_BUCKETS,
    architecture_of,
    shipped_factors,
    takes_single_gpu_shares,
)
from vramplan.planning.performance import (  # noqa: E402
    interval_bucket_of,
    step_terms,
    step_time,
)
from vramplan.planning.traffic import (  # noqa: E402
    OPTIMIZER_STEPS,
    _trainable_tensors,
    float8_cast_bytes,
    step_traffic,
)

RESULTS = Path(__file__).parent / "results"
# llm-foundry's runs used its Triton FlashAttention kernel (attn_impl: triton, the default of
# scripts/train/benchmarking/submit_benchmarks.py at 5e85bd62d4ec). FlashAttention-2 (what
# torch's SDPA runs, and what efficiency.toml's `flash` rates are) is 1.3-2.5x faster than
# it in forward + backward on an A100 (Dao 2023, arXiv:2307.08691, section 4.1): those
# runs' attention is timed at FlashAttention-2's rate / 1.8, the middle of that range.
TRITON_ATTENTION_SLOWDOWN = 1.8
# The software stack of each source. Shares are fitted per stack: a source left out is
# predicted with the shares fitted on the other sources of its stack. vramplan's frameworks
# (HF Trainer, torchtune, torchtitan, Lightning, plain PyTorch) are eager-PyTorch stacks, so
# efficiency.toml ships the "pytorch" stack's shares; the Megatron-Core stack (Megatron-LM,
# NeMo: Transformer Engine kernels, cuDNN attention) is scored here for the hardware model.
# the software stack of each source: a fold fits only on the other sources of its stack.
# llm.c (C/CUDA kernels, no PyTorch) is closest to an eager stack of fused kernels; the
# Llama 3 paper's 4D-parallel stack is Megatron-like (TP/CP/PP with overlapped collectives).
STACK = {"llm-foundry": "pytorch", "vramplan-h200": "pytorch", "kempnerforge": "pytorch",
         "lambda-bert": "pytorch", "olmo-core": "pytorch", "flash-attention": "pytorch",
         "llm.c": "pytorch", "nvidia-bert": "pytorch", "qwen1-finetune": "pytorch",
         "answerai-fsdp-qlora": "pytorch", "vectorlm": "pytorch", "fms-fsdp": "pytorch",
         "optimum-benchmark": "pytorch",
         "megatron-lm": "megatron-core", "nemo": "megatron-core",
         "bigscience": "megatron-core", "llama3-paper": "megatron-core"}
# the sources whose fp8 is Transformer Engine's (the calibration rows say so: llm-foundry's
# "fp8 AMP (Transformer Engine) on H100", NeMo's and Megatron-Bridge's "FP8 via Transformer
# Engine"; Megatron-LM's TE layers)
TRANSFORMER_ENGINE_FP8 = ("llm-foundry", "megatron-lm", "nemo")
# the calibration set handed over with the project (shared/calibration/): issue 16's target
CALIBRATION_SET = ("llm-foundry", "megatron-lm", "nemo")
# the sources the shares are fitted on (LLM pre-training and our own runs). The other rows we
# collected came after the model was built; they are a held-out test, scored with the fit of
# their stack, never fitted on. (Fitting on them too moved the shares to the bounds: memory
# 1.0, overlap 0.15, and the calibration set's out-of-sample median from 6% to 11%, because
# fp16 BERT with eager attention and 2022's BLOOM stack are not the kernels of today's LLM
# stacks; their own figures are in the table either way.)
FITTED = (*CALIBRATION_SET, "kempnerforge", "vramplan-h200")
# single-GPU fine-tuning runs: their single-GPU rows are fitted (the single-GPU eager fit,
# stack_of), their multi-GPU rows stay held out. Held out, every one of them was predicted
# too slow (median -20% to -28%, fitted on our H200 runs alone); fitted, they pull the
# pre-training fit away from the calibration set if their multi-GPU rows join it
# (llm-foundry 5.4% -> 9.3%), so they join the single-GPU fit only.
FITTED_SINGLE_GPU = ("lambda-bert", "nvidia-bert", "qwen1-finetune")
# our own measurements are scored leave one *run* out (a published source, leave one source
# out): the brief's rule for our own runs, and the only way their own host time (below) is
# fitted without the run it predicts
OWN_RUNS = ("vramplan-h200",)
# Host time per kernel is the host machine's, not the GPU's. Our H200 runs were timed on one
# lent VM whose host is about 3x slower per kernel than the published runs' (their fits: 64-68
# us against 16-21 us), so in every fit they take a host time of their own (OWN_HOST, as
# `vramplan calibrate` fits a user's machine), never shipped; the published rows share one.
# Only single-GPU rows are host-bound enough to set it: the multi-GPU eager fit takes the
# single-GPU fit's (fitted on its own rows it ran to its 200 us bound).
OWN_HOST = "own_runs_kernel_us"
SHARES = ("matmul_share", "attention_share", "memory", "kernel_us", "overlap")
# A tie-breaker for the attention share: the loss adds PRIOR_WEIGHT x log(share / prior)^2.
# Fitted without llm-foundry (on KempnerForge and our H200 runs) the loss hardly moves with it
# (within 0.0013 of 0.075 from 0.8 to 1.5), so the search ended wherever its path took it, and
# llm-foundry's out-of-sample error swung from 3.7% to 6.6% with changes elsewhere that left
# its own rows alone. 0.01 charges a share 25% off the prior 0.0005, the size of that
# flatness: the prior, "training reaches the kernel's measured rate", settles ties only.
PRIOR = {"attention_share": 1.0}
PRIOR_WEIGHT = 0.01
START = {"matmul_share": 0.83, "attention_share": 0.7, "memory": 0.656, "kernel_us": 65.3,
         "overlap": 0.8}
# physical limits: no step beats the best measured matmul rate (mamf) or the HBM bandwidth;
# attention kernels newer than FlashAttention-2 (cuDNN, FlashAttention-3) reach up to ~2x it
BOUNDS = {"matmul_share": (0.3, 1.0), "attention_share": (0.2, 2.2), "memory": (0.1, 1.0),
          "kernel_us": (1.0, 200.0), "overlap": (0.0, 1.0), OWN_HOST: (1.0, 200.0)}


def _h200_runs() -> list[dict]:
    data = json.loads((RESULTS / "gpu_validation.json").read_text())
    gpu = data["machine"]["gpu"]
    out = []
    for row in data["rows"]:
        measured = (row.get("measured") or {}).get("step_time_median_s")
        job = row["job"]
        stand_in = job.get("optimizer") in ("adamw-8bit", "paged-adamw-8bit") or \
            job.get("precision") == "fp8"
        if measured and not stand_in:
            out.append({"id": "h200:" + ",".join(f"{k}={v}" for k, v in job.items()),
                        "source": "vramplan-h200", "job": Job.model_validate(job),
                        "gpu": gpu, "measured_step_s": measured})
    return out


def load() -> tuple[list[dict], list[dict]]:
    """(scorable runs with their step terms, rows vramplan cannot express)."""
    runs, skipped = [], []
    for c in cases():
        if c.job is None:
            skipped.append({"id": c.id, "source": c.source, "why": c.skipped})
            continue
        runs.append({"id": c.id, "source": c.source, "job": c.job, "gpu": c.gpu,
                     "measured_tps_gpu": c.measured_tokens_per_s_per_gpu,
                     "assumed": c.assumed, "attention_kernel": c.attention_kernel})
    runs += _h200_runs()
    kept = []
    for run in runs:
        gpu = get_gpu(run["gpu"])
        try:
            run["terms"] = step_terms(run["job"], gpu)
            if run.get("attention_kernel") == "triton":  # its job: flash-attn-2
                run["terms"] = _slower_attention(run["terms"], TRITON_ATTENTION_SLOWDOWN)
            if run["source"] in TRANSFORMER_ENGINE_FP8:
                run["terms"] = _transformer_engine_fp8(run["terms"], run["job"], gpu)
            if run["source"] in ONE_MICRO_BATCH:
                run["terms"] = _one_micro_batch(run["terms"], run["job"], gpu)
            if run["source"] in BERT_ADAM and run["job"].optimizer_impl == "loop":
                run["terms"] = _bert_adam(run["terms"], run["job"])
            if STACK[run["source"]] == "megatron-core":
                run["terms"] = _sixteen_bit_model(run["terms"], run["job"], gpu)
                if run["source"] in UNFUSED_LOSS:
                    run["terms"] = _megatron_loss(run["terms"], run["job"], gpu)
                if run["job"].attention == "eager":
                    run["terms"] = _unfused_attention_dropout(run["terms"], run["job"], gpu)
        except Exception as error:  # said, never dropped silently
            skipped.append({"id": run["id"], "source": run["source"],
                            "why": f"{type(error).__name__}: {error}"})
            continue
        run["arch"] = architecture_of(gpu)
        run["gpu_name"] = gpu.name  # a catalog GPU may have its own matmul ceiling
        n = run["job"].parallel.num_gpus
        if "measured_step_s" in run:
            run["measured_tps_gpu"] = run["terms"].tokens_per_step / run["measured_step_s"] / n
        kept.append(run)
    return kept, skipped


# Megatron-LM, NeMo and Megatron-DeepSpeed keep the model itself in 16-bit (Float16Module;
# DeepSpeed's bf16 optimizer) with fp32 main parameters in the optimizer, so no micro-batch
# casts the weights (vramplan's bf16-mixed is autocast, which does); the weight-gradient
# GEMMs accumulate into the fp32 main_grad buffer themselves (gradient_accumulation_fusion,
# on by default), so no separate pass adds them; and Transformer Engine casts each weight to
# fp8 on a step's first micro-batch only (is_first_microbatch). (Megatron-LM
# megatron/core/transformer/module.py Float16Module, megatron/training/arguments.py
# --no-gradient-accumulation-fusion, megatron/core/extensions/transformer_engine.py.)
SIXTEEN_BIT_MODEL_OPS = {"weight cast": 0.0, "grad accumulate": 0.0, "fp8 weight cast": None}


def _with_op_bytes(terms, job: Job, gpu, scale_of) -> object:
    """The step terms with each phase's memory-bound bytes changed by scale_of(op, phase) x
    the bytes step_traffic counts for that op in that phase (the busiest stage's share, per
    tensor x context-parallel rank): negative drops work, positive adds it."""
    arch = load_architecture(job.model)
    traffic = step_traffic(job, arch)
    share = describe_step(job, arch).stages[-1].layer_share
    split = job.parallel.tensor_parallel * job.parallel.context_parallel
    phases = []
    for p in terms.phases:
        changed = sum(share * nbytes * scale_of(op, phase) / split
                      for (op, phase), nbytes in traffic.by_op_phase.items() if phase == p.phase)
        phases.append(dataclasses.replace(
            p, memory_s=p.memory_s + changed / gpu.bandwidth_bytes_s, bytes=p.bytes + changed))
    return dataclasses.replace(terms, phases=tuple(phases))


def _sixteen_bit_model(terms, job: Job, gpu):
    """The step terms less the per-micro-batch weight work a 16-bit model does not do (fp8
    scaling: once per step, not per micro-batch)."""
    def scale(op: str, phase: str) -> float:
        if op not in SIXTEEN_BIT_MODEL_OPS:
            return 0.0
        keep = SIXTEEN_BIT_MODEL_OPS[op]
        return -(1 - (1 / job.grad_accum if keep is None else keep))
    return _with_op_bytes(terms, job, gpu, scale)


# VectorLM reports the median time of one micro-batch (profiling/parse_benchmark.py), and
# three of every four accumulate under no_sync (vectorlm/trainer.py train_step: forward,
# backward and clip_grad_norm_; the fourth reduce-scatters and steps the optimizer), so its
# median step is a no-sync micro-batch: clipped, with no reduce-scatter and no optimizer step.
ONE_MICRO_BATCH = ("vectorlm",)
_CLIP_KERNELS = 4  # traffic.py _optimizer: clip_grad_norm_'s norm and scale


def _one_micro_batch(terms, job: Job, gpu):
    """The step terms of one micro-batch that accumulates without syncing: each micro-batch
    phase once, the collectives that run every micro-batch once, and of the optimizer phase
    only the clipping of the whole (unsharded, under no_sync) gradient."""
    ga = job.grad_accum
    clip = step_traffic(job).by_op_phase.get(("clip", "optimizer"), 0.0)
    phases = []
    for p in terms.phases:
        if p.phase == "optimizer":
            p = dataclasses.replace(p, memory_s=clip / gpu.bandwidth_bytes_s, bytes=clip,
                                    kernels=_CLIP_KERNELS, offload_s=0.0,
                                    offload_params=0.0)
        else:
            p = dataclasses.replace(p, per_step=p.per_step // ga)
        phases.append(p)
    comms = tuple(dataclasses.replace(c, times=c.times // ga) for c in terms.collectives
                  if c.times >= ga)
    return dataclasses.replace(
        terms, phases=tuple(phases), collectives=comms,
        tokens_per_step=terms.tokens_per_step // ga,
        samples_per_step=terms.samples_per_step // ga,
        model_flops_gpu=terms.model_flops_gpu / ga, flops_per_step=terms.flops_per_step / ga)


# NVIDIA's BERT code steps its fp32 runs with BertAdam (DeepLearningExamples
# PyTorch/LanguageModeling/BERT/optimization.py at 2a520dd5, BertAdam.step), a Python loop
# over the parameters: mul_, add_, mul_, addcmul_, sqrt, add, div, the decay's mul and add
# (the weights; run_squad.py decays no bias or LayerNorm), the learning rate's mul, neg and
# add_: 12 kernels a matrix and 10 a vector, where the rows' jobs count torch's for-loop
# AdamW's 8 (traffic.py OPTIMIZER_STEPS)
BERT_ADAM = ("lambda-bert", "nvidia-bert")
BERT_ADAM_KERNELS = (12, 10)


def _bert_adam(terms, job: Job):
    """The step terms with BertAdam's kernels in the optimizer phase."""
    matrices, vectors = _trainable_tensors(job, load_architecture(job.model))
    loop = OPTIMIZER_STEPS[(job.optimizer, "loop")]
    more = ((BERT_ADAM_KERNELS[0] - loop.per_matrix) * matrices
            + (BERT_ADAM_KERNELS[1] - loop.per_vector) * vectors)
    phases = tuple(dataclasses.replace(p, kernels=p.kernels + more) if p.phase == "optimizer"
                   else p for p in terms.phases)
    return dataclasses.replace(terms, phases=phases)


def _megatron_loss(terms, job: Job, gpu):
    """The step terms with the eager loss's bytes as Megatron's unfused vocab-parallel
    cross-entropy moves them (its rows' jobs run the loss eager: published_runs.py
    UNFUSED_LOSS), per logit of c bytes (megatron/core/tensor_parallel/cross_entropy.py at
    f2e5db402c44; in 2021 the same ops in megatron/mpu/cross_entropy.py after gpt_model.py's
    output.float(), which Megatron-DeepSpeed keeps): forward, the logits written (c),
    .float() (r c, w 4), max (r 4), the in-place subtraction, exp and division (r 4, w 4
    each), the sum (r 4): 2c + 36 bytes; backward, grad_input.mul_ (r 4, w 4) and the cast
    back to 16-bit (r 4, w c): c + 12.
    vramplan's eager loss (traffic.py _loss, HF's log_softmax) counts 2c + 16 and c + 20."""
    c = dtypes_for(job).compute
    ratio = {"forward": (2 * c + 36) / (2 * c + 16), "backward": (c + 12) / (c + 20)}
    return _with_op_bytes(terms, job, gpu,
                          lambda op, phase: ratio.get(phase, 1.0) - 1 if op == "loss" else 0.0)


# the 16-bit scores: the fused kernel moves 2c + 1 bytes each; a dropout of its own 2c more
_SCORE_BYTES = 2


def _unfused_attention_dropout(terms, job: Job, gpu):
    """Megatron-LM before FlashAttention (and Megatron-DeepSpeed, BLOOM's) runs its fused
    scale-mask-softmax and then the attention dropout as a kernel of its own
    (megatron/model/transformer.py at fda81a212b73, ParallelAttention.forward): the dropout
    reads the probabilities and writes them again, where a compiled block (what these rows
    are timed as) fuses it into the softmax. The step terms plus those two passes over the
    scores, in every phase that has the softmax."""
    if load_architecture(job.model).attention_dropout <= 0:
        return terms
    c = _SCORE_BYTES
    return _with_op_bytes(terms, job, gpu,
                          lambda op, phase: 2 * c / (2 * c + 1) if op == "softmax" else 0.0)


def _transformer_engine_fp8(terms, job: Job, gpu):
    """The step terms with Transformer Engine's float8 casts (Megatron-LM, NeMo and
    llm-foundry's amp_fp8) in place of the torchao Float8Linear casts vramplan counts
    (traffic.py _float8_casts): each cast one fused pass (cast_transpose: read the 16-bit
    tensor, write fp8), as vramplan counts a compiled cast; the backward casts each output
    gradient once for both GEMMs and reuses the forward's fp8 input (no recast). Megatron
    casts the weights once per step on top (SIXTEEN_BIT_MODEL_OPS; its rows are compiled,
    so the two never scale the same bytes)."""
    if job.precision != "fp8":
        return terms
    c, compiled = dtypes_for(job).compute, job.compiles_blocks  # 16-bit activations, grads
    fused = float8_cast_bytes(c, True)[0] / float8_cast_bytes(c, compiled)[0]
    weights = (float8_cast_bytes(4, True, produced=False)[0]
               / float8_cast_bytes(4, compiled, produced=False)[0])
    scale = {"fp8 input cast": fused - 1, "fp8 input recast": -1.0,
             "fp8 grad cast": fused / 2 - 1, "fp8 weight cast": weights - 1}
    return _with_op_bytes(terms, job, gpu, lambda op, phase: scale.get(op, 0.0))


def _slower_attention(terms, factor: float):
    phases = tuple(dataclasses.replace(p, attention_s=p.attention_s * factor)
                   for p in terms.phases)
    return dataclasses.replace(terms, phases=phases)


def predicted_tps_gpu(run: dict, shares: dict) -> float:
    shares = dict(shares)
    own_host = shares.pop(OWN_HOST, None)
    if own_host is not None and run["source"] in OWN_RUNS:
        shares["kernel_us"] = own_host
    factors = shipped_factors(run["arch"], shares, gpu=run["gpu_name"])
    step = step_time(run["terms"], factors)
    return run["terms"].tokens_per_step / step / run["job"].parallel.num_gpus


def _loss(runs: list[dict], shares: dict) -> float:
    # each source weighs the same, whatever its number of rows
    by: dict[str, list[float]] = {}
    for r in runs:
        by.setdefault(r["source"], []).append(
            abs(math.log(predicted_tps_gpu(r, shares) / r["measured_tps_gpu"])))
    return sum(statistics.fmean(v) for v in by.values()) / len(by) + PRIOR_WEIGHT * sum(
        math.log(shares[k] / v) ** 2 for k, v in PRIOR.items() if k in shares)


def fit(runs: list[dict], start: dict | None = None, rounds: int = 4,
        fixed: dict | None = None) -> dict:
    """Coordinate search of the shares, in multiplicative steps that shrink each round. One
    source alone cannot tell the shares apart: its rows share one stack and one attention
    kernel, and attention's share of their FLOPs hardly varies, so a matmul and an attention
    share fitted together trade against each other (Megatron-LM's rows alone drove the
    attention share to its bound). Then only the matmul share is fitted and the others keep
    `start`'s values. `fixed`: shares set, not fitted. Rows of our own runs add their host
    time (OWN_HOST)."""
    shares = {**(start or START), **(fixed or {})}
    keys = SHARES if len({r["source"] for r in runs}) > 1 else ("matmul_share",)
    keys = tuple(k for k in keys if k not in (fixed or {}))
    if any(r["source"] in OWN_RUNS for r in runs):
        shares.setdefault(OWN_HOST, START["kernel_us"])
        keys += (OWN_HOST,)
    else:
        shares.pop(OWN_HOST, None)
    best = _loss(runs, shares)
    for step in (1.25, 1.1, 1.04, 1.015)[:rounds]:
        improved = True
        while improved:
            improved = False
            for key in keys:
                for factor in (step, 1 / step):
                    lo, hi = BOUNDS[key]
                    trial = {**shares, key: min(hi, max(lo, shares[key] * factor))}
                    loss = _loss(runs, trial)
                    if loss < best - 1e-6:
                        shares, best, improved = trial, loss, True
    return shares


def _summary(errors: list[float]) -> dict:
    if not errors:
        return {"rows": 0}
    ordered = sorted(abs(e) for e in errors)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return {"rows": len(ordered), "median_abs": statistics.median(ordered), "p90_abs": p90,
            "median_signed": statistics.median(errors)}


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def _scale(n: int) -> str:
    return "1" if n == 1 else "2-8" if n <= 8 else "9-128" if n <= 128 else ">128"


def _rule(run: dict, r: float) -> float:
    t = run["terms"]
    n = run["job"].parallel.num_gpus
    per_token = t.model_flops_gpu * n / t.tokens_per_step
    return r * t.peak / per_token


def stack_of(run: dict) -> str:
    """The fit a row belongs to: its source's stack; eager-PyTorch single-GPU jobs get their
    own (fine-tuning on one GPU: host-bound steps and small GEMMs the pre-training runs lack)."""
    stack = STACK[run["source"]]
    if stack == "pytorch" and run["job"].parallel.num_gpus == 1:
        return "pytorch-single-gpu"
    return stack


def _rates(fit: dict) -> dict:
    """Of a fit, the shares efficiency.toml's [training_single_gpu] ships (the others are
    [training]'s)."""
    shipped = tomllib.loads(EFFICIENCY.read_text())["training_single_gpu"]
    return {k: fit[k] for k in shipped if k != "sources"}


def takes_single_gpu_shares_row(run: dict) -> bool:
    """A multi-GPU eager-PyTorch row the tool times at the single-GPU rates
    (efficiency.takes_single_gpu_shares: an encoder or adapters on several GPUs). Its rates
    come from the single-GPU fit without its own source (out of sample); the multi-GPU rows
    never join that fit."""
    return (STACK[run["source"]] == "pytorch" and run["job"].parallel.num_gpus > 1
            and takes_single_gpu_shares(_bucket(run)))


def is_fitted(run: dict) -> bool:
    return run["source"] in FITTED or (run["source"] in FITTED_SINGLE_GPU
                                       and stack_of(run) == "pytorch-single-gpu")


def fit_pool(runs: list[dict], stack: str) -> list[dict]:
    """The rows a stack's shares are fitted on. The eager multi-GPU fit keeps our single-GPU
    H200 runs: they are its only host-bound steps (without them the host time per kernel
    goes to its bound); the single-GPU fit is every fitted single-GPU row."""
    if stack == "pytorch":
        return [r for r in runs if r["source"] in FITTED and STACK[r["source"]] == "pytorch"]
    return [r for r in runs if is_fitted(r) and stack_of(r) == stack]


def _bucket(run: dict) -> str:
    """The shipped interval a row's job carries (the tool's own rule)."""
    return interval_bucket_of(run["job"])


def _pool(runs: list[dict], bucket: str) -> list[dict]:
    """The rows whose out-of-sample errors set a bucket's interval. Several GPUs training a
    decoder's own weights: the fitted sources' rows. The other two buckets have too few
    fitted rows to speak for other stacks (one GPU: 16 of our runs and one KempnerForge row;
    several GPUs, encoders or adapters: NeMo's LoRA rows), so every row of the bucket sets
    it (held-out ones too: Lambda's and NVIDIA's BERT, Answer.AI's QLoRA): their errors
    still test the predictions, no longer the interval; nested coverage stays out of sample."""
    rows = [r for r in runs if _bucket(r) == bucket]
    return [r for r in rows if is_fitted(r)] if bucket == "multi_gpu" else rows


# Each bucket's interval is its pool's [tail, 1 - tail] quantiles, the tail share the
# grid's closest to covering COVERAGE of a source held out (below). The rows of one source
# share its bias, so the pooled 10th-90th percentiles covered a new source's single-GPU rows
# 68% of the time, not 80%.
COVERAGE = 0.8
TAILS = tuple(round(0.20 - 0.01 * i, 2) for i in range(19))  # 0.20 (20th-80th) to 0.02
PLAIN_TAIL = 0.10  # the 10th-90th percentiles: a pool of one source says nothing wider


def _covers(pool: list[dict], tail: float, row: dict) -> bool:
    """Whether `row` falls in the interval of the pool rows of the other sources."""
    others = [o["log_error"] for o in pool if o["source"] != row["source"]]
    return bool(others) and _quantile(others, tail) <= row["log_error"] <= _quantile(
        others, 1 - tail)


def _tail(pool: list[dict]) -> float:
    """The tail share whose interval covers each pool source's rows, held out, closest to
    COVERAGE of the time (the narrower one on a tie); PLAIN_TAIL with fewer than two
    sources. Only the pool's rows pick it: a never-fitted source's rows test the interval,
    and their coverage would be in sample were they to set its width."""
    if len({r["source"] for r in pool}) < 2:
        return PLAIN_TAIL
    coverage = {t: _share([_covers(pool, t, r) for r in pool]) for t in TAILS}
    return min(TAILS, key=lambda t: (abs(coverage[t] - COVERAGE), -t))


def intervals(runs: list[dict]) -> dict:
    """The 80% interval of each bucket (INTERVAL_BUCKETS): its pool's out-of-sample log
    errors at the tail share _tail picks (shipped), and its coverage two ways. Nested: each
    source's rows against the interval of the *other* sources' pool rows, at the tail share
    picked without that source (out of sample for the interval and its width); shipped:
    every row against the shipped interval (its quantiles and tail share in sample, the
    errors out of sample)."""
    out: dict = {}
    for r in runs:
        r["log_error"] = math.log1p(r["loso_error"])
    for bucket in INTERVAL_BUCKETS:
        pool = _pool(runs, bucket)
        rows = [r for r in runs if _bucket(r) == bucket]
        tail = _tail(pool)
        logs = [r["log_error"] for r in pool]
        lo, hi = _quantile(logs, tail), _quantile(logs, 1 - tail)
        by: dict[str, list[dict]] = {}
        for r in rows:
            by.setdefault(r["source"], []).append(r)
        for source, own in by.items():
            rest = [o for o in pool if o["source"] != source]
            held_tail = _tail(rest)
            for r in own:
                r["in_interval"] = _covers(pool, held_tail, r)
                r["in_shipped_interval"] = lo <= r["log_error"] <= hi
        out[bucket] = {
            "log_low": lo, "log_high": hi, "tail": tail, "pool_rows": len(pool),
            "pool_sources": sorted({r["source"] for r in pool}),
            "coverage_nested": _share([r["in_interval"] for r in rows]),
            "coverage_shipped": _share([r["in_shipped_interval"] for r in rows]),
            "coverage_nested_by_source": {s: _share([r["in_interval"] for r in v])
                                          for s, v in sorted(by.items())}}
    cal = [r for r in runs if r["source"] in CALIBRATION_SET]
    held_out = [r for r in runs if not is_fitted(r)]
    out["calibration_set"] = {"coverage_nested": _share([r["in_interval"] for r in cal]),
                              "coverage_shipped": _share([r["in_shipped_interval"]
                                                          for r in cal])}
    out["held_out_rows"] = {"coverage_nested": _share([r["in_interval"] for r in held_out]),
                            "coverage_shipped": _share([r["in_shipped_interval"]
                                                        for r in held_out])}
    return out


# what a family's rows may differ in besides the GPU count (one GPU runs without a strategy)
_SCALE_FIELDS = {"num_gpus", "gpus_per_node", "strategy", "network_gb_s"}


def scaling(runs: list[dict]) -> list[dict]:
    """Each family of one source's rows on one GPU type that differ only in their GPU count
    (the same per-GPU batch, layout and techniques): per-GPU throughput at each count over
    that at its fewest, measured and predicted (out of sample). The ratio cancels what the
    model gets wrong about one GPU's step and leaves what it gets wrong about scale."""
    families: dict[str, list[dict]] = {}
    for r in runs:
        job = r["job"]
        parallel = job.parallel.model_dump(exclude=_SCALE_FIELDS)
        key = json.dumps([r["source"], r["gpu"], job.model_dump(exclude={"parallel"}),
                          parallel], sort_keys=True, default=str)
        families.setdefault(key, []).append(r)
    out = []
    for rows in families.values():
        counts = {r["job"].parallel.num_gpus for r in rows}
        if len(counts) < 2 or len(counts) < len(rows):  # one row per count, two counts or more
            continue
        rows = sorted(rows, key=lambda r: r["job"].parallel.num_gpus)
        base = rows[0]
        out.append({
            "source": base["source"], "gpu": base["gpu"],
            "model": Path(base["job"].model).name,  # a written config's file, not its folder
            "ids": [r["id"] for r in rows],
            "gpus": [r["job"].parallel.num_gpus for r in rows],
            "measured": [r["measured_tps_gpu"] / base["measured_tps_gpu"] for r in rows],
            "predicted": [r["loso_tps_gpu"] / base["loso_tps_gpu"] for r in rows]})
    return sorted(out, key=lambda f: (f["source"], f["gpu"], f["ids"][0]))


def scaling_summary(families: list[dict]) -> dict:
    """Median |error| of the predicted ratio at each family's most GPUs, and of perfect
    scaling (a ratio of 1) on the same families: what the model adds about scale."""
    if not families:
        return {"families": 0}
    last = [(f["predicted"][-1], f["measured"][-1]) for f in families]
    return {"families": len(families),
            "median_abs": statistics.median(abs(p / m - 1) for p, m in last),
            "perfect_scaling_median_abs": statistics.median(abs(1 / m - 1) for _, m in last)}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--fit", action="store_true", help="print the all-sources fit")
    parser.add_argument("--write-interval", action="store_true",
                        help="write the 80%% interval into vramplan/planning/efficiency.toml")
    args = parser.parse_args()
    out = args.out or results_dir()
    started = time.perf_counter()
    runs, skipped = load()
    sources = sorted({r["source"] for r in runs})
    rounds = 2 if QUICK else 4
    single_pool = fit_pool(runs, "pytorch-single-gpu")
    single = fit(single_pool, rounds=rounds)
    single_without = {s: fit([r for r in single_pool if r["source"] != s], rounds=rounds)
                      for s in {r["source"] for r in single_pool} - set(OWN_RUNS)}

    def host(source: str | None = None) -> dict:
        """The other fits' host time per kernel (OWN_HOST): the single-GPU fit's, without
        `source`'s rows where it has some."""
        return {"kernel_us": single_without.get(source, single)["kernel_us"]}

    shipped = fit(fit_pool(runs, "pytorch"), rounds=rounds, fixed=host())
    stack_fits = {"pytorch": shipped, "pytorch-single-gpu": single}
    for stack in sorted({stack_of(r) for r in runs} - set(stack_fits)):
        rows = fit_pool(runs, stack)
        stack_fits[stack] = (fit(rows, start=shipped, rounds=rounds, fixed=host()) if rows
                             else shipped)
    folds = {}
    for source in sources:
        for stack in sorted({stack_of(r) for r in runs if r["source"] == source}):
            pool = fit_pool(runs, stack)
            train = [r for r in pool if r["source"] != source]
            held_out = len(train) == len(pool) or not train  # its stack's fit never saw it
            train = train[::8] if QUICK else train
            if source in OWN_RUNS:  # one run out (below)
                fold = None
            elif stack == "pytorch-single-gpu":
                fold = single_without.get(source, single)
            elif held_out and source not in single_without:
                fold = stack_fits[stack]
            else:  # the eager folds start from the defaults, other stacks from its fit
                fold = fit(train, start=None if stack == "pytorch" else shipped,
                           rounds=rounds, fixed=host(source))
            if fold is not None:
                folds[f"{source} ({stack})"] = fold
            for r in runs:
                if r["source"] != source or stack_of(r) != stack:
                    continue
                row_fold = fold
                if source in OWN_RUNS:  # the others of its pool, ours included
                    others = [o for o in pool if o is not r]
                    row_fold = fit(others[::8] if QUICK else others, rounds=rounds,
                                   fixed=None if stack == "pytorch-single-gpu" else host())
                if takes_single_gpu_shares_row(r):  # the tool's rule: one GPU's rates
                    row_fold = {**row_fold, **_rates(single_without.get(source, single))}
                r["loso_tps_gpu"] = predicted_tps_gpu(r, row_fold)
                r["loso_error"] = r["loso_tps_gpu"] / r["measured_tps_gpu"] - 1
    all_fit = stack_fits["pytorch"]
    for r in runs:
        in_sample = stack_fits[stack_of(r)]
        if takes_single_gpu_shares_row(r):
            in_sample = {**in_sample, **_rates(single)}
        r["in_sample_error"] = predicted_tps_gpu(r, in_sample) / r["measured_tps_gpu"] - 1
        r["rule_035_error"] = _rule(r, 0.35) / r["measured_tps_gpu"] - 1
        r["rule_045_error"] = _rule(r, 0.45) / r["measured_tps_gpu"] - 1
    interval_80 = intervals(runs)
    scale = scaling(runs)
    published = [r for r in runs if r["source"] != "vramplan-h200"]

    def block(rows: list[dict]) -> dict:
        return {key: _summary([r[f"{key}_error"] for r in rows])
                for key in ("loso", "in_sample", "rule_035", "rule_045")}

    result = {
        "machine": machine_line() + " (the CPU side; the runs were measured by their sources)",
        "sources": sources,
        "fit_all_sources_in_sample": all_fit,
        "stacks": STACK,
        "fit_per_stack_in_sample": stack_fits,
        "fit_per_left_out_source": folds,
        "all_rows": block(runs),
        "published_rows": block(published),
        "calibration_set": block([r for r in runs if r["source"] in CALIBRATION_SET]),
        "collected_rows": block([r for r in published if r["source"] not in CALIBRATION_SET]),
        "held_out_rows": block([r for r in runs if not is_fitted(r)]),
        "by_source": {s: block([r for r in runs if r["source"] == s]) for s in sources},
        "by_architecture": {a: block([r for r in published if r["arch"] == a])
                            for a in sorted({r["arch"] for r in published})},
        "by_scale": {s: block([r for r in published
                               if _scale(r["job"].parallel.num_gpus) == s])
                     for s in ("1", "2-8", "9-128", ">128")},
        "interval_80": interval_80,
        "scaling": scale,
        "scaling_summary": scaling_summary(scale),
        "skipped": skipped,
        "seconds": time.perf_counter() - started,
        "quick": QUICK,
        "rows": [{"id": r["id"], "source": r["source"], "gpu": r["gpu"],
                  "num_gpus": r["job"].parallel.num_gpus,
                  "measured_tokens_per_s_per_gpu": r["measured_tps_gpu"],
                  "loso_tokens_per_s_per_gpu": r["loso_tps_gpu"],
                  "loso_error": r["loso_error"], "in_sample_error": r["in_sample_error"],
                  "rule_045_error": r["rule_045_error"], "in_interval": r["in_interval"],
                  "assumed": r.get("assumed", [])} for r in runs],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "published_accuracy.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "published_accuracy.md").write_text(markdown(result))
    print(markdown(result).split("\n| id")[0])
    if args.fit:
        print("fit on all sources (ship in efficiency.toml [training]):", all_fit)
    if args.write_interval and not QUICK:
        write_interval(result["interval_80"])


EFFICIENCY = Path(__file__).parent.parent / "vramplan" / "planning" / "efficiency.toml"


def write_interval(interval: dict) -> None:
    """Put this run's intervals into efficiency.toml's [interval] (their four numbers only)."""
    text = EFFICIENCY.read_text()
    for bucket in INTERVAL_BUCKETS:
        for end in ("log_low", "log_high"):
            key = f"{bucket}_{end}"
            text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {interval[bucket][end]:.4f}",
                              text)
            assert n == 1, f"efficiency.toml has {n} '{key} =' lines, expected 1"
    EFFICIENCY.write_text(text)
    print("efficiency.toml [interval]: " + ", ".join(
        f"{b} {interval[b]['log_low']:.4f} / {interval[b]['log_high']:.4f}"
        for b in INTERVAL_BUCKETS))


def _cell(s: dict) -> str:
    if not s.get("rows"):
        return "-"
    return f"{100 * s['median_abs']:.1f}% / {100 * s['p90_abs']:.1f}%"


def markdown(result: dict) -> str:
    lines = ["# Step-time accuracy on published training runs", "",
             f"Scored on {result['machine']}. Error = predicted / measured tokens/s per GPU - "
             "1. Cells: median / p90 of |error|. **Out of sample** = leave one source out "
             "(the shares fitted on the other fitted sources of its stack; eager-PyTorch "
             "single-GPU rows have their own fit; our own H200 runs: leave one run out); "
             "**in sample** = "
             "fitted on all the fitted sources of its stack (those shipped; a held-out source's "
             "two figures come from one fit, never trained on it). Fixed rule: r x dense peak / "
             "model FLOPs per token.", "",
             "| rows | n | out of sample | in sample | fixed rule 0.35 | fixed rule 0.45 |",
             "|---|---:|---:|---:|---:|---:|"]

    def row(label: str, b: dict) -> None:
        lines.append(f"| {label} | {b['loso'].get('rows', 0)} | {_cell(b['loso'])} | "
                     f"{_cell(b['in_sample'])} | {_cell(b['rule_035'])} | "
                     f"{_cell(b['rule_045'])} |")

    row("calibration set (shared/calibration)", result["calibration_set"])
    row("published rows we collected (the fitted ones left out in turn)",
        result["collected_rows"])
    row("held-out rows (never fitted)", result["held_out_rows"])
    row("all published rows", result["published_rows"])
    row("all rows (with our H200 runs)", result["all_rows"])
    for s, b in result["by_source"].items():
        row(f"source: {s}", b)
    for a, b in result["by_architecture"].items():
        row(f"architecture: {a}", b)
    for s, b in result["by_scale"].items():
        if b["loso"].get("rows"):
            row(f"GPUs: {s}", b)
    iv = result["interval_80"]
    lines += ["", "80% interval of the step time (measured step time / predicted), one per bucket, "
              "its pool's out-of-sample errors from the tail share t to 1 - t, t (grid 0.20 to "
              "0.02) the one whose interval covers each pool source's rows, held out, closest to "
              "80% of the time (a never-fitted source tests the width, never sets it). "
              "Coverage *nested*: each source's rows against the interval of the "
              "other sources' pool rows at the t picked without it (out of sample for the "
              "interval and its width); *shipped*: against the shipped interval (its quantiles "
              "and t in sample).", ""]
    for bucket, label in (("single_gpu", "one GPU"),
                          ("multi_gpu", "several GPUs, a decoder's own weights"),
                          ("multi_gpu_other", "several GPUs, encoders or adapters")):
        b = iv[bucket]
        lines.append(
            f"* {label}: x{math.exp(b['log_low']):.2f} to x{math.exp(b['log_high']):.2f} "
            f"(t {b['tail']:.2f}; pool: {b['pool_rows']} rows of "
            f"{', '.join(b['pool_sources'])}); coverage "
            f"nested {100 * b['coverage_nested']:.0f}%, shipped "
            f"{100 * b['coverage_shipped']:.0f}%; nested by source: "
            + ", ".join(f"{s} {100 * c:.0f}%" for s, c in b["coverage_nested_by_source"].items()))
    for key, label in (("calibration_set", "calibration set"),
                       ("held_out_rows", "held-out rows (shares never fitted on them; "
                                         "their encoder and adapter rows join that bucket's "
                                         "pool)")):
        lines.append(f"* {label}: coverage nested {100 * iv[key]['coverage_nested']:.0f}%, "
                     f"shipped {100 * iv[key]['coverage_shipped']:.0f}%")
    fams = result["scaling"]
    lines += ["", "Scaling: each family of one source's rows on one GPU type that differ only in "
              "their GPU count; per-GPU throughput at each count over that at its fewest, "
              "measured / predicted (out of sample). The ratio cancels the one-GPU error and "
              "leaves the error about scale. At each family's most GPUs the predicted ratio "
              f"misses by {100 * result['scaling_summary'].get('median_abs', 0):.1f}% "
              f"(median over {result['scaling_summary']['families']} families); perfect "
              "scaling (a ratio of 1) by "
              f"{100 * result['scaling_summary'].get('perfect_scaling_median_abs', 0):.1f}%.",
              "",
              "| source | GPU | model | GPUs | measured | predicted |", "|---|---|---|---|---|---|"]
    for f in fams:
        lines.append(f"| {f['source']} | {f['gpu']} | {f['model']} | "
                     + " / ".join(str(n) for n in f["gpus"]) + " | "
                     + " / ".join(f"{x:.2f}" for x in f["measured"]) + " | "
                     + " / ".join(f"{x:.2f}" for x in f["predicted"]) + " |")
    lines += ["",
              "Shares fitted on the eager-PyTorch fitted sources (llm-foundry, KempnerForge, our "
              "H200 runs; in sample, shipped as [training]): "
              + ", ".join(f"{k} {v:.3g}" for k, v in result["fit_all_sources_in_sample"].items()),
              "", "Single-GPU eager shares (every fitted single-GPU row; in sample, shipped as "
              "[training_single_gpu]): " + ", ".join(
                  f"{k} {v:.3g}" for k, v in
                  result["fit_per_stack_in_sample"]["pytorch-single-gpu"].items()),
              "", f"Rows vramplan cannot express: {len(result['skipped'])}"
              + "".join(f"\n* {s['id']}: {s['why']}" for s in result["skipped"]), "",
              "| id | source | GPUs | measured tok/s/GPU | out of sample | error |",
              "|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['id']} | {r['source']} | {r['num_gpus']} | "
                     f"{r['measured_tokens_per_s_per_gpu']:.0f} | "
                     f"{r['loso_tokens_per_s_per_gpu']:.0f} | {100 * r['loso_error']:+.1f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
