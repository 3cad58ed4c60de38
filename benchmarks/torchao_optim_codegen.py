"""What torchao's low-bit AdamW makes Inductor generate per parameter tensor.

torchao's AdamW8bit, AdamW4bit and AdamWFp8 (torchao/optim/adam.py) run one torch.compile'd
`single_param_adam` per parameter tensor. The performance model (planning/traffic.py,
TORCHAO_ADAM) needs two numbers per optimizer: the loop nests (kernels) of one call and the
bytes per element it moves. This benchmark compiles one step of each on a 1M-element fp32
parameter, on the CPU, and reads Inductor's output code: the loop nests it generated
(`torch._inductor.metrics.generated_kernel_count`) and the buffers it allocates. A buffer as
large as the parameter (or half of it, 4-bit codes) is a full-size intermediate: written
once and read once more than the ideal kernel (read p g m v, write p m v) needs.

This is Inductor's CPU code. The GPU's Triton code comes from the same graph and scheduler,
but may fuse differently (a block reduction of 256 elements fits one Triton program); a GPU
run of the same step would settle it (benchmarks/gpu_microbench.py does not yet).

    PYTHONPATH=. python benchmarks/torchao_optim_codegen.py   # results/torchao_optim_codegen.*
"""

from __future__ import annotations

import io
import logging
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, write_results  # noqa: E402

NUMEL = 1024 * 1024
ALLOC = re.compile(r"empty_strided_cpu\(\(([0-9, ]*)\), \([0-9, ]*\), torch\.([a-z0-9]+)\)")
BYTES = {"float32": 4, "int64": 8, "uint8": 1, "bfloat16": 2, "float8_e4m3fn": 1}


def one(name: str) -> dict:
    import torch
    import torch._inductor.metrics as metrics
    import torchao.optim as ao

    torch._dynamo.reset()
    param = torch.nn.Parameter(torch.randn(1024, 1024))
    param.grad = torch.randn_like(param)
    optimizer = getattr(ao, name)([param])
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    torch._logging.set_logs(output_code=True)
    logger = logging.getLogger("torch._inductor")
    logger.addHandler(handler)
    metrics.reset()
    try:
        optimizer.step()
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs(output_code=False)
    buffers = []
    for shape, dtype in ALLOC.findall(stream.getvalue()):
        numel = 1
        for d in shape.replace(" ", "").strip(",").split(","):
            numel *= int(d)
        buffers.append({"numel": numel, "dtype": dtype})
    full = [b for b in buffers if b["numel"] >= NUMEL // 2]
    # a full-size intermediate is written and read once: 2 x its bytes per parameter element
    extra = sum(2 * BYTES[b["dtype"]] * b["numel"] / NUMEL for b in full)
    return {"optimizer": name, "loop_nests": metrics.generated_kernel_count,
            "buffers": buffers, "full_size_intermediates": full,
            "intermediate_bytes_per_element": extra}


def main() -> None:
    import torchao

    rows = [one(name) for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8")]
    result = {"machine": machine_line(), "torchao": torchao.__version__, "numel": NUMEL,
              "rows": rows}
    lines = ["# torchao low-bit AdamW: Inductor's code per parameter tensor", "",
             f"{machine_line()}; torchao {torchao.__version__}; one step on a {NUMEL}-element "
             "fp32 parameter, Inductor's CPU code (see the script's docstring).", "",
             "| optimizer | loop nests per call | full-size intermediates | extra bytes per "
             "element (write + read) |", "|---|---:|---|---:|"]
    for r in rows:
        full = ", ".join(f"{b['dtype']} x{b['numel']}" for b in r["full_size_intermediates"])
        lines.append(f"| {r['optimizer']} | {r['loop_nests']} | {full or 'none'} | "
                     f"{r['intermediate_bytes_per_element']:.0f} |")
    write_results("torchao_optim_codegen", result, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
