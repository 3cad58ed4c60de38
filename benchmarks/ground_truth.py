"""Ground truth for tests and benchmarks: the job's steps run for real on the CPU, the
peak read from the allocator's own events (torch.profiler), not from the Python hooks the
trace uses. Not an engine: nothing in the package calls it, so it lives here (the tests import
benchmarks.ground_truth; the benchmarks, run as scripts, ground_truth)."""

from __future__ import annotations

import json
import os
import tempfile

import torch

from vramplan.engines.trace import STEPS
from vramplan.job import Job
from vramplan.training.kernels import trace_kernels
from vramplan.training.patches import transformers_quirks
from vramplan.training.setup import build_training_setup, train_step


def cpu_profiler_peak(job: Job, *, model_config: dict | None = None, seed: int = 0,
                      onednn: bool = False) -> int:
    """Run the job's STEPS for real on the CPU; the peak live bytes of step STEPS from
    torch.profiler's allocator memory events (unrounded: the CPU allocator does not round).

    Parameters and buffers exist before profiling starts; their bytes are added. oneDNN
    is off by default: its bf16 matmul and convolution kernels allocate scratch buffers
    that no CUDA kernel has (CUDA's own library workspaces are a separate, noted gap)."""
    torch.manual_seed(seed)
    with transformers_quirks(), torch.backends.mkldnn.flags(enabled=onednn):
        setup = build_training_setup(job, "cpu", model_config=model_config,
                                     kernels=trace_kernels(job))  # the trace's kernels
        base = _storage_bytes(list(setup.model.parameters()) + list(setup.model.buffers()))
        from torch.profiler import ProfilerActivity, profile, record_function
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for step in range(1, STEPS + 1):
                with record_function(f"vramplan_step_{step}"):
                    train_step(setup, job.grad_accum)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            events = json.load(handle)["traceEvents"]
    window = next(e for e in events if e.get("name") == f"vramplan_step_{STEPS}")
    t0, t1 = window["ts"], window["ts"] + window["dur"]
    sizes: dict[int, int] = {}
    live, peak = 0, 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"),
                        key=lambda e: e["ts"]):
        args = event["args"]
        if args.get("Device Type", 0) != 0:  # CPU only
            continue
        addr, nbytes = args["Addr"], args["Bytes"]
        if nbytes > 0:
            sizes[addr] = nbytes
            live += nbytes
        elif addr in sizes:
            live -= sizes.pop(addr)
        if t0 <= event["ts"] <= t1:
            peak = max(peak, live)
    return base + peak


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


