"""What each optimizer implementation does per step, counted on its own code, against the
table planning/traffic.py times the optimizer step with (OPTIMIZER_STEPS: bytes per
element, kernels per tensor, the foreach ops' tensor lists launched through
foreach_launches, and whether the device is synchronised after every tensor).

The installed torch.optim (AdamW, Adam, SGD, Adafactor), transformers' Adafactor (as the HF
Trainer builds it for optim="adafactor": trainer_optimizer.py _get_adafactor),
bitsandbytes' AdamW / Lion and vramplan's own Lion step CPU tensors shaped like one Llama 3.2
1B layer (its 7 linear weights, and its 2 norm weights apart) under a dispatch mode that
records every aten op that is not a view. The second step is counted (the first makes the
states). What the CPU run says about CUDA:
* an op on 0-dim tensors none of which came from a device tensor (torch's step counters,
  on the CPU unless fused or capturable) is host work, not a kernel;
* aten._local_scalar_dense of a device tensor (.item(), bool(), Python's max()) is a
  host-device synchronisation;
* any other op is one kernel, except a foreach op: one aten op covers a list of tensors,
  and CUDA's multi_tensor_apply launches one kernel per group of chunks, replayed by
  `launches` below; a foreach op off its fast route (ForeachUtils.h
  check_fast_path_restrictions) launches one kernel per tensor;
* bytes: each input storage read once, each output and mutated tensor written once.
bitsandbytes' CUDA update is one kernel per tensor (csrc/cuda/optimizers.cu, not in the
wheel), and its Optimizer8bit.step synchronises after every tensor (checked on its source).

    PYTHONPATH=. python benchmarks/optimizer_ops.py   # writes results/optimizer_ops.{json,md}
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import warnings
import weakref
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from common import QUICK, machine_line, write_results  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from vramplan.job import Job  # noqa: E402
from vramplan.planning.traffic import Traffic, _optimizer, optimizer_step  # noqa: E402

# ATen/native/cuda/MultiTensorApply.cuh (torch 2.13): a block takes kChunkSize elements of one
# tensor; a launch holds at most depth_to_max_blocks blocks and depth_to_max_tensors[depth-1]
# tensors (_scalarlist: ops with a scalar per tensor). The first table when
# `CUDART_VERSION >= 13000 && !defined(USE_ROCM)`, else the second.
CHUNK = 65536
MTA = {"cuda13": ((770, 448, 336, 252, 210), (672, 448, 336, 252, 210), 2240),
       "cuda12": ((110, 64, 48, 36, 30), (96, 64, 48, 36, 30), 320)}

H, F, KV = (128, 512, 32) if QUICK else (2048, 8192, 512)  # hidden, MLP (ffn), k/v width
MATRICES = [(H, H), (KV, H), (KV, H), (H, H), (F, H), (F, H), (H, F)]
VECTORS = [(H,), (H,)]


def _llama_8b() -> list[tuple[int, ...]]:
    """Llama 3.1 8B's 291 tensors in named_parameters order."""
    layer = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096),
             (14336, 4096), (4096, 14336), (4096,), (4096,)]
    return [(128256, 4096)] + layer * 32 + [(4096,), (128256, 4096)]


def _lora_16() -> list[tuple[int, ...]]:
    """LoRA rank 16 on q, k, v, o of Llama 3.1 8B: lora_A, lora_B of each, 32 layers."""
    return [(16, 4096), (4096, 16), (16, 4096), (1024, 16), (16, 4096), (1024, 16),
            (16, 4096), (4096, 16)] * 32


def launches(numels: list[int], depth: int, scalarlist: bool, table: str) -> int:
    """multi_tensor_apply's kernel launches for one foreach op: its loops (lines 175-251 with
    a scalar list, 270-336, 353-420 fused optimizers) replayed. About
    max(sum(ceil(n / CHUNK)) / max blocks, tensors / max tensors), rounded up."""
    tensors_max, scalarlist_max, blocks_max = MTA[table]
    most = (scalarlist_max if scalarlist else tensors_max)[depth - 1]
    count = blocks = tensors = 0
    for n in filter(None, numels):  # empty tensors are skipped
        chunks = -(-n // CHUNK)
        tensors += 1
        while chunks:
            taken = min(chunks, blocks_max - blocks)
            blocks += taken
            chunks -= taken
            if blocks == blocks_max or (chunks == 0 and tensors == most):
                count, blocks = count + 1, 0
                tensors = 1 if chunks else 0  # a tensor cut across launches starts the next
    return count + (blocks > 0)


NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
WRITE_ONLY = {"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_"}  # self unread
READS_NOTHING = {"zeros_like", "ones_like", "full_like"}  # take the input's shape only
# bitsandbytes marks every tensor mutable; its kernels write these (optimizers.cu)
BNB_WRITES = {"p", "state1", "state2", "absmax1", "absmax2", "unorm_vec"}


def _nbytes(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())  # broadcast: storage


class _Tally(TorchDispatchMode):
    """Each op that is not a view: kernel (with its bytes), foreach op, host op or sync."""

    def __init__(self, device_scalars=()):
        super().__init__()
        self.device = weakref.WeakSet(device_scalars)  # 0-dim tensors that live on the GPU
        self.kernels: Counter = Counter()
        self.foreach: list[dict] = []
        self.read = self.written = self.host = self.syncs = 0

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.dim() > 0 or t in self.device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        name = schema.name.split("::")[1]
        if schema.name.startswith("profiler::"):
            return out  # record_function markers
        if any(r.alias_info and not r.alias_info.is_write for r in schema.returns):
            return out  # a view
        if name in NO_KERNEL:
            return out  # allocates, launches nothing
        bound = list(zip(schema.arguments, args)) + [
            (a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs]
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not any(self._on_device(t) for t in tensors):
            self.host += 1
            return out
        if name == "_local_scalar_dense":
            self.syncs += 1
            return out
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.device.update(t for t in outs if t.dim() == 0)
        self._count_bytes(name, schema.name, bound, outs)
        if name.startswith(("_foreach_", "_fused_")):
            self.foreach.append(_foreach_record(name, bound, out))
        else:
            self.kernels[name] += 1
        return out

    def _count_bytes(self, name: str, qualified: str, bound, outs) -> None:
        read, written = {}, {}
        unscales = any(a.name == "grad_scale" and v is not None for a, v in bound)
        for arg, value in bound:
            leaves = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            writes = arg.alias_info is not None and arg.alias_info.is_write
            if qualified.startswith("bitsandbytes::"):
                writes = arg.name in BNB_WRITES
            if name.startswith("_fused_") and arg.name == "grads":
                writes = unscales  # stored only when unscaled (fused_adam_utils.cuh)
            for t in leaves:
                key = t.untyped_storage().data_ptr()
                if name not in READS_NOTHING and not (
                        writes and (name in WRITE_ONLY or arg.name == "out")):
                    read[key] = max(read.get(key, 0), _nbytes(t))
                if writes:
                    written[key] = _nbytes(t)
        for t in outs:  # a new tensor (an in-place op's output is its mutated input)
            written.setdefault(t.untyped_storage().data_ptr(), _nbytes(t))
        self.read += sum(read.values())
        self.written += sum(written.values())


def _fast_route(lists: list[list[torch.Tensor]]) -> bool:
    """ForeachUtils.h check_fast_path_restrictions: one dtype and device, dense tensors,
    the same sizes and strides across lists (here: contiguous, the same shapes)."""
    first = lists[0][0]
    for tensors in lists:
        for t, lead in zip(tensors, lists[0]):
            if t.dtype != first.dtype or not t.is_contiguous() or t.shape != lead.shape:
                return False
    return True


def _foreach_record(name: str, bound, out) -> dict:
    """A foreach op's depth (tensor lists, the output list included), whether it takes a
    scalar per tensor, and its tensors. Fused optimizers count their non-empty lists, less
    state_steps (fused_adam_utils.cuh: depth 4 for Adam, 5 with AMSGrad)."""
    lists = [v for a, v in bound if str(a.type).startswith("List[Tensor") and v]
    if name.startswith("_fused_"):
        lists = [v for a, v in bound if str(a.type).startswith("List[Tensor") and v
                 and a.name != "state_steps"]
    elif isinstance(out, (list, tuple)) and out:
        lists = lists + [list(out)]
    scalarlist = any(str(a.type) == "List[number]" and v for a, v in bound)
    numels = [t.numel() for t in lists[0]]
    return {"op": name, "depth": len(lists), "scalarlist": scalarlist and not
            name.startswith("_fused_"), "steps": all(t.dim() == 0 for t in lists[0]),
            "fast": _fast_route(lists), "tensors": len(numels), "numels": numels}


def _params(shapes, dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
        p.grad = torch.randn(shape, generator=gen).to(dtype)
        params.append(p)
    return params


def measure(build, shapes, dtype, fused_steps: bool) -> dict:
    """Aten ops, bytes and syncs of one steady-state step (the second) over `shapes`."""
    params = _params(shapes, dtype)
    optimizer = build(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes: paged states fall back on the CPU
        optimizer.step()
    steps = [s["step"] for s in optimizer.state.values() if torch.is_tensor(s.get("step"))]
    tally = _Tally(steps if fused_steps else ())
    with tally:
        optimizer.step()
    elements = sum(p.numel() for p in params)
    return {"tensors": len(params), "elements": elements, "kernels": dict(tally.kernels),
            "foreach": [{k: v for k, v in f.items() if k not in ("numels", "tensors")}
                        for f in tally.foreach],
            "_foreach": tally.foreach, "bytes_per_element": (tally.read + tally.written)
            / elements, "syncs": tally.syncs, "host_ops": tally.host,
            **_bnb_cuda_only(optimizer, params)}


def _bnb_cuda_only(optimizer, params) -> dict:
    """What a bitsandbytes step does on CUDA only, read from optimizer.py Optimizer8bit:
    step() syncs after each tensor (and once more after a paged step); prefetch_state
    prefetches (cudaMemPrefetchAsync) each paged state, paged when it has >= 1e5 elements
    (get_state_buffer)."""
    from bitsandbytes.optim.optimizer import Optimizer8bit

    if not isinstance(optimizer, Optimizer8bit):
        return {"cuda_syncs": 0, "paged": False, "states_per_tensor": 0, "prefetches": 0}
    states = sum(k in optimizer.state[params[0]] for k in ("state1", "state2"))
    paged = bool(optimizer.is_paged)
    return {"cuda_syncs": bnb_syncs_per_tensor() * len(params) + paged, "paged": paged,
            "states_per_tensor": states,
            "prefetches": paged * states * sum(p.numel() >= 1e5 for p in params)}


def _per_tensor(run: dict) -> float:
    return sum(run["kernels"].values()) / run["tensors"]


def foreach_launches(ops: list[dict], shapes, table: str) -> int:
    """CUDA kernels of the foreach ops of one call, replayed over tensors of `shapes`."""
    numels = [math.prod(s) for s in shapes]
    total = 0
    for f in ops:
        sizes = [1] * len(numels) if f["steps"] else numels
        total += launches(sizes, f["depth"], f["scalarlist"], table) if f["fast"] else len(sizes)
    return total


def project(row: dict, shapes, table: str) -> int:
    """Kernels the measured step launches on CUDA over a model's tensors: per-tensor ops
    by kind (2-D, 1-D), foreach ops over one list of all tensors, or a list per kind where
    the implementation groups them apart (torch's Adafactor)."""
    kinds = {"2-D": [s for s in shapes if len(s) >= 2], "1-D": [s for s in shapes if len(s) == 1]}
    total = sum(_per_tensor(row[k]) * len(kinds[k]) for k in kinds)
    if row["2-D"]["foreach"] == row["1-D"]["foreach"]:
        groups = [(row["2-D"]["_foreach"], shapes)]
    else:
        groups = [(row[k]["_foreach"], kinds[k]) for k in kinds if kinds[k]]
    return round(total) + sum(foreach_launches(ops, s, table) for ops, s in groups)


def modelled(key, precision: str, elements: int, tensors: tuple[int, int]) -> dict | None:
    """What traffic.py's _optimizer charges the step over (2-D, 1-D) tensors: bytes per
    element, kernels and whether it synchronises after every tensor."""
    if key is None:
        return None
    kernels = {}

    class ByOp(Traffic):
        def add(self, op, phase, nbytes, count=1.0):
            super().add(op, phase, nbytes, count)
            kernels[op] = kernels.get(op, 0) + count

    job = Job(precision=precision, optimizer=key[0], optimizer_impl=key[1])
    t = ByOp()
    _optimizer(job, elements, tensors, t)
    return {"bytes_per_element": t.by_op["optimizer"] / elements,
            "kernels": kernels["optimizer"], "syncs": optimizer_step(job).syncs,
            "key": list(key)}


def _implementations():
    """(name, build, traffic.py's (optimizer, optimizer_impl), fused steps, bf16 too)."""
    import bitsandbytes as bnb
    from transformers.optimization import Adafactor

    from vramplan.training.optimizers import Lion

    def opt(cls, **kw):
        return lambda ps: cls(ps, lr=1e-3, **kw)

    impls = []
    for cls, key in ((torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam")):
        for impl, kw in (("loop", dict(foreach=False)), ("foreach", dict(foreach=True)),
                         ("fused", dict(fused=True))):
            impls.append((f"torch {cls.__name__} {impl}", opt(cls, **kw), (key, impl),
                          impl == "fused", key == "adamw" and impl != "loop"))
    for momentum, key in ((0.0, "sgd"), (0.9, "sgd-momentum")):
        for impl, kw in (("loop", dict(foreach=False)), ("foreach", dict(foreach=True)),
                         ("fused", dict(fused=True))):
            impls.append((f"torch SGD momentum {momentum} {impl}",
                          opt(torch.optim.SGD, momentum=momentum, **kw), (key, impl), False,
                          False))
    # adafactor foreach is torch's; adafactor loop is transformers' (torch's own loop, which
    # CUDA tensors do not take by default, is not modelled)
    impls.append(("torch Adafactor loop", opt(torch.optim.Adafactor, foreach=False), None,
                  False, False))
    impls.append(("torch Adafactor foreach", opt(torch.optim.Adafactor, foreach=True),
                  ("adafactor", "foreach"), False, False))
    impls += [
        # hf-trainer.toml maps optim=adafactor to adafactor loop, lion_32bit to lion
        ("transformers Adafactor (HF Trainer)",
         opt(Adafactor, scale_parameter=False, relative_step=False),
         ("adafactor", "loop"), False, True),
        ("transformers Adafactor (its defaults)", lambda ps: Adafactor(ps), None, False,
         False),
        ("bitsandbytes AdamW 8-bit", opt(bnb.optim.AdamW, optim_bits=8),
         ("adamw-8bit", "foreach"), False, True),
        ("bitsandbytes PagedAdamW 8-bit", opt(bnb.optim.AdamW, optim_bits=8, is_paged=True),
         ("paged-adamw-8bit", "foreach"), False, False),
        ("bitsandbytes PagedAdamW 32-bit", opt(bnb.optim.AdamW, optim_bits=32, is_paged=True),
         ("paged-adamw", "foreach"), False, False),
        ("bitsandbytes Lion 32-bit", opt(bnb.optim.Lion, optim_bits=32),
         ("lion", "foreach"), False, False),
        ("bitsandbytes Lion 8-bit", opt(bnb.optim.Lion, optim_bits=8), None, False, False),
        ("vramplan Lion (training/optimizers.py)", opt(Lion), None, False, False),
    ]
    return impls


@functools.cache
def bnb_syncs_per_tensor() -> int:
    """1 if bitsandbytes' Optimizer8bit.step calls sync_gpu(p) (torch.cuda.synchronize on
    CUDA) inside its loop over the parameters, read from its source."""
    from bitsandbytes.optim.optimizer import Optimizer8bit

    lines = inspect.getsource(Optimizer8bit.step).splitlines()
    loop = next(i for i, line in enumerate(lines) if "for pindex, p in" in line)
    depth = len(lines[loop]) - len(lines[loop].lstrip())
    for line in lines[loop + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= depth:
            return 0  # the loop ended first
        if "sync_gpu(p)" in line:
            return 1
    return 0


def run_one(name, build, key, fused_steps, dtype) -> dict:
    precision = "fp32" if dtype == torch.float32 else "bf16-pure"
    row = {"implementation": name, "dtype": str(dtype).split(".")[1]}
    for kind, shapes in (("2-D", MATRICES), ("1-D", VECTORS)):
        run = measure(build, shapes, dtype, fused_steps)
        run["syncs"] += run["cuda_syncs"]
        run["cuda_launches"] = {t: round(_per_tensor(run) * len(shapes))
                                + foreach_launches(run["_foreach"], shapes, t) for t in MTA}
        split = (run["tensors"], 0) if kind == "2-D" else (0, run["tensors"])
        run["modelled"] = modelled(key, precision, run["elements"], split)
        row[kind] = run
    row["projections"] = {}
    for target, shapes in (("llama-3.1-8b full", _llama_8b()),
                           ("llama-3.1-8b lora-16", _lora_16())):
        matrices = sum(len(s) >= 2 for s in shapes)
        model = modelled(key, precision, sum(math.prod(s) for s in shapes),
                         (matrices, len(shapes) - matrices))
        runs = [row["2-D" if len(s) >= 2 else "1-D"] for s in shapes]
        paged = row["2-D"]["paged"]
        syncs = sum((r["syncs"] - paged) / r["tensors"] for r in runs) + paged  # +1 a step
        prefetches = paged * sum(r["states_per_tensor"] for r, s in zip(runs, shapes)
                                 if math.prod(s) >= 1e5)
        row["projections"][target] = {
            "tensors": len(shapes), "cuda_launches": {t: project(row, shapes, t) for t in MTA},
            "syncs": round(syncs), "prefetches": prefetches,
            "modelled_kernels": model and model["kernels"]}
    for kind in ("2-D", "1-D"):
        del row[kind]["_foreach"]
    return row


def _flag(run: dict, kind: str) -> str:
    model = run["modelled"]
    if model is None:
        return "not modelled"
    flags = []
    # 1-D tensors (norms, biases) hold a thousandth of a model's elements: their bytes are
    # modelled at the 2-D rate, and only their kernels are checked
    if kind == "2-D" and abs(run["bytes_per_element"] / model["bytes_per_element"] - 1) > 0.05:
        flags.append("bytes")
    if run["cuda_launches"]["cuda12"] != model["kernels"]:
        flags.append("kernels")
    if bool(run["syncs"]) != model["syncs"]:
        flags.append("syncs")
    return "MISMATCH: " + ", ".join(flags) if flags else "ok"


def _markdown(result: dict) -> str:
    lines = ["# Optimizer steps, counted on the libraries' code", "",
             f"On {result['machine']}. One steady-state step (the second) over one Llama "
             f"layer's {len(MATRICES)} linear weights (2-D, {H} hidden, {F} MLP) and its "
             f"{len(VECTORS)} norm weights (1-D) apart, every non-view aten op counted on CPU "
             "tensors. *aten ops*: per tensor for a per-tensor loop, per call for foreach "
             "and fused ops (one aten op per list). *CUDA launches*: what the same step "
             "launches on a GPU for that set (foreach ops replayed through "
             "multi_tensor_apply's chunking; CUDA 12 table / CUDA 13 table). *syncs*: "
             "host-device synchronisations per step on CUDA. *modelled*: traffic.py "
             "`_optimizer` for the same elements and tensors.", "",
             "| implementation | dtype | set | aten kernels per tensor | foreach/fused ops "
             "per call | CUDA launches (12 / 13) | syncs | bytes / element | modelled "
             "bytes / element | modelled kernels | check |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in result["rows"]:
        for kind in ("2-D", "1-D"):
            run = row[kind]
            model = run["modelled"] or {}
            per_tensor = sum(run["kernels"].values()) / run["tensors"]
            lines.append(
                f"| {row['implementation']} | {row['dtype']} | {kind} x {run['tensors']} | "
                f"{per_tensor:g} | {len(run['foreach'])} | {run['cuda_launches']['cuda12']} /"
                f" {run['cuda_launches']['cuda13']} | {run['syncs']} | "
                f"{run['bytes_per_element']:.2f} | "
                f"{format(model['bytes_per_element'], '.2f') if model else '-'} | "
                f"{model.get('kernels', '-')} | {_flag(run, kind)} |")
    lines += ["", "## Whole models on CUDA (fp32 weights, one step)", "",
              "| implementation | target | tensors | launches CUDA 12 | launches CUDA 13 | "
              "syncs | prefetches | modelled kernels |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        if row["dtype"] != "float32":
            continue
        for target, p in row["projections"].items():
            lines.append(f"| {row['implementation']} | {target} | {p['tensors']} | "
                         f"{p['cuda_launches']['cuda12']} | {p['cuda_launches']['cuda13']} | "
                         f"{p['syncs']} | {p['prefetches']} | {p['modelled_kernels'] or '-'} |")
    lines += ["", "Foreach launches (ATen/native/cuda/MultiTensorApply.cuh): walking the "
              "tensors in order, each takes ceil(numel / 65536) blocks; a launch is made when "
              "the blocks reach depth_to_max_blocks (320; 2240 with CUDA >= 13) or, at a "
              "tensor's last chunk, the tensors reach depth_to_max_tensors[depth - 1] "
              "(110, 64, 48, 36, 30; ops with a scalar per tensor 96, 64, 48, 36, 30; with "
              "CUDA >= 13: 770, 448, 336, 252, 210 and 672, ...), and once more for what is "
              "left: about max(sum ceil(n_i / 65536) / max_blocks, tensors / max_tensors) "
              "launches per op.", "",
              "Notes: bitsandbytes' syncs are Optimizer8bit.step's sync_gpu(p) after each "
              f"tensor ({result['bnb_syncs_per_tensor']} per tensor, read from its source) "
              "and one more after a paged step; its prefetches are prefetch_state's "
              "cudaMemPrefetchAsync of each paged state (tensors of >= 1e5 elements); its "
              "tensors under 4096 elements (min_8bit_size, the 1-D rows) keep fp32 states. "
              "transformers' Adafactor is a per-tensor loop: scale_parameter=True (its "
              "default, not the Trainer's) compares a norm in Python's max(), a sync per "
              "tensor. torch's Adafactor reads two norms with .item() per tensor, foreach "
              "or not.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    import bitsandbytes
    import transformers

    rows = []
    for name, build, key, fused_steps, bf16 in _implementations():
        for dtype in (torch.float32, torch.bfloat16) if bf16 else (torch.float32,):
            rows.append(run_one(name, build, key, fused_steps, dtype))
    result = {"machine": f"{machine_line()}, torch {torch.__version__}, transformers "
                         f"{transformers.__version__}, bitsandbytes {bitsandbytes.__version__}",
              "shapes": {"2-D": MATRICES, "1-D": VECTORS},
              "bnb_syncs_per_tensor": bnb_syncs_per_tensor(), "rows": rows, "quick": QUICK}
    markdown = _markdown(result)
    write_results("optimizer_ops", result, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
