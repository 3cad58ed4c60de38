"""The memory-bound bytes and the linears' FLOPs of an eager step, as traffic.py and flops.py
count them and as a real step dispatches them.

The step-time model times everything that is not a matmul or attention from the bytes it
moves (planning/traffic.py: a count of the passes the eager code makes over each tensor,
never fitted), and the matmuls from their FLOPs (planning/flops.py). This benchmark checks
both against what transformers' and peft's own code dispatches: one training micro-batch of
the job (training/setup.py's train_step, with CUDA's autocast and dropout kernels, as the
trace runs it) on the CPU, its model shrunk to 1 and 2 blocks, each aten op charged one read
of every tensor it takes and one write of every tensor it returns (views move nothing; a
broadcast input counts its distinct elements). The difference of the two depths is one
block, set beside traffic.py's bytes per block at the same shapes. The counts do not depend
on the device; the model's shapes are shrunk so that the CPU runs them in seconds, with the
adapters' rank below every other width (their matmuls stream their inputs and outputs and
are counted here as traffic.py counts them: memory-bound).

    PYTHONPATH=. python benchmarks/traffic_vs_dispatch.py   # writes results/traffic_vs_dispatch.*
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections import defaultdict
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from common import QUICK, machine_line, shrunk_config, write_results  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from vramplan.job import Job  # noqa: E402
from vramplan.models.derive import architecture_from_config  # noqa: E402
from vramplan.planning.flops import step_flops  # noqa: E402
from vramplan.planning.traffic import step_traffic  # noqa: E402
from vramplan.training.emulate.lowbit import Packed4bitLinear  # noqa: E402
from vramplan.training.setup import build_training_setup, train_step  # noqa: E402

RANK = 8  # below every other width, so that an adapter's matmul is told by its shape
# the config keys of each family's widths, shrunk alike (GPT-2's and BERT's names too)
SHAPES = {"hidden_size": 256, "n_embd": 256, "intermediate_size": 704, "n_inner": 704,
          "num_attention_heads": 4, "n_head": 4, "num_key_value_heads": 4, "head_dim": 64,
          "vocab_size": 512}
BASE = dict(model="llama-3.2-1b", batch_size=2, seq_len=256)
QV = ("q_proj", "v_proj")
# each a setup of a published or own run the model misses (docs/performance.md)
JOBS = {
    "full, bf16 autocast": {},
    "full, bf16 autocast, checkpointed": dict(checkpointing="full"),
    "full, pure bf16": dict(precision="bf16-pure"),
    "full, bf16 autocast, eager attention": dict(attention="eager"),
    "GPT-2, full, bf16 autocast": dict(model="gpt2-medium"),
    "BERT, full, bf16 autocast (dropout)": dict(model="bert-base-uncased"),
    "Qwen2.5, full, bf16 autocast (q/k/v bias)": dict(model="qwen2.5-0.5b"),
    "Gemma-2, full, bf16 autocast, eager attention": dict(model="gemma-2-2b",
                                                          attention="eager"),
    "LoRA q,v, no dropout, pure bf16 (optimum-benchmark)": dict(
        precision="bf16-pure", peft=dict(rank=RANK, dropout=0.0, target_modules=QV)),
    "QLoRA q,v, no dropout, pure bf16, fp32 adapters (optimum-benchmark)": dict(
        precision="bf16-pure", peft=dict(method="qlora", rank=RANK, dropout=0.0,
                                         target_modules=QV, adapter_dtype="fp32",
                                         double_quant=False)),
    "QLoRA q,k,v + MLP, dropout 0.1, pure bf16, checkpointed (Answer.AI)": dict(
        precision="bf16-pure", checkpointing="full",
        peft=dict(method="qlora", rank=RANK, dropout=0.1, target_modules=(
            "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"))),
    "LoRA q,v, dropout 0.1, pure bf16, checkpointed (VectorLM)": dict(
        precision="bf16-pure", checkpointing="full",
        peft=dict(rank=RANK, dropout=0.1, target_modules=QV)),
    "LoRA q,k,v,o, dropout 0.05, bf16 autocast (our H200 runs)": dict(
        peft=dict(rank=RANK)),
    "LoRA q,k,v,o, dropout 0.05, bf16 autocast, checkpointed (our H200 runs)": dict(
        checkpointing="full", peft=dict(rank=RANK)),
    "LoRA every linear, dropout 0.05, bf16 autocast, checkpointed (fp32 adapters)": dict(
        checkpointing="full", peft=dict(rank=RANK, target_modules=("all-linear",))),
}
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
ATTENTION = ("_scaled_dot_product", "_efficient_attention", "_flash_attention")
VIEWS = ("_unsafe_view",)  # declared without an alias, but a view of its input
# ops that allocate without writing
NO_WRITE = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


def _elements(t: torch.Tensor) -> int:
    """Distinct elements a tensor addresses (a broadcast dimension, stride 0, counts once)."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) if t.dim() else 1


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class _Bytes(TorchDispatchMode):
    """Per phase: the bytes of memory-bound work (also per op name), the matmuls' FLOPs and
    the ops dispatched."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.bytes: dict = defaultdict(float)
        self.by_op: dict = defaultdict(float)
        self.flops: dict = defaultdict(float)
        self.ops: dict = defaultdict(int)
        self.paused = False  # inside a stand-in kernel, charged as the real one (_dequantise)

    def charge(self, name: str, nbytes: float) -> None:
        self.bytes[self.phase] += nbytes
        self.by_op[self.phase, name] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        self.ops[self.phase] += 1  # every dispatched op, views too (host_ops.py's count)
        name = func._schema.name.split("::")[-1]
        returns = func._schema.returns
        if name in VIEWS or any(r.alias_info is not None and not r.alias_info.is_write
                                for r in returns):
            return out  # a view moves nothing
        ins = _tensors(list(args) + list((kwargs or {}).values()))
        if name.startswith(ATTENTION):  # its FLOPs are timed apart; its inputs and outputs
            name = "attention io"       # stream through HBM as traffic.py's "attention io"
        if name in MATMULS:
            dims = {d for t in ins for d in t.shape[-2:]}
            if RANK not in dims:  # a compute-bound matmul: its FLOPs (bmm: eager attention's)
                a, b = ins[-2], ins[-1]
                kind = "attention" if name in ("bmm", "baddbmm") else "linear"
                self.flops[self.phase, kind] += 2 * math.prod(a.shape) * b.shape[-1]
                return out
            name = "adapter matmul"
        written = [] if name in NO_WRITE else _tensors(out)
        self.charge(name, sum(_elements(t) * t.element_size() for t in ins + written))
        return out


@contextlib.contextmanager
def _dequantise(counter: _Bytes):
    """The CPU's NF4 stand-in dequantises in several ops; bitsandbytes' dequantize_4bit is
    one kernel, charged as such: it reads the codes and absmax constants and writes the
    16-bit weight."""
    stand_in = Packed4bitLinear.dequantize

    def dequantize(layer, dtype):
        counter.paused = True
        try:
            weight = stand_in(layer, dtype)
        finally:
            counter.paused = False
        constants = [t for t in (layer.packed, layer.absmax, layer.absmax2) if t is not None]
        counter.ops[counter.phase] += 1
        counter.charge("dequantise", sum(t.numel() * t.element_size() for t in constants)
                       + weight.numel() * weight.element_size())
        return weight

    with mock.patch.object(Packed4bitLinear, "dequantize", dequantize):
        yield


def _config(model: str, depth: int) -> dict:
    return shrunk_config(model, depth, SHAPES)


def _dispatched(job: Job, depth: int) -> _Bytes:
    """The bytes one micro-batch of the job dispatches at `depth` blocks (the second of two
    steps: the first warms the optimizer's states up)."""
    setup = build_training_setup(job, "cpu", model_config=_config(job.model, depth))
    train_step(setup, 1)
    counter = _Bytes()

    def mark(phase: str) -> None:
        counter.phase = phase

    with counter, _dequantise(counter):
        train_step(setup, 1, mark)
    return counter


def _arch(job: Job, depth: int):
    return architecture_from_config(_config(job.model, depth), f"shrunk-{depth}")


def _modelled(job: Job, depth: int):
    return step_traffic(job, _arch(job, depth))


def compare(label: str, changes: dict) -> dict:
    job = Job(**{**BASE, **changes})
    one, two = _dispatched(job, 1), _dispatched(job, 2)
    m1, m2 = _modelled(job, 1), _modelled(job, 2)
    # checkpointing recomputes inside backward: the two phases are compared together
    dispatched = {"forward": two.bytes["forward"] - one.bytes["forward"],
                  "backward": two.bytes["backward"] - one.bytes["backward"]}
    modelled = {"forward": m2.bytes["forward"] - m1.bytes["forward"],
                "backward": (m2.bytes["backward"] + m2.bytes["recompute"])
                - (m1.bytes["backward"] + m1.bytes["recompute"])}
    ops = {}
    for (phase, name), nbytes in two.by_op.items():
        if phase in dispatched:
            ops[f"{phase} {name}"] = nbytes - one.by_op.get((phase, name), 0.0)
    modelled_ops = {}
    for (name, phase), nbytes in m2.by_op_phase.items():
        if phase in ("forward", "backward", "recompute"):
            key = f"{'forward' if phase == 'forward' else 'backward'} {name}"
            modelled_ops[key] = modelled_ops.get(key, 0.0) + nbytes - m1.by_op_phase.get(
                (name, phase), 0.0)
    # the linears' matmul FLOPs per block, against flops.py's (its "linear" class)
    f1, f2 = step_flops(job, _arch(job, 1)).by_class["linear"], step_flops(
        job, _arch(job, 2)).by_class["linear"]
    flops = {p: {"dispatched": two.flops[p, "linear"] - one.flops[p, "linear"],
                 "modelled": getattr(f2, p) - getattr(f1, p) + (
                     f2.recompute - f1.recompute if p == "backward" else 0)}
             for p in dispatched}
    # host work: dispatched ops per block against the kernels traffic.py counts (whose host
    # time per kernel, kernel_us, is fitted: only the ratio's steadiness matters)
    launches = {p: {"dispatched_ops": two.ops[p] - one.ops[p],
                    "traffic_kernels": m2.kernels[p] - m1.kernels[p]
                    + (m2.kernels["recompute"] - m1.kernels["recompute"] if p == "backward"
                       else 0)} for p in dispatched}
    return {"job": label, "changes": changes, "dispatched": dispatched, "modelled": modelled,
            "launches": launches, "linear_flops": flops,
            "ratio": {p: modelled[p] / dispatched[p] for p in dispatched},
            "dispatched_by_op": {k: v for k, v in sorted(ops.items()) if abs(v) > 0},
            "modelled_by_op": {k: v for k, v in sorted(modelled_ops.items()) if abs(v) > 0}}


def main() -> None:
    torch.manual_seed(0)
    jobs = list(JOBS.items())
    rows = [compare(label, changes) for label, changes in (jobs[::4] if QUICK else jobs)]
    result = {"machine": machine_line() + f", torch {torch.__version__}", "shapes": SHAPES,
              "base": BASE, "rank": RANK, "rows": rows, "quick": QUICK}
    lines = ["# Memory-bound bytes and matmul FLOPs per block: the model against a dispatched "
             "step", "",
             f"Counted on {result['machine']} (the counts do not depend on the device). "
             f"Blocks (Llama's unless named) shrunk to {SHAPES['hidden_size']} wide "
             f"({SHAPES['intermediate_size']} MLP, {SHAPES['num_attention_heads']} heads of "
             f"{SHAPES['head_dim']}), batch "
             f"{BASE['batch_size']} x {BASE['seq_len']} tokens, adapters of rank {RANK}; one "
             "block = the 2-block step less the 1-block one; backward includes the "
             "recomputation.", "",
             "| job | forward MB: dispatched / traffic.py | backward MB: dispatched / "
             "traffic.py | ops per block fwd / bwd: dispatched / traffic.py's kernels | "
             "linears' GFLOP fwd / bwd: dispatched / flops.py |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        d, m, k, f = r["dispatched"], r["modelled"], r["launches"], r["linear_flops"]
        gflop = " / ".join(f"{f[p]['dispatched'] / 1e9:.3f} / {f[p]['modelled'] / 1e9:.3f}"
                           for p in ("forward", "backward"))
        per = " / ".join(f"{k[p]['dispatched_ops']} / {k[p]['traffic_kernels']:g} "
                         f"({k[p]['dispatched_ops'] / k[p]['traffic_kernels']:.1f})"
                         for p in ("forward", "backward"))
        lines.append(f"| {r['job']} | {d['forward'] / 1e6:.1f} / {m['forward'] / 1e6:.1f} "
                     f"({r['ratio']['forward']:.2f}) | {d['backward'] / 1e6:.1f} / "
                     f"{m['backward'] / 1e6:.1f} ({r['ratio']['backward']:.2f}) | {per} | "
                     f"{gflop} |")
    write_results("traffic_vs_dispatch", result, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
