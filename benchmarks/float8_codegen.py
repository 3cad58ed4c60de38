"""What Inductor makes of torchao's Float8Linear casts in a compiled block.

planning/traffic.py (_float8_casts) counts the casts of precision fp8, torchao's
Float8Linear in the blocks. Eager, each cast is torchao's own kernels. Compiled, two
questions set the count: does each linear cast its input on its own, or do linears that
read one tensor (q, k and v; gate and up) share one cast; and does the cast run as a kernel
of its own, or inside the kernel that produced the tensor (the norm)? This benchmark
compiles a Llama-style MLP block (RMSNorm, gate and up, SiLU times up, down) with
Float8Linear (emulated: the CPU has no fp8 matmul) on the CPU, runs forward and backward,
and reads Inductor's forward code: its fused kernels, and which input each matmul reads.

Emulation keeps the casts' float8 values in fp32, so the buffers' bytes are not the GPU's;
the kernels and the sharing are what it shows. This is Inductor's CPU code; the GPU's
Triton code comes from the same graph and scheduler but may fuse differently.

    PYTHONPATH=. python benchmarks/float8_codegen.py   # results/float8_codegen.*
"""

from __future__ import annotations

import io
import logging
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_line, write_results  # noqa: E402

TOKENS, HIDDEN, FFN = 2048, 256, 512
KERNEL = re.compile(r"^\s+(cpp_fused_\w+)\(", re.M)
MM = re.compile(r"extern_kernels\.mm\((\w+), (\w+), out=(\w+)\)")


def _block():
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.RMSNorm(HIDDEN)
            self.gate = torch.nn.Linear(HIDDEN, FFN, bias=False)
            self.up = torch.nn.Linear(HIDDEN, FFN, bias=False)
            self.down = torch.nn.Linear(FFN, HIDDEN, bias=False)

        def forward(self, x):
            y = self.norm(x)
            return x + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))

    return Block()


def forward_code() -> str:
    """Inductor's output code for one compiled forward and backward of the block."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    torch._dynamo.reset()
    block = _block().to(torch.bfloat16)
    convert_to_float8_training(block, config=Float8LinearConfig(emulate=True))
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    torch._logging.set_logs(output_code=True)
    logger = logging.getLogger("torch._inductor")
    logger.addHandler(handler)
    try:
        torch.compile(block)(x).sum().backward()
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs(output_code=False)
    code = stream.getvalue()
    # the forward graph's module comes first; the backward's starts at the next header
    second = code.find("# AOT ID", code.find("# AOT ID") + 1)
    return code if second < 0 else code[:second]


def main() -> None:
    import torchao

    code = forward_code()
    calls = list(dict.fromkeys(KERNEL.findall(code)))
    matmuls = MM.findall(code)
    inputs = [a for a, _, _ in matmuls]
    result = {
        "machine": machine_line(), "torchao": torchao.__version__,
        "shape": {"tokens": TOKENS, "hidden": HIDDEN, "ffn": FFN},
        "forward_kernels": calls,
        "forward_matmul_inputs": inputs,
        "gate_and_up_share_one_cast": len(inputs) >= 2 and inputs[0] == inputs[1],
        "norm_fused_with_cast": any("rsqrt" in k and "abs" in k and "max" in k
                                    for k in calls),
    }
    lines = ["# torchao Float8Linear in a compiled block: Inductor's forward code", "",
             f"{machine_line()}; torchao {torchao.__version__}; RMSNorm, gate and up, SiLU x "
             f"up, down on {TOKENS} x {HIDDEN} bf16 tokens (FFN {FFN}), Float8Linear "
             "emulated, Inductor's CPU code (see the script's docstring).", "",
             f"* gate and up read one cast of the normed input: "
             f"{result['gate_and_up_share_one_cast']} (the matmuls read "
             f"{', '.join(inputs)})",
             f"* the norm, the amax and the cast run in one fused kernel: "
             f"{result['norm_fused_with_cast']}", "", "Forward kernels:", ""]
    lines += [f"* `{k}`" for k in calls]
    write_results("float8_codegen", result, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
