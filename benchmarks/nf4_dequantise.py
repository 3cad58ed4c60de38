"""torchao's NF4 dequantising, counted on its own code: the kernels, bytes and live memory
of NF4Tensor.get_original_weight (what torchtune's QLoRA runs for every linear call).

vramplan times torchtune's QLoRA with planning/traffic.py TORCHAO_NF4_EAGER (bytes read and
written and kernels per weight element, read from torchao's code) and plans its memory with
engines/param_memory.py TORCHAO_NF4_DEQUANTISE_PEAK. This runs the installed torchao on CPU
tensors under a dispatch mode that records every aten op that is not a view: the bytes of
its tensor inputs and outputs, and the storages alive at each point, and compares.

    PYTHONPATH=. python benchmarks/nf4_dequantise.py   # writes results/nf4_dequantise.{json,md}
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from common import QUICK, machine_line, write_results  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from vramplan.engines.param_memory import TORCHAO_NF4_DEQUANTISE_PEAK  # noqa: E402
from vramplan.planning.traffic import TORCHAO_NF4_EAGER  # noqa: E402

# (out, in) features: Llama 3.2 1B's MLP and attention linears, Llama 3.1 8B's MLP
SHAPES = [(8192, 2048), (2048, 2048)] if QUICK else [(8192, 2048), (2048, 2048),
                                                     (512, 2048), (14336, 4096)]


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Tally(TorchDispatchMode):
    """Kernels (aten ops that are not views), their bytes, and the peak of live storages."""

    def __init__(self):
        super().__init__()
        self.kernels = self.read = self.written = self.live = self.peak = 0
        self.alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor)]
        inputs = {a.untyped_storage().data_ptr(): a.untyped_storage().nbytes()
                  for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        if outs and all(o.untyped_storage().data_ptr() in inputs for o in outs):
            return out  # a view (its output aliases an input) launches and allocates nothing
        self.kernels += 1
        # each input storage read once: an expanded (broadcast) input is its small storage
        self.read += sum(inputs.values())
        for o in outs:
            self.written += _bytes(o)
            storage = o.untyped_storage()
            key = storage.data_ptr()
            if key not in self.alive:
                self.alive.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, storage.nbytes(), key)
        return out

    def _free(self, nbytes: int, key: int) -> None:
        self.live -= nbytes
        self.alive.discard(key)


def main() -> None:
    from torchao.quantization import to_nf4

    torch.manual_seed(0)
    rows = []
    for shape in SHAPES:
        nf4 = to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
        n = shape[0] * shape[1]
        tally = _Tally()
        with tally:
            nf4.get_original_weight()
        rows.append({"shape": list(shape), "kernels": tally.kernels,
                     "bytes_per_weight": (tally.read + tally.written) / n,
                     "peak_bytes_per_weight": tally.peak / n})
    modelled_bytes = sum(r + w for _, r, w, _ in TORCHAO_NF4_EAGER)
    modelled_kernels = sum(k for *_, k in TORCHAO_NF4_EAGER)
    import torchao

    result = {"machine": f"{machine_line()}, torch {torch.__version__}, "
                         f"torchao {torchao.__version__}",
              "rows": rows, "modelled": {"kernels": modelled_kernels,
                                         "bytes_per_weight": modelled_bytes,
                                         "peak_bytes_per_weight": TORCHAO_NF4_DEQUANTISE_PEAK},
              "quick": QUICK}
    lines = ["# torchao's NF4 dequantising, counted on its code", "",
             f"On {result['machine']}: NF4Tensor.get_original_weight of a bf16 weight "
             "(to_nf4 defaults: blocks of 64, scalers in blocks of 256), every non-view aten op "
             "counted. Modelled (traffic.py TORCHAO_NF4_EAGER, param_memory.py "
             f"TORCHAO_NF4_DEQUANTISE_PEAK): {modelled_kernels} kernels, "
             f"{modelled_bytes:.2f} bytes moved and {TORCHAO_NF4_DEQUANTISE_PEAK} bytes live "
             "at the peak per weight.", "",
             "| weight | kernels | bytes moved per weight | live at the peak per weight |",
             "|---|---:|---:|---:|"]
    lines += [f"| {r['shape'][0]} x {r['shape'][1]} | {r['kernels']} | "
              f"{r['bytes_per_weight']:.2f} | {r['peak_bytes_per_weight']:.2f} |" for r in rows]
    write_results("nf4_dequantise", result, "\n".join(lines) + "\n")
    print("\n".join(lines))
    for r in rows:  # the benchmark fails when torchao's code no longer does what is modelled
        assert r["kernels"] == modelled_kernels, r
        assert abs(r["bytes_per_weight"] / modelled_bytes - 1) < 0.02, r
        assert abs(r["peak_bytes_per_weight"] / TORCHAO_NF4_DEQUANTISE_PEAK - 1) < 0.02, r


if __name__ == "__main__":
    main()
