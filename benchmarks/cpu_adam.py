"""How fast an offloaded optimizer step runs on the CPU, by implementation.

An offloaded optimizer (DeepSpeed's ZeRO-Offload, FSDP's CPUOffload, torchao's
CPUOffloadOptimizer) updates fp32 parameters, gradients and Adam states in CPU memory. Which
kernel does it decides the rate:
* torch.optim.AdamW on CPU tensors: its default there is the for-loop implementation
  (foreach is the default only for CUDA tensors), several memory passes per element;
  foreach=True falls back to the same per-tensor ops on the CPU; fused=True is one
  vectorised pass (torch's CPU fused kernel) -- torchao's CPUOffloadOptimizer asks for it
  (torchao/optim/cpu_offload.py: "default to fused CPU AdamW");
* DeepSpeed's CPUAdam (ZeRO-Offload's), its own vectorised C++ kernel, built on first use
  (timed when deepspeed is installed; CI has none).

    PYTHONPATH=. python benchmarks/cpu_adam.py     # writes results/cpu_adam.{json,md}

The committed results timed DeepSpeed 0.19.8 too, installed beside the venv
(`pip install --target /tmp/ds deepspeed`, its torch removed so the venv's 2.13.0+cpu runs;
PYTHONPATH=.:/tmp/ds DS_ACCELERATOR=cpu, with ninja and g++ to build the kernel).

Elements per second of one AdamW step over 128 Mi fp32 parameters in 16 tensors, the median
of 5 steps after one warm-up, with torch's threads as set (this machine's cores); and the
copy bandwidth of one 512 MiB fp32 tensor beside it. The rates are the machine's: a host
with more cores and memory channels runs the step faster.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402
from common import QUICK, host_cpu, machine_line, write_results  # noqa: E402

ELEMENTS = (8 if QUICK else 128) * 2**20
TENSORS = 16
STEPS = 2 if QUICK else 5


def _params() -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(ELEMENTS // TENSORS)) for _ in range(TENSORS)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _rate(optimizer) -> float:
    optimizer.step()  # warm-up: allocates the states (and builds DeepSpeed's kernel)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return ELEMENTS / statistics.median(times)


def _deepspeed_adam():
    """DeepSpeed's CPUAdam class, or why it cannot run here."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as error:  # not installed, or no accelerator it knows
        return None, f"deepspeed not importable here ({type(error).__name__})"
    return DeepSpeedCPUAdam, ""


def _copy_gb_s() -> float:
    a = torch.randn(ELEMENTS)
    b = torch.empty_like(a)
    b.copy_(a)
    start = time.perf_counter()
    for _ in range(STEPS):
        b.copy_(a)
    return 2 * a.nbytes * STEPS / (time.perf_counter() - start) / 1e9  # read + write


def main() -> None:
    torch.manual_seed(0)
    rows = {}
    for name, options in (("loop", {"foreach": False}), ("foreach", {"foreach": True}),
                          ("fused", {"fused": True})):
        rows[f"torch AdamW {name}"] = _rate(torch.optim.AdamW(_params(), lr=1e-3, **options))
    deepspeed, why = _deepspeed_adam()
    if deepspeed is not None:
        rows["DeepSpeed CPUAdam"] = _rate(deepspeed(_params(), lr=1e-3, adamw_mode=True))
    cpu = host_cpu().rsplit(",", 1)[0]  # (machine_line counts the CPUs)
    result = {"machine": f"{machine_line()}, {cpu}, torch {torch.__version__}, "
                         f"{torch.get_num_threads()} threads",
              "elements": ELEMENTS, "params_per_s": rows, "copy_gb_s": _copy_gb_s(),
              "deepspeed": why or "timed", "quick": QUICK}
    lines = ["# An offloaded AdamW step on the CPU, by implementation", "",
             f"On {result['machine']}; {ELEMENTS / 2**20:g} Mi fp32 parameters in {TENSORS} "
             f"tensors, median of {STEPS} steps. Copy bandwidth (read + write) "
             f"{result['copy_gb_s']:.1f} GB/s.", "",
             "| implementation | parameters per second | vs torch's CPU default (loop) |",
             "|---|---:|---:|"]
    loop = rows["torch AdamW loop"]
    lines += [f"| {name} | {rate / 1e9:.2f} G | {rate / loop:.1f}x |"
              for name, rate in rows.items()]
    if why:
        lines += ["", f"DeepSpeed's CPUAdam: {why}."]
    write_results("cpu_adam", result, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
