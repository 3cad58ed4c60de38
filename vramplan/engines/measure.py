"""measure: real training steps with synthetic data on the real device -> MemoryReport.

On CUDA the device says what it holds: torch's max allocated / reserved, NVML's used
memory (the context overhead is NVML used minus reserved) and utilization sampled in a
background thread. On the CPU the peak comes from the allocator's own memory events
(torch.profiler, profile_memory=True), not from Python hooks, so it is an independent
check of the trace engine; a byte budget turns a step over budget into BudgetExceeded,
which search treats like a CUDA out-of-memory error.

    >>> report = measure(Job(model="llama-3.2-1b", batch_size=4, seq_len=256), steps=5)
    >>> report.peak_allocated, report.measured["step_time_median_s"]

The model, optimizer, synthetic batch and the step itself come from vramplan.training,
the same builders the trace engine runs, so measure and trace see the same step.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vramplan.engines import runtime
from vramplan.engines.memory_report import CATEGORIES, Measured, MemoryReport, RankFigures
from vramplan.engines.oom import is_out_of_memory
from vramplan.errors import BudgetExceeded, EngineError, ModelConfigError, VramplanError
from vramplan.hardware.nvml import NvmlSampler, nvml_used
from vramplan.job import Job
from vramplan.training.fsdp import fully_shard_setup
from vramplan.training.kernels import select_kernels
from vramplan.training.real_kernels import is_paged, quant_state_tensors, tensor_leaves
from vramplan.training.saved import SavedTensorBytes
from vramplan.training.setup import MAX_GRAD_NORM, TrainingSetup, build_training_setup, train_step
from vramplan.units import format_bytes, p90

CUDA_BLOCK = 512  # the caching allocator rounds every request up to 512 bytes


# --- entry point ----------------------------------------------------------------------------


def measure(job: Job, *, steps: int = 5, warmup: int = 2, emulate_gpu: str | None = None,
            budget_bytes: int | None = None, device: str | None = None,
            model_config: dict | None = None, real_kernels: bool | None = None) -> MemoryReport:
    """Run `warmup` + `steps` optimizer steps of the job and report what the device saw.

    emulate_gpu: cap this process to that catalog GPU's usable memory (CUDA only).
    budget_bytes: a step that needs more raises BudgetExceeded (CUDA: a memory cap).
    model_config: a Hugging Face config dict used instead of looking up job.model.
    real_kernels: run bitsandbytes / torchao rather than the stand-ins; None: on CUDA only.
    Out-of-memory errors propagate (search relies on them); any other error in the step,
    and Ctrl-C, end the run early with a partial report that says why.
    """
    if emulate_gpu:  # an unknown name would be ignored on the CPU and fail late on CUDA
        from vramplan.hardware import get_gpu

        get_gpu(emulate_gpu)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d{1,3})?", str(device)):
        shown = str(device)[:40]
        raise EngineError(f"device {shown!r} is not one measure runs on: use cpu, cuda or "
                          "cuda:N")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise EngineError("measure on cuda needs a CUDA build of torch and a visible GPU; "
                          "use --device cpu (with --budget to stand in for the GPU's memory)")
    if job.activation_offload or job.offload.optimizer or job.offload.params:
        # on the CPU there is no GPU memory to free; on CUDA the host copies are not run
        # yet: measure would report the step without offload as the offloaded one
        raise EngineError("measure does not run CPU offload (activation_offload, "
                          "offload.optimizer, offload.params) yet: use --engine trace "
                          "(activations and optimizer) or --engine formula")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # started by torchrun
    if job.parallel.num_gpus > 1 and not distributed:
        # one process would run the whole job unsharded, and its peak would pass for a
        # rank's: a wrong "fits" for sharded jobs
        n = job.parallel.num_gpus
        raise EngineError(f"the job runs on {n} GPUs ({job.parallel.strategy}): measure it "
                          f"with one process per GPU, `torchrun --nproc-per-node {n} -m "
                          "vramplan measure ...`, or use --engine trace to see one rank "
                          "without GPUs")
    if distributed:
        device = _join_process_group(job, device)
    # the real bitsandbytes / torchao kernels on CUDA, the stand-ins on the CPU
    kernels = select_kernels(job, torch.device(device), real=real_kernels)
    try:
        setup = build_training_setup(job, device=device, model_config=model_config,
                                     kernels=kernels)
    except (VramplanError, MemoryError):
        raise
    except Exception as error:  # noqa: BLE001 - a broken config fails inside transformers
        if is_out_of_memory(error):
            raise
        text = " ".join(str(error).split())[:300]
        raise ModelConfigError(f"cannot build {job.model!r}: {type(error).__name__}: "
                               f"{text}; check its config (vramplan estimate reads it with "
                               "the formula and names the bad field)") from None
    counts = {"params_total": setup.params_total, "params_trainable": setup.params_trainable}
    if distributed:
        _shard(setup, job)
    report = measure_setup(setup, job, steps=steps, warmup=warmup, emulate_gpu=emulate_gpu,
                           budget_bytes=budget_bytes)
    report = report.model_copy(update=counts)  # the whole model's, not this rank's shard
    return _aggregate(report) if distributed else report


def measure_setup(setup: TrainingSetup, job: Job, *, steps: int = 5, warmup: int = 2,
                  emulate_gpu: str | None = None,
                  budget_bytes: int | None = None) -> MemoryReport:
    """measure() for a setup already built (by vramplan.training, or by hand)."""
    if steps < 1 or warmup < 0:
        raise EngineError(f"need steps >= 1 and warmup >= 0 (got steps={steps}, "
                          f"warmup={warmup})")
    cuda = setup.device.type == "cuda"
    probe = _CudaProbe(setup.device, emulate_gpu, budget_bytes,
                       job.runtime.cuda_context_bytes) if cuda else (
        _CpuProbe(setup, budget_bytes, profiled_steps=warmup + 1))
    if emulate_gpu and not cuda:
        probe.notes.append(f"--emulate-gpu {emulate_gpu} applies on CUDA only: ignored on "
                           "the CPU (use a budget)")
    run = _Run(steps=warmup + steps, warmup=warmup)
    run.saved = SavedTensorBytes([*setup.model.parameters(), *setup.model.buffers()])
    head = getattr(setup.model, "get_output_embeddings", lambda: None)()
    if isinstance(head, torch.nn.Module):  # logits and loss buffers are temporaries
        run.saved.stop_at(head)
    scaler = torch.amp.GradScaler(setup.device.type) if job.precision == "fp16-mixed" else None
    probe.watch_gradients(setup)
    probe.start()
    # the job's TF32 setting for these steps, as the Trainer's tf32 sets it (fp32 matmuls);
    # the caller's is restored after
    tf32, torch.backends.cuda.matmul.allow_tf32 = (torch.backends.cuda.matmul.allow_tf32,
                                                   job.tf32)
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
        torch.backends.cuda.matmul.allow_tf32 = tf32
        probe.stop()
        probe.unwatch_gradients()
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
    saved: SavedTensorBytes | None = None  # activations: what forward saves for backward


def _timed_step(setup: TrainingSetup, grad_accum: int, scaler, run: _Run, probe) -> None:
    """training.setup.train_step (the step trace runs), with the loss captured; fp16-mixed adds the
    GradScaler as the Hugging Face Trainer does."""
    losses: list[torch.Tensor] = []
    compute_loss = setup.compute_loss

    def capturing(model, batch):
        if run.saved is not None:  # the batch is counted as inputs, not as activations
            run.saved.exclude_batch(batch.values() if isinstance(batch, dict) else
                              batch if isinstance(batch, (list, tuple)) else [batch])
        loss = compute_loss(model, batch)
        losses.append(loss.detach())
        return scaler.scale(loss) if scaler else loss

    def mark(phase: str | None) -> None:
        if run.saved is not None and phase == "forward":
            run.saved.reset()
        elif run.saved is not None and phase == "backward":
            run.saved.snapshot()
        probe.mark(phase)

    start = time.perf_counter()
    setup.compute_loss = capturing
    recording = run.saved.recording() if run.saved is not None else contextlib.nullcontext()
    try:
        with recording:
            if scaler is None:
                train_step(setup, grad_accum, mark=mark)
            else:
                _fp16_step(setup, grad_accum, scaler, run, mark)
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
    if peak == 0 and run.losses:  # never a report of nothing as a measurement
        raise EngineError("the CPU profiler recorded no memory events in any profiled step "
                          "(torch.profiler in this process may be busy): run measure again "
                          "in a fresh process")
    categories = dict.fromkeys(CATEGORIES, 0)
    in_backward = probe.peak_phase not in ("forward", "inputs")
    inputs = {"optimizer": 0, "end": 0}.get(probe.peak_phase, sizes["inputs"] - (
        sizes["labels"] if in_backward else 0))  # the loss has read the labels by backward
    categories.update(weights=sizes["weights"], optimizer_states=sizes["optimizer_states"],
                      inputs=inputs)
    categories["gradients"] = probe.peak_grads  # alive at the peak (gradient hooks)
    known = sum(categories.values())
    rest = max(0, peak - known)
    saved = run.saved.last_forward_bytes if run.saved is not None else rest
    categories["activations"] = min(rest, saved) if probe.peak_phase in (
        "forward", "backward") else 0
    categories["temporary"] = rest - categories["activations"]
    if peak < known:  # the peak came before some of them existed (no step finished)
        categories.update(gradients=0, optimizer_states=0, inputs=0, activations=0,
                          temporary=0, weights=peak)
    categories.update(probe.outside_allocator())
    notes = list(setup.notes) + probe.notes + [
        "weights, gradients, optimizer states and inputs are summed from tensor sizes; "
        "activations are what forward saved for backward (saved-tensor hooks), at most the "
        "rest of the measured peak; temporary is the remainder"]
    if job.checkpointing != "none":
        notes.append("checkpointing: what a block saves again while it is recomputed in "
                     "backward counts as temporary here (the trace counts it as activations)")
    if run.stopped:
        notes.append(f"partial run: {run.stopped}")
    timed = probe.timing_steps(run.step_times, run.warmup)
    median = statistics.median(timed) if timed else None
    samples = job.batch_size * job.grad_accum
    tokens = sizes["tokens"] * job.grad_accum
    measured = Measured(
        source="measure", device=probe.device_name,
        steps=len(run.losses), warmup=run.warmup, steps_planned=run.steps,
        complete=not run.stopped, stopped=run.stopped,
        step_time_median_s=median, step_time_p90_s=p90(timed), step_times_s=run.step_times,
        samples_per_s=samples / median if median else None,
        tokens_per_s=tokens / median if median and tokens else None,
        losses=run.losses, non_finite_losses=run.non_finite, skipped_steps=run.skipped,
        peak_allocated=peak, libraries=_libraries(setup),
        kernels=setup.kernels.note() if setup.kernels is not None else "",
        **probe.measured())
    report = MemoryReport(
        engine="measure", job=job, model_name=setup.model_name,
        params_total=setup.params_total, params_trainable=setup.params_trainable,
        categories=categories, phase_peaks=dict(probe.phase_peaks), peak_phase=probe.peak_phase,
        runtime_gpu=probe.runtime_gpu, tokens_per_step=tokens * job.parallel.data_parallel,
        unified_memory_bytes=sizes["unified_memory"],
        notes=notes, measured=measured)
    from vramplan.hardware import get_gpu
    runtime_gpu = get_gpu(probe.runtime_gpu) if probe.runtime_gpu else None
    # a CPU run has no cuBLAS workspaces: each GPU's are added to its fit
    fits = runtime.fits_for_job(report, job, runtime_gpu,
                                workspaces_included=probe.device.type == "cuda")
    return report.model_copy(update={"fits": fits})


def _libraries(setup: TrainingSetup) -> dict[str, str]:
    if setup.kernels is not None:
        return dict(setup.kernels.libraries)
    return {"torch": torch.__version__}  # a setup built by hand


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) tensor; the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(setup: TrainingSetup, round_to: int = 1) -> dict[str, int]:
    """Bytes of weights (params + buffers), gradients, optimizer states and one batch, each
    storage counted once (tied weights, views); tokens = input_ids elements in a batch."""
    seen: set[int] = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            t = t.to_local() if hasattr(t, "to_local") else t  # a sharded DTensor: this rank's
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            n += -(-storage.nbytes() // round_to) * round_to
        return n
    model = setup.model
    # bitsandbytes 4-bit weights keep absmax and code maps outside parameters and buffers
    weights = total([*model.parameters(), *model.buffers(), *quant_state_tensors(model)])
    gradients = sum(-(-_local(p).numel() * p.element_size() // round_to) * round_to
                    for p in setup.trainable)  # what backward allocates, once each
    # dicts (stand-ins) and tensor subclasses (torchao) hold the real state tensors; paged
    # ones (bitsandbytes) live in CUDA unified memory, outside torch's allocator
    leaves = tensor_leaves([*setup.optimizer.state.values()])
    states = total(t for t in leaves if not is_paged(t))
    unified = total(t for t in leaves if is_paged(t))
    with torch.no_grad():
        batch = setup.make_batch()
    values = list(batch.values()) if isinstance(batch, dict) else (
        list(batch) if isinstance(batch, (list, tuple)) else [batch])
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    labels = batch.get("labels") if isinstance(batch, dict) else None
    return {"weights": weights, "gradients": gradients, "optimizer_states": states,
            "unified_memory": unified,
            "inputs": total(values), "tokens": int(ids.numel()) if ids is not None else 0,
            "labels": labels.untyped_storage().nbytes() if labels is not None else 0}


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
        self.grads_alive = 0    # gradient bytes allocated so far in this step
        self.peak_grads = 0     # gradient bytes alive at the peak
        self._grads_seen: set[int] = set()

    def mark(self, phase: str | None) -> None:
        """End the current phase and begin `phase` (None: the step is over)."""
        if self._phase is not None:
            self._close(self._phase)
        if phase == "end":  # train_step has just run zero_grad
            self.grads_alive = 0
            self._grads_seen.clear()
        self._phase = phase
        if phase is not None:
            self._open(phase)

    def watch_gradients(self, setup: TrainingSetup) -> None:
        """Count gradient bytes as backward creates them, to know how many are alive at the
        peak (backward's peak often comes before most gradients exist)."""
        round_to = CUDA_BLOCK if self.device.type == "cuda" else 1

        def hook(param: torch.Tensor) -> None:
            if id(param) in self._grads_seen:  # accumulation adds in place
                return
            self._grads_seen.add(id(param))
            before = self.grads_alive
            grad = _local(param.grad)
            self.grads_alive += -(-grad.untyped_storage().nbytes() // round_to) * round_to
            self._on_gradient(before)

        # torch keeps tensor hooks in C++, where the garbage collector cannot see the cycle
        # hook -> probe -> setup -> parameter: unwatch_gradients removes them after the run
        self._hooks = [param.register_post_accumulate_grad_hook(hook)
                       for param in setup.trainable]

    def unwatch_gradients(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        self._hooks = []

    def _on_gradient(self, before: int) -> None: ...

    def _record(self, phase: str, peak: int, grads: int) -> None:
        if peak > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = peak
        if peak >= max(self.phase_peaks.values()) and (
                peak > self.peak_allocated_seen or not self.peak_phase):
            self.peak_phase, self.peak_grads = phase, grads
        self.peak_allocated_seen = max(self.peak_allocated_seen, peak)

    peak_allocated_seen = 0

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


GRADS_MARK = "vramplan.grads="


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
        # a profiler of an earlier measure that the garbage collector destroys while this
        # one records ends the allocator's memory reporting for the process: destroy any
        # such leftover first
        gc.collect()
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
                f"the step needs {format_bytes(self.peak_allocated(), 'auto')} at its peak "
                f"({self.peak_phase}), over the budget of {format_bytes(self.budget, 'auto')}")

    def _open(self, phase: str) -> None:
        if self._profiler is not None:
            self._range = torch.profiler.record_function(f"vramplan.{phase}")
            self._range.__enter__()

    def _close(self, phase: str) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _on_gradient(self, before: int) -> None:
        if self._profiler is not None:  # a marker in the trace: gradient bytes from now on
            with torch.profiler.record_function(f"{GRADS_MARK}{self.grads_alive}"):
                pass

    def _collect(self, profiler) -> None:
        """Running live bytes from the memory events; the peak inside each phase range and
        the gradient bytes alive at it (the last gradient marker before it)."""
        events = profiler.profiler.kineto_results.events()
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        marks = sorted((e.start_ns(), int(e.name().removeprefix(GRADS_MARK)))
                       for e in events if e.name().startswith(GRADS_MARK))
        ranges = [(e.name().removeprefix("vramplan."), e.start_ns(), e.end_ns())
                  for e in events if e.name().startswith("vramplan.")
                  and not e.name().startswith(GRADS_MARK)]
        live, running = self._live_at_start, [(0, self._live_at_start)]
        for t, nbytes in memory:
            live += nbytes
            running.append((t, live))
        for phase, start, end in ranges:
            # the bytes alive entering the phase count too (a phase may only free)
            entering = [(t, b) for t, b in running if t < start][-1]
            t_peak, peak = max([entering, *((t, b) for t, b in running if start <= t <= end)],
                               key=lambda tb: tb[1])
            # A gradient is allocated before its marker, and frees may come in between:
            # every marker before the next allocation after the peak names a gradient
            # that was alive at the peak.
            t_next = next((t for t, n in memory if t > t_peak and n > 0), end)
            grads = 0 if phase == "end" else max(
                [b for t, b in marks if t < t_next], default=0)
            self._record(phase, peak, grads)

    def timing_steps(self, times: list[float], warmup: int) -> list[float]:
        unprofiled = times[max(warmup, self.profiled_steps):]
        if not unprofiled:
            self.notes.append("step times include the profiler's overhead (every timed step "
                              "was profiled: raise steps)")
        return unprofiled or times[warmup:]


# --- CUDA: torch's allocator statistics and NVML ------------------------------------------------


class _CudaProbe(_Probe):
    def __init__(self, device: torch.device, emulate_gpu: str | None, budget: int | None,
                 context_bytes: int = 0):
        super().__init__()
        torch.cuda.init()
        self.device = torch.device("cuda", device.index if device.index is not None
                                   else torch.cuda.current_device())
        self.device_name = torch.cuda.get_device_name(self.device)
        self.runtime_gpu = emulate_gpu
        self._sampler = NvmlSampler(self.device)
        self.reserved_peak = 0
        self._phase_max, self._grads_at_max = 0, 0
        total = torch.cuda.get_device_properties(self.device).total_memory
        cap = budget
        if emulate_gpu:
            from vramplan.hardware import get_gpu
            usable = get_gpu(emulate_gpu).usable_bytes
            # The cap applies to the caching allocator; the context lives outside it. It
            # grows as kernels load during the step, so the job's planned context is the
            # floor (1382 MiB at the first step on an H200 against 1234 MiB at this point).
            context = max(context_bytes, (nvml_used(self.device) or 0)
                          - torch.cuda.memory_reserved(self.device))
            cap = min(cap or usable, usable - context)
            self.notes.append(
                f"emulating {emulate_gpu}: allocator capped at {format_bytes(cap)} = its usable "
                f"{format_bytes(usable)} minus the memory outside the allocator "
                f"({format_bytes(context, 'MiB', 0)})")
        self._capped = bool(cap)
        if cap:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), self.device)

    def _open(self, phase: str) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self._phase_max, self._grads_at_max = 0, self.grads_alive

    def _on_gradient(self, before: int) -> None:
        # max_memory_allocated is a host-side counter (no sync): if it rose since the last
        # gradient, the peak came in between; most often it is this gradient's allocation
        # itself, so it counts (an earlier peak would be over-attributed by one gradient).
        now = torch.cuda.max_memory_allocated(self.device)
        if now > self._phase_max:
            self._phase_max, self._grads_at_max = now, self.grads_alive

    def _close(self, phase: str) -> None:
        peak = torch.cuda.max_memory_allocated(self.device)
        grads = self.grads_alive if peak > self._phase_max else self._grads_at_max
        self._record(phase, peak, grads)
        self.reserved_peak = max(self.reserved_peak,
                                 torch.cuda.max_memory_reserved(self.device))

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        # Blocks cached while the model was built (QLoRA quantizes a 16-bit copy) would
        # count as the step's reserved memory: give them back first.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._sampler.start()

    def stop(self) -> None:
        self._sampler.stop()
        if self._capped:  # the cap was for this run only
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

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
        # NVML's used memory is the whole device's (other processes too)
        return {"peak_reserved": self.reserved_peak, "nvml_used_max": s.max_used,
                "context_overhead": max(0, s.max_used - self.reserved_peak) if s.max_used
                else None,
                "gpu_util_mean": _mean(s.gpu_util), "gpu_util_max": max(s.gpu_util, default=None),
                "mem_bandwidth_util_mean": _mean(s.mem_util), "nvml_samples": len(s.gpu_util)}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


# --- several processes (torchrun): shard the job, measure each rank, aggregate on rank 0 --------


def _join_process_group(job: Job, device: str) -> str:
    """Join torchrun's process group (NCCL on GPUs, gloo on CPUs); this rank's device."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if job.parallel.num_gpus != world:
        raise EngineError(f"the job says num_gpus={job.parallel.num_gpus} but torchrun started "
                          f"{world} processes: make them equal")
    cuda = torch.device(device).type == "cuda"
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return device


def _shard(setup: TrainingSetup, job: Job) -> None:
    """Apply the job's strategy: DDP, or FSDP2 (zero2 keeps parameters gathered after the
    forward; zero3 / fsdp reshard them), each transformer block its own FSDP unit."""
    strategy = job.parallel.strategy
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        index = [setup.device.index] if setup.device.type == "cuda" else None
        setup.model = DistributedDataParallel(setup.model, device_ids=index)
        return
    if strategy not in ("zero2", "zero3", "fsdp"):
        raise EngineError(f"measure across processes supports ddp, zero2, zero3 and fsdp "
                          f"(got {strategy!r})")
    blocks = fully_shard_setup(setup, job)
    setup.notes.append(f"{strategy}: FSDP2 fully_shard on {blocks} blocks and the root")


def _aggregate(report: MemoryReport) -> MemoryReport:
    """Every rank's figures on rank 0: the report of the rank with the largest peak, plus
    each rank's peak and time, their max and min, and the throughput of all ranks."""
    import torch.distributed as dist

    mine = {"rank": dist.get_rank(), "peak_allocated": report.peak_allocated,
            "peak_reserved": report.peak_reserved, "device_total": report.device_total,
            "step_time_median_s": report.measured.step_time_median_s,
            "samples_per_s": report.measured.samples_per_s,
            "tokens_per_s": report.measured.tokens_per_s,
            "report": report.model_dump(mode="json")}
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() != 0:
        return report
    worst = max(ranks, key=lambda r: r["device_total"])
    base = MemoryReport.model_validate(worst["report"])
    peaks = [r["peak_allocated"] for r in ranks]
    measured = base.measured.model_copy(update=dict(
        ranks=[RankFigures(**{k: v for k, v in r.items() if k != "report"}) for r in ranks],
        world_size=len(ranks), worst_rank=worst["rank"],
        peak_allocated_max=max(peaks), peak_allocated_min=min(peaks),
        samples_per_s=sum(r["samples_per_s"] or 0 for r in ranks) or None,
        tokens_per_s=sum(r["tokens_per_s"] or 0 for r in ranks) or None))
    notes = [*base.notes, f"{len(ranks)} ranks; categories are rank {worst['rank']}'s (the "
             "largest peak); throughput is the sum over ranks"]
    return base.model_copy(update={"measured": measured, "notes": notes,
                                   "per_gpu_of": len(ranks)})
