"""Host work of an eager training step: the aten ops PyTorch dispatches, by model family.

An eager step is host-bound when Python, the dispatcher, autograd and the kernel launches
take longer than the GPU's work. The performance model charges `kernel_us` (efficiency.toml,
fitted on published and our own runs) per kernel that planning/traffic.py counts. This
benchmark counts what a real step dispatches instead, on the CPU (the count depends on the
model's code, not on the device): one forward under bf16 autocast and its backward, through
transformers' own model (training/setup.py, as the trace and measure run it), with the
model's shapes shrunk and its depth at 1 and 2 blocks, so that per-block and outside-block
ops separate and scale to the real depth. It also times the ops on this CPU's tiny tensors,
an upper bound of the host time per op here.

    PYTHONPATH=. python benchmarks/host_ops.py      # writes results/host_ops.{json,md}

The ratio of dispatched ops to traffic.py's kernels shows whether one kernel_us can serve
every family: views, casts and autograd's own ops are dispatched but are not kernels.

It also times the host cost of selective activation checkpointing (torch's
create_selective_checkpoint_contexts, as vramplan's `selective` and `selective:torchtitan-op`
and torchtitan's op-level AC run it): a Python policy called for every op of each
checkpointed block's forward and recompute. Per block (from 2- and 6-block models), full
checkpointing runs the forward's host work twice; the policy's extra over that, as a share
of those two passes, is efficiency.toml [selective_checkpointing] host_scale - 1.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from common import QUICK, machine_line, shrunk_config, write_results  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from vramplan.job import OP_LEVEL_CHECKPOINTING, Job  # noqa: E402
from vramplan.models import load_architecture  # noqa: E402
from vramplan.planning.efficiency import shipped_factors  # noqa: E402
from vramplan.planning.traffic import step_traffic  # noqa: E402
from vramplan.training.saved import SavedTensorBytes  # noqa: E402
from vramplan.training.setup import build_training_setup  # noqa: E402

# the models of our H200 runs (benchmarks/results/gpu_validation.json), as those jobs ran
JOBS = [Job(model="llama-3.2-1b", batch_size=1, seq_len=64),
        Job(model="qwen2.5-0.5b", batch_size=1, seq_len=64),
        Job(model="gemma-2-2b", batch_size=1, seq_len=64, attention="eager"),
        Job(model="gpt2-medium", batch_size=1, seq_len=64),
        Job(model="bert-base-uncased", batch_size=1, seq_len=64),
        Job(model="vit-base-patch16-224", batch_size=1),
        Job(model="t5-base", batch_size=1, seq_len=64, precision="bf16-pure"),
        Job(model="whisper-small", batch_size=1, seq_len=64)]
SHRUNK = {"hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128,
          "n_inner": 128, "d_ff": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
          "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "encoder_attention_heads": 4,
          "decoder_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16,
          "vocab_size": 512}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _step(setup, forward=None, backward=None) -> None:
    """One forward (under `forward`, a context) and backward (under `backward`) of the
    setup's own batch."""
    batch = setup.make_batch()
    with forward or contextlib.nullcontext(), setup.autocast():
        loss = setup.compute_loss(setup.model, batch)
    with backward or contextlib.nullcontext():
        loss.backward()
    setup.model.zero_grad(set_to_none=True)


def _step_ops(job: Job, depth: int) -> tuple[int, int, float, float]:
    """(forward ops, backward ops, seconds per step untimed by the counter, the same with
    `vramplan measure`'s hooks on: saved-tensor recording and a per-parameter gradient hook)
    at `depth`."""
    setup = _shrunk_setup(job, depth)
    _step(setup)  # warm-up
    forward, backward = _Count(), _Count()
    _step(setup, forward, backward)

    def timed(hooked: bool) -> float:
        saved = SavedTensorBytes([*setup.model.parameters()])
        hooks = [q.register_post_accumulate_grad_hook(lambda q: None)
                 for q in setup.model.parameters() if q.requires_grad] if hooked else []
        times = []
        for _ in range(2 if QUICK else 7):
            start = time.perf_counter()
            if hooked:
                saved.reset()
            _step(setup, saved.recording() if hooked else None)
            times.append(time.perf_counter() - start)
        for hook in hooks:
            hook.remove()
        return statistics.median(times)

    plain = timed(False)
    return forward.ops, backward.ops, plain, timed(True)


SAC_MODELS = ("llama-3.2-1b", "qwen2.5-0.5b")
SAC_DEPTHS = (2, 6)


def _shrunk_setup(job: Job, depth: int):
    """The job's training setup (training/setup.py) on the CPU, its model shrunk (SHRUNK)
    to `depth` blocks."""
    return build_training_setup(job, "cpu", model_config=shrunk_config(job.model, depth,
                                                                       SHRUNK))


def _step_seconds(setup, repeats: int) -> float:
    """Median seconds of one forward + backward of the setup's own batch."""
    for _ in range(3):  # warm-up
        _step(setup)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _step(setup)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _block_host_ms(model: str, checkpointing: str) -> float:
    """Host milliseconds per block of a tiny-tensor step (the 6-block step less the 2-block
    one, over the 4 blocks between)."""
    job = Job(model=model, batch_size=1, seq_len=64, checkpointing=checkpointing)
    small, large = (_step_seconds(_shrunk_setup(job, d), 5 if QUICK else 15)
                    for d in SAC_DEPTHS)
    return 1e3 * (large - small) / (SAC_DEPTHS[1] - SAC_DEPTHS[0])


def sac_host_scale() -> dict:
    """Per model: each policy's host time per block, and the scale of the forward's host work
    under it: full checkpointing adds one plain forward (full - none); the policy's step
    runs forward and recompute under it, so scale = 1 + (policy - full) / (2 (full - none))."""
    rows = []
    for model in SAC_MODELS[:1] if QUICK else SAC_MODELS:
        ms = {c: _block_host_ms(model, c) for c in ("none", "full", *OP_LEVEL_CHECKPOINTING)}
        forward = ms["full"] - ms["none"]
        rows.append({"model": model, "block_host_ms": ms, "scale": {
            c: 1 + (ms[c] - ms["full"]) / (2 * forward) for c in OP_LEVEL_CHECKPOINTING}})
    return {"rows": rows, "median": statistics.median(
        r["scale"][c] for r in rows for c in OP_LEVEL_CHECKPOINTING)}


def main() -> None:
    torch.manual_seed(0)
    shares = shipped_factors("hopper")
    rows = []
    for job in JOBS[:2] if QUICK else JOBS:
        f1, b1, _, _ = _step_ops(job, 1)
        f2, b2, seconds, hooked = _step_ops(job, 2)
        arch = load_architecture(job.model)
        depth = arch.stacks[0].num_layers
        real = {"forward": f1 + (f2 - f1) * (depth - 1), "backward": b1 + (b2 - b1) * (depth - 1)}
        kernels = step_traffic(job, arch).kernels
        rows.append({
            "model": job.model, "blocks": depth, "ops_per_block": {
                "forward": f2 - f1, "backward": b2 - b1},
            "ops": real, "traffic_kernels": {p: kernels[p] for p in real},
            "ops_per_kernel": {p: real[p] / kernels[p] for p in real},
            "cpu_us_per_op": 1e6 * seconds / (f2 + b2),
            "measure_hooks_extra": hooked / seconds - 1})
    per_kernel = [r["ops_per_kernel"][p] for r in rows for p in ("forward", "backward")]
    result = {"machine": machine_line() + f", torch {torch.__version__}", "rows": rows,
              "kernel_us_shipped": shares.kernel_us,
              "ops_per_kernel_median": statistics.median(per_kernel),
              "kernel_us_per_op_implied": shares.kernel_us / statistics.median(per_kernel),
              "cpu_us_per_op_median": statistics.median(r["cpu_us_per_op"] for r in rows),
              "measure_hooks_extra_median": statistics.median(r["measure_hooks_extra"]
                                                              for r in rows),
              "selective_checkpointing": sac_host_scale(),
              "quick": QUICK}
    lines = ["# Host work of an eager step: dispatched aten ops vs traffic.py's kernels", "",
             f"Counted on {result['machine']} (the counts do not depend on the device). "
             "bf16 autocast unless the job says otherwise; the real depth from the "
             "1- and 2-block counts.", "",
             "| model | blocks | ops per block fwd / bwd | step ops fwd / bwd | traffic.py "
             "kernels fwd / bwd | ops per kernel fwd / bwd | us per op on this CPU | "
             "measure's hooks: extra step time |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        o, k, q = r["ops"], r["traffic_kernels"], r["ops_per_kernel"]
        lines.append(f"| {r['model']} | {r['blocks']} | {r['ops_per_block']['forward']} / "
                     f"{r['ops_per_block']['backward']} | {o['forward']:,} / "
                     f"{o['backward']:,} | {k['forward']:,.0f} / {k['backward']:,.0f} | "
                     f"{q['forward']:.2f} / {q['backward']:.2f} | {r['cpu_us_per_op']:.1f} | "
                     f"{100 * r['measure_hooks_extra']:+.0f}% |")
    lines += ["", f"Median {result['ops_per_kernel_median']:.2f} dispatched ops per kernel "
              f"traffic.py counts: the shipped {result['kernel_us_shipped']:.1f} us per kernel "
              f"is {result['kernel_us_per_op_implied']:.1f} us per dispatched op. This CPU "
              f"runs a tiny-tensor step at {result['cpu_us_per_op_median']:.1f} us per op "
              "(its kernels included). `vramplan measure`'s hooks (saved-tensor recording, "
              "a hook per parameter's gradient), which were on when our H200 runs were "
              f"timed, add {100 * result['measure_hooks_extra_median']:.0f}% (median) to "
              "this host-bound tiny step.", "",
              "Selective activation checkpointing's policy (torch's "
              "create_selective_checkpoint_contexts), host milliseconds per block of a "
              f"tiny-tensor step ({SAC_DEPTHS[1]} blocks less {SAC_DEPTHS[0]}):", "",
              "| model | none | full | selective | selective:torchtitan-op | forward host "
              "scale: selective / torchtitan-op |", "|---|---:|---:|---:|---:|---:|"]
    sac = result["selective_checkpointing"]
    for r in sac["rows"]:
        ms, sc = r["block_host_ms"], r["scale"]
        lines.append(f"| {r['model']} | {ms['none']:.2f} | {ms['full']:.2f} | "
                     f"{ms['selective']:.2f} | {ms['selective:torchtitan-op']:.2f} | "
                     f"{sc['selective']:.2f} / {sc['selective:torchtitan-op']:.2f} |")
    lines += ["", f"Median scale {sac['median']:.2f}: under the policy a block's forward and "
              "its recompute take that many times a plain forward's host work "
              "(efficiency.toml [selective_checkpointing] host_scale)."]
    write_results("host_ops", result, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
