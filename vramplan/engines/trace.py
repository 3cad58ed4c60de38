"""Trace engine: the job's real training step on fake tensors, every storage accounted for.

    report = trace(job)                       # MemoryReport, engine="trace"

How: the model, optimizer and batches come from vramplan.training (the same builders
the measure engine uses) and run two optimizer steps under FakeTensorMode on a fake "cpu"
device (fake "cuda" cannot run on a CPU-only torch). A TorchDispatchMode sees every new
untyped storage, notes the phase and module that created it, and a weakref.finalize on the
storage reports its release. Step 2 (optimizer state present) is reported. Categories are
decided from each storage's whole life:

    weights           created while building (parameters, buffers)
    inputs            the micro-batch
    activations       created in forward and still alive when backward starts (saved for
                      backward), or recomputed in backward by checkpointing
    gradients         storages that end up as a parameter's .grad
    optimizer_states  created in optimizer.step() and alive after it
    temporary         everything else: transient forward/backward buffers, the logits and
                      loss of the output head, optimizer-step buffers, cuBLAS workspaces

Sizes are rounded to 512 B as the CUDA caching allocator does; the alloc/free sequence is
replayed through engines/allocator.py for reserved memory. Sharded jobs (ddp, zero1-3,
fsdp, hybrid-shard) are traced as rank 0 of a fake process group (engines/trace_shard.py).

`cpu_profiler_peak(job)` (benchmarks/ground_truth.py, outside the package) runs the same
steps for real on the CPU and returns the peak from torch.profiler's allocator memory
events: the independent ground truth used by the tests and benchmarks/trace_accuracy.py.
"""

from __future__ import annotations

import contextlib
import re
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from vramplan.engines import runtime
from vramplan.engines.allocator import CachingAllocator, round_size
from vramplan.engines.memory_report import CATEGORIES, MemoryReport, ModuleUsage
from vramplan.engines.trace_shard import sharding
from vramplan.errors import EngineError, VramplanError
from vramplan.job import FSDP_STRATEGIES, Job
from vramplan.training.kernels import trace_kernels
from vramplan.training.patches import transformers_quirks
from vramplan.training.placement import HOST, UNIFIED, current_placement
from vramplan.training.private_api import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    TorchDispatchMode,
    UnsupportedOperatorException,
    fsdp_accumulated_grads,
    is_traceable_wrapper_subclass,
    tree_leaves,
)
from vramplan.training.setup import TrainingSetup, build_training_setup, train_step

STEPS = 2          # step 1 creates optimizer state; step 2 is the steady state, reported
TIMELINE_POINTS = 2000
TOP_MODULES = 10
_CHECK_EVERY = 128  # ops between time-limit checks
# Micro-batches 3..N of an accumulation step allocate and free exactly what micro-batch 2
# does (the gradients exist from micro-batch 1 on), so they are not traced; step 1 only
# has to create the optimizer state, so it runs one micro-batch.
MICRO_STEPS_TRACED = 2


def trace(job: Job, *, time_limit_s: float = 300, model_config: dict | None = None) -> MemoryReport:
    """Trace `job` on fake tensors and report per-GPU memory at the peak of step 2."""
    _runtime_gpu(job)  # an unknown GPU name fails before the trace, not after
    result = run_trace(job, time_limit_s=time_limit_s, model_config=model_config)
    return result.report(job)


# --- one storage, one event ---------------------------------------------------------------------

@dataclass(eq=False)
class Storage:
    nbytes: int
    step: int
    phase: str          # build, inputs, forward, backward, optimizer
    module: str         # innermost module running when it was created ("" = none)
    op: str
    in_head: bool = False   # created by the output head / loss (logits, loss buffers)
    saved: bool = False     # forward storage alive when backward started
    grad: bool = False      # ended up as a parameter's .grad
    kept: bool = False      # optimizer storage alive after the step

    def category(self) -> str:
        if self.op == "ddp_bucket":
            return "gradients"
        if self.phase == "build" or self.op == "fsdp_all_gather":  # FSDP: unsharded params
            return "weights"
        if self.phase == "inputs":
            return "inputs"
        if self.grad:
            return "gradients"
        if self.phase == "forward":
            saved = self.saved and self.module and not self.in_head  # "" = the loss, outside
            return "activations" if saved else "temporary"
        if self.phase == "backward" and self.module and not self.in_head:
            return "activations"  # recomputed by checkpointing
        if self.phase == "optimizer" and self.kept:
            return "optimizer_states"
        return "temporary"

    def label(self) -> str:
        category = self.category()
        if category in ("activations", "temporary") and self.module:
            return _LAYER_INDEX.sub(".*", self.module)  # all layers of one kind together
        if category == "temporary":
            return f"{self.op} ({self.phase})"
        return {"weights": "parameters and buffers", "inputs": "batch", "gradients":
                "parameter gradients", "optimizer_states": "optimizer state"}[category]


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")  # model.layers.3.mlp -> model.layers.*.mlp


class _TimeLimit(Exception):
    pass


class _Watchdog(BaseException):
    """Raised by the alarm: a BaseException, so that user code's `except Exception` (a
    factory that blocks in sleep or I/O) cannot swallow it."""


@contextlib.contextmanager
def _alarm(seconds: float):
    """The time limit for code the tracker never sees (a factory blocking before any op):
    SIGALRM, in the main thread of a Unix process whose alarm is free; else nothing."""
    import signal
    import threading

    usable = (hasattr(signal, "setitimer") and threading.current_thread() is
              threading.main_thread() and signal.getsignal(signal.SIGALRM) in
              (signal.SIG_DFL, None))
    if not usable:
        yield
        return

    def ring(signum, frame):
        raise _Watchdog

    signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds + 1.0)  # the tracker's own check goes first
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


class _Tracker(TorchDispatchMode):
    """Sees every op's outputs; records new storages and (via weakref.finalize) their frees.

    Under torch.compile it is off while Dynamo and AOTAutograd compile (their fake tensors
    are not the step's memory) and on while the compiled graphs run."""

    # compiled graphs may call higher-order ops (run_and_save_rng_state, when the
    # partitioner recomputes a random op): run them on, and see their outputs
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = deadline
        self.events: list[tuple[int, Storage]] = []  # (+1 alloc | -1 free, storage)
        self.marks: list[tuple[int, int, str]] = []  # (event index, step, phase)
        self.live: dict[int, Storage] = {}
        self.step, self.phase = 0, "build"
        self.module_stack: list[str] = []
        self.head_modules: set[str] = set()
        self.failed_op: str | None = None
        self.failure: Exception | None = None
        self.ops: set[str] = set()  # names of ops that made storages
        self._ops = 0
        # storages outside the GPU's caching allocator (training/placement.py): paged
        # optimizer states in unified memory, offloaded tensors on the host, results a
        # compiled graph fuses away
        self.outside: dict[int, tuple[str, int]] = {}  # key -> (place, bytes)
        self.outside_live: dict[str, int] = defaultdict(int)
        self.outside_peak: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._ops += 1
        if self._ops % _CHECK_EVERY == 0 and time.monotonic() > self.deadline:
            raise _TimeLimit()
        try:
            out = func(*args, **(kwargs or {}))
        except (DataDependentOutputException, DynamicOutputShapeException,
                UnsupportedOperatorException) as error:
            self.failed_op, self.failure = str(func), error
            raise
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t, func)
        return out

    def _see(self, t: torch.Tensor, func) -> None:
        if is_traceable_wrapper_subclass(t):  # DTensor: the memory is its local shard
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._see(inner, func)
            return
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live or key in self.outside or storage.nbytes() == 0:
            return
        place = current_placement()
        if place is not None:
            self._see_outside(storage, place)
            return
        module = self.module_stack[-1] if self.module_stack else ""
        op = func.__name__.split(".")[0]
        self.ops.add(op)
        record = Storage(storage.nbytes(), self.step, self.phase, module, op,
                         in_head=module in self.head_modules)
        self.live[key] = record
        self.events.append((1, record))
        weakref.finalize(storage, self._free, key)

    def _see_outside(self, storage, place: str) -> None:
        key = storage._cdata
        self.outside[key] = (place, storage.nbytes())
        self.outside_live[place] += storage.nbytes()
        self.outside_peak[place] = max(self.outside_peak[place], self.outside_live[place])
        weakref.finalize(storage, self._free_outside, key)

    def _free_outside(self, key: int) -> None:
        place, nbytes = self.outside.pop(key, (None, 0))
        if place is not None:
            self.outside_live[place] -= nbytes

    def _free(self, key: int) -> None:
        record = self.live.pop(key, None)
        if record is not None:
            self.events.append((-1, record))

    def resized(self, t: torch.Tensor, func_name: str) -> None:
        """FSDP frees and re-allocates unsharded parameters by resizing their storage in
        place (no new storage, no dispatch): account for it as a free / a new allocation."""
        storage = t.untyped_storage()
        self._free(storage._cdata)
        if storage.nbytes():
            module = self.module_stack[-1] if self.module_stack else ""
            record = Storage(storage.nbytes(), self.step, self.phase, module, func_name)
            self.live[storage._cdata] = record
            self.events.append((1, record))

    def mark(self, step: int, phase: str) -> None:
        if self.phase == "forward" and phase == "backward":
            for record in self.live.values():
                if record.phase == "forward" and record.step == step:
                    record.saved = True
        if phase == "end":  # also states made by optimizer-in-backward hooks
            for record in self.live.values():
                if record.phase == "optimizer" and record.step == step:
                    record.kept = True
        self.step, self.phase = step, phase
        self.marks.append((len(self.events), step, phase))

    def mark_grads(self, model: torch.nn.Module) -> None:
        held = fsdp_accumulated_grads(model)  # FSDP without gradient sync: whole gradients
        for grad in [p.grad for p in model.parameters()] + held:
            if grad is not None and is_traceable_wrapper_subclass(grad):
                grad = getattr(grad, "_local_tensor", None)  # DTensor: the local shard
            if grad is not None:
                record = self.live.get(grad.untyped_storage()._cdata)
                if record is not None:
                    record.grad = True


@contextlib.contextmanager
def _module_scope(tracker: _Tracker, model: torch.nn.Module):
    """Keeps tracker.module_stack = the modules whose forward is running (also recompute)."""
    names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}

    def inside_compiled(module) -> bool:
        # a compiled block's ops run as one graph: they belong to the block itself
        return torch.compiler.is_compiling() or isinstance(module, torch.fx.GraphModule)

    def push(module, args):
        if not inside_compiled(module):
            tracker.module_stack.append(names.get(id(module), type(module).__name__))

    def pop(module, args, output):
        if tracker.module_stack and not inside_compiled(module):
            tracker.module_stack.pop()

    nn_module = torch.nn.modules.module
    handles = [nn_module.register_module_forward_pre_hook(push),
               nn_module.register_module_forward_hook(pop, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _head_modules(model: torch.nn.Module) -> set[str]:
    """Modules whose own ops make logits and loss: the output head and the wrappers above it
    (for a causal LM: PeftModel > LoraModel > LlamaForCausalLM, and lm_head). None for
    models without an output embedding: their top module's own ops are real layers."""
    root = type(model).__name__
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        if isinstance(head, torch.nn.Module):
            head_name = next((n for n, m in model.named_modules() if m is head), None)
            if head_name:
                parts = head_name.split(".")
                return {".".join(parts[:i]) or root for i in range(len(parts) + 1)}
    return set()


# --- the trace ----------------------------------------------------------------------------------

@dataclass
class TraceResult:
    events: list[tuple[int, Storage]]
    marks: list[tuple[int, int, str]]
    params_total: int
    params_trainable: int
    model_name: str
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tokens_per_sample: int = 0
    outside_peak: dict[str, int] = field(default_factory=dict)  # place -> most bytes live

    def step_range(self, step: int) -> tuple[int, int]:
        starts = [i for i, s, p in self.marks if s == step]
        ends = [i for i, s, p in self.marks if s == step + 1]
        return starts[0], ends[0] if ends else len(self.events)

    def peak(self, step: int = STEPS, rounded: bool = True) -> tuple[int, int]:
        """(bytes, event index) of the highest live total during `step`."""
        size = round_size if rounded else (lambda n: n)
        start, end = self.step_range(step)
        live, best, best_i = 0, -1, start
        for i, (sign, record) in enumerate(self.events):
            live += sign * size(record.nbytes)
            if start <= i < end and live > best:
                best, best_i = live, i
        return best, best_i

    def report(self, job: Job) -> MemoryReport:
        gpu = _runtime_gpu(job)
        start, end = self.step_range(STEPS)
        live, peak, peak_i, timeline = 0, -1, start, []
        phase_peaks: dict[str, int] = defaultdict(int)
        mark_i, phase = 0, "build"
        marks = sorted(self.marks)
        for i, (sign, record) in enumerate(self.events):
            while mark_i < len(marks) and marks[mark_i][0] <= i:
                phase = marks[mark_i][2]
                mark_i += 1
            live += sign * round_size(record.nbytes)
            if start <= i < end:
                name = {"inputs": "forward", "end": "optimizer"}.get(phase, phase)
                phase_peaks[name] = max(phase_peaks[name], live)
                timeline.append((f"{name}:{record.op}", live))
                if live > peak:
                    peak, peak_i = live, i
        at_peak = _live_at(self.events, peak_i)
        categories = dict.fromkeys(CATEGORIES, 0)
        usage: dict[tuple[str, str], int] = defaultdict(int)
        for record in at_peak:
            category = record.category()
            categories[category] += round_size(record.nbytes)
            usage[(record.label(), category)] += round_size(record.nbytes)
        workspaces = runtime.workspaces_bytes(job.runtime, gpu)
        categories["temporary"] += workspaces
        # near the device's capacity the allocator frees its cache and retries before it
        # reports out of memory, so reserved never exceeds what the GPU can give
        capacity = (gpu.usable_bytes - runtime.runtime_context_bytes(job.runtime, gpu)
                    if gpu else None)
        # sharded jobs: the build's unsharded model never reaches the GPU (built below)
        built = self.step_range(1)[0] if job.parallel.strategy in FSDP_STRATEGIES else 0
        allocator = _replay(self.events, workspaces, job.runtime.cublas_workspaces, capacity,
                            built)
        peak_allocated = sum(categories[c] for c in CATEGORIES[:6])
        categories["allocator_overhead"] = max(0, allocator.peak_reserved - peak_allocated)
        categories["runtime_context"] = job.runtime.cuda_context_bytes
        peak_phase = max(phase_peaks, key=phase_peaks.get) if phase_peaks else ""
        top = sorted(usage.items(), key=lambda kv: -kv[1])[:TOP_MODULES]
        notes = list(self.notes)
        micro = min(job.grad_accum, MICRO_STEPS_TRACED)
        notes.append(f"traced on fake tensors in {self.seconds:.1f} s: step 1 (creates the "
                     f"optimizer state) and step {STEPS} with {micro} of its {job.grad_accum} "
                     "micro-batches (the rest repeat micro-batch 2); step 2 reported")
        notes.append(f"cuBLAS workspaces: {job.runtime.cublas_workspaces} x "
                     f"{runtime.cublas_workspace_bytes(gpu) / 2**20:g} MiB in temporary")
        if self.outside_peak.get(HOST):
            host = self.outside_peak[HOST] / 2**20
            notes.append(f"host memory (CPU offload): at most {host:,.1f} MiB, outside every "
                         "GPU figure")
        notes.append("reserved memory replays the caching allocator" + (
            f" within the {gpu.name}'s capacity (cached blocks are freed before it would grow "
            "past it, as CUDA's allocator retries)" if gpu else " with room to spare (give "
            "--gpu to replay it within that GPU's capacity)"))
        report = MemoryReport(
            engine="trace", job=job, model_name=self.model_name,
            params_total=self.params_total, params_trainable=self.params_trainable,
            per_gpu_of=job.parallel.num_gpus, categories=categories,
            phase_peaks={k: v + workspaces for k, v in phase_peaks.items()},
            peak_phase=peak_phase, runtime_gpu=gpu.name if gpu else None,
            top_modules=[ModuleUsage(name=n, bytes=b, category=c) for (n, c), b in top],
            timeline=_downsample([(e, b + workspaces) for e, b in timeline]),
            tokens_per_step=job.effective_batch * max(self.tokens_per_sample, 1), notes=notes,
            unified_memory_bytes=self.outside_peak.get(UNIFIED, 0))
        return report.model_copy(update={"fits": runtime.fits_for_job(report, job, gpu)})


def run_trace(job: Job, *, time_limit_s: float = 300,
              model_config: dict | None = None) -> TraceResult:
    """Build and run the job's steps on fake tensors; return the raw event log."""
    parallel = job.parallel
    if parallel.tensor_parallel > 1 or parallel.context_parallel > 1:
        raise EngineError(f"the trace engine does not simulate {parallel.strategy} / tensor or "
                          "context parallelism yet: use --engine formula")
    started = time.monotonic()
    tracker = _Tracker(deadline=started + time_limit_s)
    # no fallback kernels: an op without a fake kernel would run for real on zero-filled
    # tensors of full size; better to stop and say which op
    fake = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    kernels = trace_kernels(job)  # imports torchao (if at all) outside the fake mode
    try:
        with _alarm(time_limit_s), sharding(job, tracker) as shard, fake, tracker, \
                transformers_quirks():
            setup = build_training_setup(job, "cpu", model_config=model_config, empty=True,
                                         kernels=kernels)
            shard(setup)
            tracker.head_modules = _head_modules(setup.model)
            with _module_scope(tracker, setup.model):
                for step in range(1, STEPS + 1):
                    _run_step(setup, job, tracker, step)
    except (_TimeLimit, _Watchdog):
        raise EngineError(f"the trace ran past its time limit of {time_limit_s:g} s and was "
                          "stopped: raise the limit (time_limit_s / --time-limit) or use "
                          "--engine formula") from None
    except VramplanError:
        raise
    except Exception as error:
        if tracker.failed_op:
            raise EngineError(
                f"op {tracker.failed_op} cannot run on fake tensors "
                f"({type(tracker.failure).__name__}: its output depends on tensor values). "
                "The trace engine cannot follow this model: use --engine formula, or "
                "--engine measure on a GPU") from None
        if isinstance(error, _TimeLimit) or isinstance(error.__cause__, _TimeLimit):
            raise EngineError(f"the trace ran past its time limit of {time_limit_s:g} s") \
                from None
        raise EngineError(f"tracing {job.model!r} failed: {type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}") from error
    notes = list(setup.notes)
    if tracker.ops & {"convolution", "convolution_backward"}:
        notes.append("convolutions: the cuDNN workspace a GPU allocates inside each "
                     "convolution is not traced (kernel-internal)")
    return TraceResult(tracker.events, tracker.marks, setup.params_total,
                       setup.params_trainable, setup.model_name, notes,
                       time.monotonic() - started, setup.tokens_per_sample,
                       dict(tracker.outside_peak))


def _run_step(setup: TrainingSetup, job: Job, tracker: _Tracker, step: int) -> None:
    def mark(phase: str) -> None:
        if phase in ("inputs", "optimizer"):
            tracker.mark_grads(setup.model)
        tracker.module_stack.clear()
        tracker.mark(step, phase)
    micro = 1 if step < STEPS else min(job.grad_accum, MICRO_STEPS_TRACED)
    train_step(setup, micro, mark)


def _live_at(events: list[tuple[int, Storage]], index: int) -> list[Storage]:
    live: dict[int, Storage] = {}
    for sign, record in events[: index + 1]:
        if sign > 0:
            live[id(record)] = record
        else:
            live.pop(id(record), None)
    return list(live.values())


def _replay(events, workspaces: int, count: int, capacity: int | None = None,
            built: int = 0) -> CachingAllocator:
    """The caching allocator over the events. built > 0: the events before that index (the
    build) are replayed as their end state, what they leave live allocated in order. The
    trace builds a sharded model whole and then shards it, but frameworks build it on the
    meta device, shard it, and only then materialise the shards on the GPU (torchtitan
    b5bcd76c trainer.py: model_config.build() under torch.device("meta"), parallelize_fn,
    then model.to_empty): the unsharded weights are never in the GPU's cache."""
    allocator = CachingAllocator(capacity=capacity)
    for i in range(count):  # allocated at the first matmul of each thread, kept for good
        allocator.malloc(("cublas", i), workspaces // max(count, 1))
    left: dict[int, Storage] = {}
    for sign, record in events[:built]:
        if sign > 0:
            left[id(record)] = record
        else:
            left.pop(id(record), None)
    for record in left.values():
        allocator.malloc(id(record), record.nbytes)
    for sign, record in events[built:]:
        if sign > 0:
            allocator.malloc(id(record), record.nbytes)
        else:
            allocator.free(id(record))
    return allocator


def _downsample(points: list[tuple[str, int]]) -> list[tuple[str, int]]:
    if len(points) <= TIMELINE_POINTS:
        return points
    size = -(-len(points) // TIMELINE_POINTS)
    return [max(points[i:i + size], key=lambda p: p[1]) for i in range(0, len(points), size)]


def _runtime_gpu(job: Job):
    if job.gpu is None:
        return None
    try:
        from vramplan.hardware import get_gpu
    except ImportError:
        return None
    return get_gpu(job.gpu)


__all__ = ["TraceResult", "run_trace", "trace"]
