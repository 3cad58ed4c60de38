"""measure: real training steps with synthetic data on the real device -> MemoryReport.

On CUDA the device says what it holds: torch's max allocated / reserved, NVML's used
memory (the context overhead is NVML used minus reserved) and utilization sampled in a
background thread. On the CPU the peak comes from the allocator's own memory events
(torch.profiler, profile_memory=True), not from Python hooks, so it is an independent
check of the trace engine; a byte budget turns a step over budget into BudgetExceeded,
which search treats like a CUDA out-of-memory error.

    >>> report = measure(Job(model="tiny-llama", batch_size=4, seq_len=256), steps=5)
    >>> report.peak_allocated, report.measured["step_time_median_s"]

The model, optimizer, synthetic batch and the step itself come from vramplan.models.build,
the same builders the trace engine runs, so measure and trace see the same step.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vramplan.engines.report import CATEGORIES, MemoryReport
from vramplan.errors import EngineError
from vramplan.job import Job
from vramplan.models.build import MAX_GRAD_NORM, TrainingSetup, train_step
from vramplan.search import BudgetExceeded, is_out_of_memory

CUDA_BLOCK = 512  # the caching allocator rounds every request up to 512 bytes
# Phases that build.train_step marks; gradients are alive in full from backward's end
# until "end" (zero_grad), so a peak in them counts all gradients.
GRADIENT_PHASES = ("backward", "optimizer", "end")


# --- entry point ----------------------------------------------------------------------------


def measure(job: Job, *, steps: int = 5, warmup: int = 2, emulate_gpu: str | None = None,
            budget_bytes: int | None = None, device: str | None = None,
            model_config: dict | None = None) -> MemoryReport:
    """Run `warmup` + `steps` optimizer steps of the job and report what the device saw.

    emulate_gpu: cap this process to that catalog GPU's usable memory (CUDA only).
    budget_bytes: a step that needs more raises BudgetExceeded (CUDA: a memory cap).
    model_config: a Hugging Face config dict used instead of looking up job.model.
    Out-of-memory errors propagate (search relies on them); any other error in the step,
    and Ctrl-C, end the run early with a partial report that says why.
    """
    from vramplan.models.build import build_training_setup  # shared with the trace engine

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise EngineError("measure on cuda needs a CUDA build of torch and a visible GPU; "
                          "use --device cpu (with --budget to stand in for the GPU's memory)")
    setup = build_training_setup(job, device=device, model_config=model_config)
    return measure_setup(setup, job, steps=steps, warmup=warmup, emulate_gpu=emulate_gpu,
                         budget_bytes=budget_bytes)


def measure_setup(setup: TrainingSetup, job: Job, *, steps: int = 5, warmup: int = 2,
                  emulate_gpu: str | None = None,
                  budget_bytes: int | None = None) -> MemoryReport:
    """measure() for a setup already built (by build.py, or by hand)."""
    if steps < 1 or warmup < 0:
        raise EngineError(f"need steps >= 1 and warmup >= 0 (got steps={steps}, "
                          f"warmup={warmup})")
    cuda = setup.device.type == "cuda"
    probe = _CudaProbe(setup.device, emulate_gpu, budget_bytes) if cuda else (
        _CpuProbe(setup, budget_bytes, profiled_steps=warmup + 1))
    if emulate_gpu and not cuda:
        probe.notes.append(f"--emulate-gpu {emulate_gpu} applies on CUDA only: ignored on "
                           "the CPU (use a budget)")
    run = _Run(steps=warmup + steps, warmup=warmup)
    scaler = torch.amp.GradScaler(setup.device.type) if job.precision == "fp16-mixed" else None
    probe.start()
    try:
        for index in range(warmup + steps):
            with probe.step(index):
                _timed_step(setup, job.grad_accum, scaler, run, probe)
    except KeyboardInterrupt:
        run.stopped = f"interrupted (Ctrl-C) after {len(run.losses)} of {run.steps} steps"
    except Exception as error:  # noqa: BLE001 - user code; out-of-memory goes to the caller
        if is_out_of_memory(error):
            raise
        run.stopped = (f"stopped by {type(error).__name__}: {error} (after "
                       f"{len(run.losses)} of {run.steps} steps)")
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


def _timed_step(setup: TrainingSetup, grad_accum: int, scaler, run: _Run, probe) -> None:
    """build.train_step (the step trace runs), with the loss captured; fp16-mixed adds the
    GradScaler as the Hugging Face Trainer does."""
    losses: list[torch.Tensor] = []
    compute_loss = setup.compute_loss

    def capturing(model, batch):
        loss = compute_loss(model, batch)
        losses.append(loss.detach())
        return scaler.scale(loss) if scaler else loss

    start = time.perf_counter()
    setup.compute_loss = capturing
    try:
        if scaler is None:
            train_step(setup, grad_accum, mark=probe.mark)
        else:
            _fp16_step(setup, grad_accum, scaler, run, probe.mark)
    finally:
        setup.compute_loss = compute_loss
        probe.mark(None)
    total = sum(loss.float().item() for loss in losses) / grad_accum  # .item() syncs the device
    probe.sync()
    run.step_times.append(time.perf_counter() - start)
    run.losses.append(total)
    run.non_finite += not math.isfinite(total)


def _fp16_step(setup: TrainingSetup, grad_accum: int, scaler, run: _Run, mark) -> None:
    """train_step with dynamic loss scaling: unscale before clipping, skip on inf/NaN."""
    for _ in range(grad_accum):
        mark("inputs")
        batch = setup.make_batch()
        mark("forward")
        with setup.autocast():
            loss = setup.compute_loss(setup.model, batch)  # already scaled
        del batch
        mark("backward")
        (loss / grad_accum).backward()
        del loss
    mark("optimizer")
    scaler.unscale_(setup.optimizer)
    torch.nn.utils.clip_grad_norm_(setup.trainable, MAX_GRAD_NORM, foreach=setup.clip_foreach)
    before = scaler.get_scale()
    scaler.step(setup.optimizer)
    scaler.update()
    run.skipped += scaler.get_scale() < before  # the scale drops only after a skipped step
    setup.optimizer.zero_grad(set_to_none=True)
    mark("end")


# --- the report -------------------------------------------------------------------------------


def _report(job: Job, setup: TrainingSetup, run: _Run, probe) -> MemoryReport:
    sizes = tensor_bytes(setup, round_to=CUDA_BLOCK if probe.device.type == "cuda" else 1)
    peak = probe.peak_allocated()
    categories = dict.fromkeys(CATEGORIES, 0)
    categories.update(weights=sizes["weights"], optimizer_states=sizes["optimizer_states"],
                      inputs=sizes["inputs"])
    # zero_grad runs at the end of each step, so gradients are measured at their largest:
    # one per trainable parameter, alive in full from the end of backward.
    if probe.peak_phase in GRADIENT_PHASES or job.grad_accum > 1:
        categories["gradients"] = sizes["gradients"]
    known = sum(categories.values())
    categories["activations"] = max(0, peak - known)
    if peak < known:  # the peak came before some of them existed (no step finished)
        categories.update(gradients=0, optimizer_states=0, inputs=0, activations=0,
                          weights=peak)
    categories.update(probe.outside_allocator())
    notes = list(setup.notes) + probe.notes + [
        "weights, gradients, optimizer states and inputs are summed from tensor sizes; "
        "activations are the rest of the measured peak (saved tensors and temporaries)"]
    if run.stopped:
        notes.append(f"partial run: {run.stopped}")
    timed = probe.timing_steps(run.step_times, run.warmup)
    median = statistics.median(timed) if timed else None
    samples = job.batch_size * job.grad_accum
    tokens = sizes["tokens"] * job.grad_accum
    measured = {
        "device": probe.device_name,
        "steps": len(run.losses), "warmup": run.warmup, "steps_planned": run.steps,
        "complete": not run.stopped, "stopped": run.stopped,
        "step_time_median_s": median, "step_time_p90_s": p90(timed),
        "step_times_s": run.step_times,
        "samples_per_s": samples / median if median else None,
        "tokens_per_s": tokens / median if median and tokens else None,
        "losses": run.losses, "non_finite_losses": run.non_finite, "skipped_steps": run.skipped,
        "peak_allocated": peak, **probe.measured(),
    }
    return MemoryReport(
        engine="measure", job=job.model_dump(mode="json"), model_name=setup.model_name,
        params_total=setup.params_total, params_trainable=setup.params_trainable,
        categories=categories, phase_peaks=dict(probe.phase_peaks), peak_phase=probe.peak_phase,
        runtime_gpu=probe.runtime_gpu, tokens_per_step=tokens * job.parallel.data_parallel,
        notes=notes, measured=measured)


def p90(values: list[float]) -> float | None:
    """90th percentile (nearest rank)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def tensor_bytes(setup: TrainingSetup, round_to: int = 1) -> dict[str, int]:
    """Bytes of weights (params + buffers), gradients, optimizer states and one batch, each
    storage counted once (tied weights, views); tokens = input_ids elements in a batch."""
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
    gradients = sum(-(-p.numel() * p.element_size() // round_to) * round_to
                    for p in setup.trainable)  # what backward allocates, once each
    states = total(v for s in setup.optimizer.state.values() for v in s.values())
    with torch.no_grad():
        batch = setup.make_batch()
    values = list(batch.values()) if isinstance(batch, dict) else (
        list(batch) if isinstance(batch, (list, tuple)) else [batch])
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    return {"weights": weights, "gradients": gradients, "optimizer_states": states,
            "inputs": total(values), "tokens": int(ids.numel()) if ids is not None else 0}


# --- what the device says: a probe per device type -------------------------------------------


class _Probe:
    """Memory of each phase of the step; train_step calls mark(phase) as each one begins."""

    device: torch.device

    def __init__(self):
        self.phase_peaks: dict[str, int] = {}
        self.peak_phase = ""
        self.notes: list[str] = []
        self.runtime_gpu: str | None = None
        self.device_name = "cpu"
        self._phase: str | None = None

    def mark(self, phase: str | None) -> None:
        """End the current phase and begin `phase` (None: the step is over)."""
        if self._phase is not None:
            self._close(self._phase)
        self._phase = phase
        if phase is not None:
            self._open(phase)

    def _record(self, phase: str, peak: int) -> None:
        if peak > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = peak
        if peak >= max(self.phase_peaks.values()):
            self.peak_phase = phase

    def peak_allocated(self) -> int:
        return max(self.phase_peaks.values(), default=0)

    def timing_steps(self, times: list[float], warmup: int) -> list[float]:
        return times[warmup:]

    def step(self, index: int):
        return contextlib.nullcontext()

    def _open(self, phase: str) -> None: ...
    def _close(self, phase: str) -> None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def sync(self) -> None: ...

    def outside_allocator(self) -> dict[str, int]:
        return {}

    def measured(self) -> dict[str, Any]:
        return {}


class _CpuProbe(_Probe):
    """The CPU allocator's memory events, one profiler window per step. Frees of blocks
    made before a window are not reported, so each window starts from bytes known from
    tensor sizes (weights + optimizer states: train_step frees gradients inside the step).
    Profiles the first `profiled_steps` steps (warm-up plus one: by then the optimizer state
    exists, so the steady-state peak is seen); later steps run unprofiled for step times."""

    def __init__(self, setup: TrainingSetup, budget_bytes: int | None, profiled_steps: int):
        super().__init__()
        self.device = torch.device("cpu")
        self.setup, self.budget, self.profiled_steps = setup, budget_bytes, profiled_steps
        self._profiler = None
        self._range = None
        self._live_at_start = 0
        os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # no start/stop lines on stderr
        self.notes.append("CPU peak from allocator memory events (torch.profiler, "
                          "profile_memory=True); no caching allocator, so reserved = allocated")

    @contextlib.contextmanager
    def step(self, index: int):
        if index >= self.profiled_steps:
            yield
            return
        self.setup.optimizer.zero_grad(set_to_none=True)
        sizes = tensor_bytes(self.setup)
        self._live_at_start = sizes["weights"] + sizes["optimizer_states"]
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        try:
            yield
        finally:
            self.mark(None)
            self._profiler.__exit__(None, None, None)
            self._collect(self._profiler)
            self._profiler = None
        if self.budget is not None and self.peak_allocated() > self.budget:
            raise BudgetExceeded(
                f"the step needs {self.peak_allocated()} bytes at its peak "
                f"({self.peak_phase}), over the budget of {self.budget} bytes")

    def _open(self, phase: str) -> None:
        if self._profiler is not None:
            self._range = torch.profiler.record_function(f"vramplan.{phase}")
            self._range.__enter__()

    def _close(self, phase: str) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

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
            before = [b for t, b in running if t < start]
            # a phase that only frees peaks at the bytes it started with
            level = before[-1] if before else self._live_at_start
            self._record(phase, max([level, *(b for t, b in running if start <= t <= end)]))

    def timing_steps(self, times: list[float], warmup: int) -> list[float]:
        unprofiled = times[max(warmup, self.profiled_steps):]
        if not unprofiled:
            self.notes.append("step times include the profiler's overhead (every timed step "
                              "was profiled: raise steps)")
        return unprofiled or times[warmup:]


# --- CUDA: torch's allocator statistics and NVML ------------------------------------------------


class _CudaProbe(_Probe):
    def __init__(self, device: torch.device, emulate_gpu: str | None, budget: int | None):
        super().__init__()
        torch.cuda.init()
        self.device = torch.device("cuda", device.index if device.index is not None
                                   else torch.cuda.current_device())
        self.device_name = torch.cuda.get_device_name(self.device)
        self.runtime_gpu = emulate_gpu
        self._sampler = NvmlSampler(self.device)
        self.reserved_peak = 0
        total = torch.cuda.get_device_properties(self.device).total_memory
        cap = budget
        if emulate_gpu:
            from vramplan.hardware import get_gpu
            usable = get_gpu(emulate_gpu).usable_bytes
            # The cap applies to the caching allocator; the context lives outside it.
            context = max(0, (_nvml_used(self.device) or 0)
                          - torch.cuda.memory_reserved(self.device))
            cap = min(cap or usable, usable - context)
            self.notes.append(f"emulating {emulate_gpu}: allocator capped at {cap} bytes = its "
                              f"usable memory minus the device's other use ({context} bytes)")
        if cap:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), self.device)

    def _open(self, phase: str) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def _close(self, phase: str) -> None:
        self._record(phase, torch.cuda.max_memory_allocated(self.device))
        self.reserved_peak = max(self.reserved_peak,
                                 torch.cuda.max_memory_reserved(self.device))

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
