"""measure: real training steps with synthetic data on the real device -> MemoryReport.

On CUDA the device says what it holds: torch's max allocated / reserved, NVML's used
memory (the context overhead is NVML used minus reserved) and utilization sampled in a
background thread. On the CPU the peak comes from the allocator's own memory events
(torch.profiler, profile_memory=True), not from Python hooks, so it is an independent
check of the trace engine; a byte budget turns a step over budget into BudgetExceeded,
which search treats like a CUDA out-of-memory error.

    >>> report = measure(Job(model="tiny-llama", batch_size=4, seq_len=256), steps=5)
    >>> report.peak_allocated, report.measured["step_time_median_s"]

The model, optimizer and synthetic batch come from vramplan.models.build, the same builders
the trace engine runs, so measure and trace see the same step.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vramplan.engines.report import CATEGORIES, MemoryReport
from vramplan.job import Job
from vramplan.search import BudgetExceeded, is_out_of_memory

CUDA_BLOCK = 512  # the caching allocator rounds every request up to 512 bytes


@dataclass
class Setup:
    """One training job, built: what measure runs. build.py makes it from a Job; tests and
    users can make one by hand."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    make_batch: Callable[[], dict]   # a fresh synthetic micro-batch on the device
    loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor] = lambda model, batch: (
        model(**batch).loss)
    autocast_dtype: torch.dtype | None = None  # bf16/fp16 mixed precision
    grad_scaler: bool = False        # fp16-mixed: dynamic loss scaling
    grad_accum: int = 1
    samples_per_micro: int = 1
    tokens_per_micro: int = 0
    model_name: str = ""
    notes: list[str] = field(default_factory=list)


# --- entry point ----------------------------------------------------------------------------


def measure(job: Job, *, steps: int = 5, warmup: int = 2, emulate_gpu: str | None = None,
            budget_bytes: int | None = None, device: str | None = None) -> MemoryReport:
    """Run `warmup` + `steps` optimizer steps of the job and report what the device saw.

    emulate_gpu: cap this process to that catalog GPU's usable memory (CUDA only).
    budget_bytes: a step that needs more raises BudgetExceeded (CUDA: a memory cap).
    Out-of-memory errors propagate (search relies on them); any other error in the step,
    and Ctrl-C, end the run early with a partial report that says why.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    setup = _build(job, device)
    return measure_setup(setup, job, steps=steps, warmup=warmup, emulate_gpu=emulate_gpu,
                         budget_bytes=budget_bytes, device=device)


def _build(job: Job, device: str) -> Setup:
    from vramplan.models import build  # the shared builders (imports transformers)
    return build.build_setup(job, device=device)


def measure_setup(setup: Setup, job: Job, *, steps: int = 5, warmup: int = 2,
                  emulate_gpu: str | None = None, budget_bytes: int | None = None,
                  device: str = "cpu") -> MemoryReport:
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0 (got steps={steps}, warmup={warmup})")
    cuda = torch.device(device).type == "cuda"
    probe = _CudaProbe(torch.device(device), emulate_gpu, budget_bytes) if cuda else (
        _CpuProbe(setup, budget_bytes, profiled_steps=warmup + 1))
    run = _Run(steps=warmup + steps, warmup=warmup)
    scaler = torch.amp.GradScaler(torch.device(device).type) if setup.grad_scaler else None
    probe.start()
    try:
        for index in range(warmup + steps):
            with probe.step(index):
                _train_step(setup, scaler, run, probe)
    except KeyboardInterrupt:
        run.stopped = "interrupted (Ctrl-C) after {} of {} steps".format(len(run.losses),
                                                                          run.total)
    except Exception as error:  # noqa: BLE001 - user code; out-of-memory goes to the caller
        if is_out_of_memory(error):
            raise
        run.stopped = f"stopped by {type(error).__name__}: {error}"
    finally:
        probe.stop()
    return _report(job, setup, run, probe)


# --- one optimizer step -----------------------------------------------------------------------


@dataclass
class _Run:
    steps: int
    warmup: int
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # per step, warm-up included
    skipped: int = 0      # fp16 steps the GradScaler skipped (inf/NaN gradients)
    non_finite: int = 0   # steps whose loss was NaN or Inf
    stopped: str = ""     # why the run ended early

    @property
    def total(self) -> int:
        return self.steps


def _train_step(setup: Setup, scaler, run: _Run, probe) -> None:
    model, optimizer = setup.model, setup.optimizer
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for _ in range(setup.grad_accum):
        with probe.phase("forward"):
            batch = setup.make_batch()
            with torch.autocast(probe.device.type, dtype=setup.autocast_dtype,
                                enabled=setup.autocast_dtype is not None):
                loss = setup.loss_fn(model, batch) / setup.grad_accum
        with probe.phase("backward"):
            (scaler.scale(loss) if scaler else loss).backward()
        total += loss.detach().float().item()  # also a device sync, so timing is honest
        del batch, loss
    with probe.phase("optimizer"):
        if scaler:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            run.skipped += scaler.get_scale() < before  # a lowered scale = a skipped step
        else:
            optimizer.step()
    probe.sync()
    run.step_times.append(time.perf_counter() - start)
    run.losses.append(total)
    run.non_finite += not math.isfinite(total)


# --- the report -------------------------------------------------------------------------------


def _report(job: Job, setup: Setup, run: _Run, probe) -> MemoryReport:
    sizes = tensor_bytes(setup, round_to=CUDA_BLOCK if probe.device.type == "cuda" else 1)
    peak = probe.peak_allocated()
    categories = dict.fromkeys(CATEGORIES, 0)
    categories.update(weights=sizes["weights"], optimizer_states=sizes["optimizer_states"])
    # Gradients exist in full from the end of backward to the optimizer step; at a forward
    # peak only accumulated ones (grad_accum > 1) are alive.
    if probe.peak_phase in ("backward", "optimizer") or setup.grad_accum > 1:
        categories["gradients"] = sizes["gradients"]
    categories["inputs"] = sizes["inputs"]
    known = sum(categories.values())
    categories["activations"] = max(0, peak - known)
    if peak < known:  # the peak came before some of them existed (e.g. the first step)
        categories["weights"] = peak - categories["optimizer_states"] - categories["inputs"]
    categories.update(probe.outside_allocator())
    params = list(setup.model.parameters())
    notes = list(setup.notes) + probe.notes + [
        "weights, gradients, optimizer states and inputs are summed from tensor sizes; "
        "activations are the rest of the measured peak (saved tensors plus temporaries)"]
    if run.stopped:
        notes.append(f"partial run: {run.stopped}")
    timed = run.step_times[run.warmup:] or run.step_times
    timed = probe.timing_steps(run.step_times, run.warmup) or timed
    measured = {
        "device": probe.device_name,
        "steps": len(run.losses), "warmup": run.warmup, "steps_planned": run.total,
        "complete": not run.stopped, "stopped": run.stopped,
        "step_time_median_s": statistics.median(timed) if timed else None,
        "step_time_p90_s": p90(timed),
        "losses": run.losses, "non_finite_losses": run.non_finite, "skipped_steps": run.skipped,
        "peak_allocated": peak, **probe.measured(),
    }
    if measured["step_time_median_s"]:
        samples = setup.samples_per_micro * setup.grad_accum
        measured["samples_per_s"] = samples / measured["step_time_median_s"]
        measured["tokens_per_s"] = (setup.tokens_per_micro * setup.grad_accum
                                    / measured["step_time_median_s"])
    return MemoryReport(
        engine="measure", job=job.model_dump(mode="json"),
        model_name=setup.model_name or job.model,
        params_total=sum(p.numel() for p in params),
        params_trainable=sum(p.numel() for p in params if p.requires_grad),
        categories=categories, phase_peaks=probe.phase_peaks, peak_phase=probe.peak_phase,
        runtime_gpu=probe.runtime_gpu, tokens_per_step=setup.tokens_per_micro * setup.grad_accum,
        notes=notes, measured=measured)


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def tensor_bytes(setup: Setup, round_to: int = 1) -> dict[str, int]:
    """Bytes of weights (params + buffers), gradients, optimizer states and one batch,
    each storage counted once (tied weights, views)."""
    seen: set[int] = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            n += -(-storage.nbytes() // round_to) * round_to
        return n
    model = setup.model
    weights = total([*model.parameters(), *model.buffers()])
    gradients = total(p.grad for p in model.parameters())
    states = total(v for s in setup.optimizer.state.values() for v in s.values())
    with torch.no_grad():
        batch = setup.make_batch()
    inputs = total(v for v in batch.values())
    return {"weights": weights, "gradients": gradients, "optimizer_states": states,
            "inputs": inputs}


# --- CPU: the allocator's memory events -----------------------------------------------------


class _Probe:
    """What a device says about memory; the phases split each step."""

    device: torch.device

    def __init__(self):
        self.phase_peaks: dict[str, int] = {}
        self.peak_phase = ""
        self.notes: list[str] = []
        self.runtime_gpu: str | None = None
        self.device_name = "cpu"

    def _record(self, phase: str, peak: int) -> None:
        if peak > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = peak
        if peak >= max(self.phase_peaks.values()):
            self.peak_phase = phase

    def peak_allocated(self) -> int:
        return max(self.phase_peaks.values(), default=0)

    def timing_steps(self, times: list[float], warmup: int) -> list[float]:
        return times[warmup:]

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def sync(self) -> None: ...
    def outside_allocator(self) -> dict[str, int]:
        return {}

    def measured(self) -> dict[str, Any]:
        return {}


class _CpuProbe(_Probe):
    """Profiles the first `profiled_steps` steps (warm-up plus one: by then the optimizer
    state exists, so the steady-state peak is seen); later steps run unprofiled and give
    the step times."""

    def __init__(self, setup: Setup, budget_bytes: int | None, profiled_steps: int):
        super().__init__()
        self.device = torch.device("cpu")
        self.setup, self.budget, self.profiled_steps = setup, budget_bytes, profiled_steps
        self._profiler = None
        self._live_at_start = 0
        os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # silence the profiler's start/stop lines
        self.notes.append("CPU peak from allocator memory events (torch.profiler, "
                          "profile_memory=True); no caching allocator, so reserved = allocated")

    class _Step:
        def __init__(self, probe, index):
            self.probe, self.index = probe, index

        def __enter__(self):
            probe = self.probe
            if self.index < probe.profiled_steps:
                # zero_grad frees the old gradients before the window: frees of blocks made
                # before a window are not reported, so the window starts from known bytes.
                probe.setup.optimizer.zero_grad(set_to_none=True)
                sizes = tensor_bytes(probe.setup)
                probe._live_at_start = sizes["weights"] + sizes["optimizer_states"]
                probe._profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
                probe._profiler.__enter__()

        def __exit__(self, *exc):
            probe = self.probe
            if probe._profiler is not None:
                probe._profiler.__exit__(None, None, None)
                profiler, probe._profiler = probe._profiler, None
                probe._collect(profiler)
                if probe.budget is not None and exc[0] is None and (
                        probe.peak_allocated() > probe.budget):
                    raise BudgetExceeded(
                        f"the step allocated {probe.peak_allocated()} bytes at its peak, over "
                        f"the budget of {probe.budget} bytes (CPU budget stands in for a "
                        "GPU's memory)")
            return False

    def step(self, index: int):
        return self._Step(self, index)

    def phase(self, name: str):
        return torch.profiler.record_function(f"vramplan.{name}")

    def _collect(self, profiler) -> None:
        """Running live bytes from the memory events; the peak inside each phase range."""
        events = profiler.profiler.kineto_results.events()
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        ranges = [(e.name().removeprefix("vramplan."), e.start_ns(), e.end_ns())
                  for e in events if e.name().startswith("vramplan.")]
        live, running = self._live_at_start, []
        for t, nbytes in memory:
            live += nbytes
            running.append((t, live))
        for phase, start, end in ranges:
            inside = [b for t, b in running if start <= t <= end]
            before = [b for t, b in running if t < start]
            # the live bytes entering the phase count too (a phase may only free)
            level = before[-1] if before else self._live_at_start
            self._record(phase, max([level, *inside]))

    def timing_steps(self, times: list[float], warmup: int) -> list[float]:
        unprofiled = times[max(warmup, self.profiled_steps):]
        if not unprofiled:
            self.notes.append("step times include the profiler's overhead (no unprofiled "
                              "steps: raise --steps)")
        return unprofiled or times[warmup:]


# --- CUDA: torch's allocator statistics and NVML ------------------------------------------------


class _CudaProbe(_Probe):
    def __init__(self, device: torch.device, emulate_gpu: str | None, budget: int | None):
        super().__init__()
        self.device = torch.device("cuda", device.index if device.index is not None
                                   else torch.cuda.current_device())
        self.device_name = torch.cuda.get_device_name(self.device)
        self.runtime_gpu = emulate_gpu
        self._sampler = NvmlSampler(self.device)
        torch.cuda.init()
        total = torch.cuda.get_device_properties(self.device).total_memory
        cap = budget
        if emulate_gpu:
            from vramplan.hardware import get_gpu
            usable = get_gpu(emulate_gpu).usable_bytes
            # The cap applies to the caching allocator; the context lives outside it.
            context = max(0, (_nvml_used(self.device) or 0) - torch.cuda.memory_reserved(
                self.device))
            cap = min(cap or usable, usable - context)
            self.notes.append(f"emulating {emulate_gpu}: allocator capped at {cap} bytes = "
                              f"its usable memory minus this process's context ({context})")
        if cap:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), self.device)
        self.reserved_peak = 0

    def step(self, index: int):
        return _nullcontext()

    def phase(self, name: str):
        return _CudaPhase(self, name)

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._sampler.start()

    def stop(self) -> None:
        self._sampler.stop()

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def outside_allocator(self) -> dict[str, int]:
        overhead = max(0, self.reserved_peak - self.peak_allocated())
        used = self._sampler.max_used
        context = max(0, used - self.reserved_peak) if used else 0
        if not used:
            self.notes.append("NVML unavailable: runtime_context not measured")
        return {"allocator_overhead": overhead, "runtime_context": context}

    def measured(self) -> dict[str, Any]:
        s = self._sampler
        return {"peak_reserved": self.reserved_peak, "nvml_used_max": s.max_used,
                "context_overhead": max(0, s.max_used - self.reserved_peak) if s.max_used
                else None,
                "gpu_util_mean": _mean(s.gpu_util), "gpu_util_max": max(s.gpu_util, default=None),
                "mem_bandwidth_util_mean": _mean(s.mem_util), "nvml_samples": len(s.gpu_util)}


class _CudaPhase:
    """Peak of one phase: reset the peak counters at entry, read them at exit."""

    def __init__(self, probe: _CudaProbe, name: str):
        self.probe, self.name = probe, name

    def __enter__(self):
        torch.cuda.reset_peak_memory_stats(self.probe.device)

    def __exit__(self, *exc):
        d = self.probe.device
        self.probe._record(self.name, torch.cuda.max_memory_allocated(d))
        self.probe.reserved_peak = max(self.probe.reserved_peak,
                                       torch.cuda.max_memory_reserved(d))
        return False


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _nvml_used(device: torch.device) -> int | None:
    try:
        return int(torch.cuda.device_memory_used(device))
    except Exception:  # noqa: BLE001 - pynvml missing or no NVML
        return None


class NvmlSampler:
    """Samples NVML used memory and utilization every `interval` s in a daemon thread.
    NVML's utilization is the share of time a kernel ran (or memory was read or written)
    over its own sample window, not SM occupancy."""

    def __init__(self, device: torch.device, interval: float = 0.05):
        self.device, self.interval = device, interval
        self.max_used = 0
        self.gpu_util: list[float] = []
        self.mem_util: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sample()  # at least one sample, even for a very short run

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        try:
            self.max_used = max(self.max_used, int(torch.cuda.device_memory_used(self.device)))
            self.gpu_util.append(float(torch.cuda.utilization(self.device)))
            self.mem_util.append(float(torch.cuda.memory_usage(self.device)))
        except Exception:  # noqa: BLE001 - NVML missing: memory stats still come from torch
            self._stop.set()
