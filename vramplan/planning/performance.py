"""Step time, throughput, MFU, training time and cost of a job on a GPU type.

The step, per GPU, is modelled phase by phase (a roofline per phase):

  forward, backward, recompute   (x grad_accum)
      device = matmul FLOPs / (peak of the compute dtype x matmul efficiency)
             + attention FLOPs / (peak x attention efficiency)
             + memory-bound bytes / (HBM bandwidth x memory efficiency)
      host   = kernel launches x host time per launch      (eager PyTorch dispatch)
      time   = max(device, host); the bound is the larger term (their sum where the
               host waits for every kernel: bitsandbytes' optimizers, torch's Adafactor)
  optimizer (once)   clip + optimizer step bytes, or the CPU step when offloaded
  communication      each collective's bytes / (link bandwidth x collective efficiency);
                     the part that overlaps a phase hides behind `overlap` of that
                     phase's time, the rest is exposed and added
  host copies        offloaded parameters and activations over the GPU's link to CPU
                     memory (comm.host_copies): copy engines run beside the kernels, so
                     only what a copy takes beyond the phase it overlaps is exposed
  paging             a paged optimizer's states that do not fit beside the step, in and
                     out every step (planning/paging.py), waited on by the optimizer

Peaks and bandwidths come from the GPU catalog; efficiencies from efficiency.toml (with
their sources). fp8 matmuls run at the fp8 rate only on GPUs that list one.

    >>> from vramplan import Job
    >>> from vramplan.hardware import get_gpu
    >>> perf = predict(Job(model="llama-3.2-1b", batch_size=4, seq_len=2048), get_gpu("H200"))
    >>> perf.step_time_s, perf.tokens_per_s
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.engines import pipeline
from vramplan.engines.precision import eager_torchao_nf4
from vramplan.engines.step import describe_step
from vramplan.fit import PRECISION_MATMUL_DTYPE
from vramplan.hardware.gpu import GPU
from vramplan.job import OP_LEVEL_CHECKPOINTING, Job
from vramplan.models import Architecture, load_architecture
from vramplan.planning.amount import TrainingAmount, training_amount
from vramplan.planning.attention_shape import ShapeRates, step_shape_rates
from vramplan.planning.comm import (
    collective_latency_s,
    collectives,
    is_bridged_pair,
    link_bytes_s,
    network_bytes_s,
    nvls_share,
    reduce_width,
    runs_nvls_tree,
    zero_offload,
)
from vramplan.planning.efficiency import (
    Factors,
    attention_kernel,
    cpu_adam_loop_share,
    factors_for,
    fp8_ratio,
    fp32_ratio,
    gemm_model,
    interval,
    interval_bucket,
    sac_host_scale,
    sm_count,
)
from vramplan.planning.flops import check_timed, step_flops
from vramplan.planning.gemm import shape_efficiency
from vramplan.planning.paging import Paging, paging
from vramplan.planning.results import Performance, PhaseTime
from vramplan.planning.traffic import (
    BNB_DEQUANTISE,
    HIDDEN_WIDE_OPS,
    nf4_dequantise_cost,
    step_traffic,
)
from vramplan.units import format_bytes

MICRO_PHASES = ("forward", "backward", "recompute")
# a step that waits this much on its kernel launches gets a note: its time is the CPU's
HOST_BOUND_SHARE = 0.5
# a step whose collectives' NCCL latency is this much of it gets a note
LATENCY_SHARE = 0.05


def compute_dtype(job: Job, gpu: GPU) -> tuple[str, list[str]]:
    """The tensor-core rate the job's matmuls run at on `gpu`, and why when it differs."""
    notes: list[str] = []
    wanted = PRECISION_MATMUL_DTYPE[job.precision]
    if wanted == "fp32" and job.tf32 and "tf32" in gpu.tflops:
        wanted = "tf32"
        notes.append("fp32 matmuls on TF32 tensor cores (tf32), reaching the share of their "
                     "peak 16-bit ones do (as torch.mm measures: efficiency.toml)")
    elif wanted == "fp32":
        share = fp32_ratio(gpu)[1]
        notes.append(f"{gpu.name} has no TF32 tensor cores: fp32 matmuls on the CUDA cores: "
                     f"{share}" if job.tf32 else
                     "fp32 matmuls on the CUDA cores (torch leaves TF32 off by default; --tf32 "
                     f"turns it on): {share}")
    if wanted == "fp8" and "fp8" not in gpu.tflops:
        notes.append(f"{gpu.name} has no fp8 tensor cores: fp8 matmuls timed at the bf16 rate")
        wanted = "bf16"
    if wanted not in gpu.tflops:
        fallback = "fp16" if wanted == "bf16" and "fp16" in gpu.tflops else "fp32"
        notes.append(f"{gpu.name} has no {wanted} tensor cores: timed at the {fallback} rate")
        wanted = fallback
    return wanted, notes


@dataclass(frozen=True)
class PhaseTerms:
    """One phase's work on one GPU, as seconds at 100% efficiency (factors divide them)."""

    phase: str
    per_step: int         # occurrences per optimizer step
    matmul_s: float       # matmul FLOPs / peak
    attention_s: float    # attention FLOPs / peak
    memory_s: float       # memory-bound bytes / bandwidth
    kernels: float        # kernel launches
    flops: float = 0.0
    bytes: float = 0.0
    offload_s: float = 0.0       # optimizer offload: its copies at the host link's rate
    offload_params: float = 0.0  # optimizer offload: elements the CPU updates
    cpu_rate_share: float = 1.0  # ... at this share of the vectorised CPU Adam rate
    copies_beside_cpu: bool = False  # its copies overlap the CPU's update (else follow it)
    modules: float = 0.0         # nn.Module calls (host time beside the launches)
    paged_s: float = 0.0         # paged optimizer states in and out at the host link's rate
    #                              (planning/paging.py: the kernels wait on them)
    synchronised: bool = False   # the host waits for each kernel (bitsandbytes' optimizers,
    #                              torch's Adafactor): host and device time add
    host_scale: float = 1.0      # its launches' host time over a plain eager step's (a
    #                              selective checkpointing policy's forward and recompute)


@dataclass(frozen=True)
class CollectiveTerms:
    name: str
    link_s: float         # bytes / link bandwidth, per occurrence, at 100% efficiency
    times: int            # occurrences per step
    overlaps: str         # phase(s) it can hide behind
    crosses_nodes: bool
    latency_s: float = 0.0  # NCCL's latency of its calls, per occurrence (comm.py)
    host_s: float = 0.0  # a copy to or from CPU memory: bytes / the GPU's host link rate

    def seconds(self, factors: Factors) -> float:
        """One occurrence: its bytes at the link's reached rate, plus its calls' latency."""
        return (self.link_s / factors.collective + self.latency_s
                + self.host_s / factors.host_link)

    def exposed(self, factors: Factors, hide: float) -> float:
        """What one occurrence adds to the step beside `hide` seconds of the phase it
        overlaps: a host copy (copy engines, no SMs) what it takes beyond the phase; a
        collective what `overlap` of the phase does not hide, at least 1 - overlap of it."""
        seconds = self.seconds(factors)
        if self.host_s:
            return max(seconds - hide, 0.0)
        return max(seconds - factors.overlap * hide, (1 - factors.overlap) * seconds)

    @property
    def reduces_gradients(self) -> bool:
        """A data-parallel gradient all-reduce / reduce-scatter (comm.py names them so)."""
        return self.name.startswith("gradient")


@dataclass(frozen=True)
class StepTerms:
    """Everything about a step that does not depend on the efficiency factors."""

    phases: tuple[PhaseTerms, ...]
    collectives: tuple[CollectiveTerms, ...]
    fused_attention: bool  # a fused kernel (timed at the attention factor), not eager
    peak: float
    dtype: str
    tokens_per_step: int
    samples_per_step: int
    model_flops_gpu: float   # per GPU per step, without recomputation
    flops_per_step: float    # executed, all GPUs
    notes: tuple[str, ...] = ()
    bubble: float = 0.0      # pipeline: share of the step the stages sit idle


_WORK: dict[Job, tuple] = {}  # job -> (flops, traffic, memo, step): the same on every GPU
_WORK_LIMIT = 4096


def _work(job: Job, arch: Architecture):
    """FLOPs and bytes of the job's step, memoised: the planner asks for one job on many
    GPU types (an Architecture is the job's model's, so the job is the key). step_terms
    looks it up once and hands it on: a Job's hash walks all its fields."""
    work = _WORK.get(job)
    if work is None:
        if len(_WORK) >= _WORK_LIMIT:
            _WORK.clear()
        check_timed(arch)  # before the step description: a CNN gets its own line
        step = describe_step(job, arch)
        work = _WORK[job] = (step_flops(job, arch, step=step),
                             step_traffic(job, arch, step=step), {}, step)
    return work


def _collectives(job: Job, arch: Architecture, work: tuple, gpu: GPU):
    """collectives(), memoised with the job's work: they depend on the GPU only through
    how many GPUs share a node and how they are joined."""
    memo = work[2]
    key = (gpu.gpus_per_node, gpu.interconnect)
    if key not in memo:
        memo[key] = collectives(job, arch, gpu, step=work[3])
    return memo[key]


def _per_gpu_work(job: Job, work: tuple) -> dict:
    """The GPU-independent part of step_terms: FLOPs and bytes per phase on one GPU."""
    flops, traffic, memo, step = work
    if "unit" in memo:
        return memo["unit"]
    par = job.parallel
    split = par.tensor_parallel * par.context_parallel  # model-parallel ranks share the work
    share, head = _pace(step.stages, flops)
    phases = []
    for phase in MICRO_PHASES:
        by = {c: getattr(flops.by_class[c], phase) for c in flops.by_class}
        head_mm = head * by.get("head", 0) / split
        mm = (share * (by.get("linear", 0) + by.get("lora", 0))
              + (by.get("frontend", 0) if share == 1 else 0)) / split + head_mm
        attention = share * by.get("attention", 0) / split
        moved = share * traffic.bytes[phase] / split
        if par.tensor_parallel > 1 and not par.sequence_parallel:  # whole on each TP rank
            wide = sum(traffic.by_op_phase.get((op, phase), 0.0) for op in HIDDEN_WIDE_OPS)
            moved += share * wide * (1 - 1 / par.tensor_parallel) / par.context_parallel
        # the block linears' weight-gradient GEMMs (as many FLOPs as their forward) when
        # their weights train: fp8 recipe rowwise_with_gw_hp runs them in 16-bit
        wgrad_mm = (share * flops.by_class["linear"].forward / split
                    if phase == "backward" and job.peft is None and "linear" in flops.by_class
                    else 0.0)
        if mm or attention or moved:
            phases.append((phase, mm, attention, moved, share * traffic.kernels[phase],
                           share * traffic.modules[phase], head_mm, wgrad_mm))
    shards = par.tensor_parallel * par.shard_degree
    trainable = (step.params.trainable / shards
                 * share if job.offload.optimizer else 0.0)
    dp = par.data_parallel
    memo["unit"] = unit = dict(
        phases=phases, optimizer_bytes=share * traffic.bytes["optimizer"] / shards,
        optimizer_kernels=traffic.kernels["optimizer"], offload_params=trainable,
        optimizer_synchronised=traffic.synchronised,
        grad_width=step.params.gradients / max(step.params.trainable, 1),
        bubble=pipeline.bubble_fraction(job),
        tokens_per_step=flops.tokens * job.grad_accum * dp,
        samples_per_step=flops.samples * job.grad_accum * dp,
        model_flops_gpu=flops.model_flops * job.grad_accum / (split * par.pipeline_parallel),
        flops_per_step=flops.total * job.grad_accum * dp, notes=list(flops.notes))
    return unit


def _pace(stages: tuple, flops) -> tuple[float, bool]:
    """(share of the blocks, holds the head) of the stage whose work sets a pipeline's pace:
    the last, with its blocks and the head, or, split unevenly, one with more blocks and no
    head where those weigh more (memory-bound bytes and kernels scale with the share)."""
    last = stages[-1]
    others = max((s.layer_share for s in stages[:-1]), default=0.0)

    def total(classes: tuple[str, ...]) -> float:
        return sum(getattr(flops.by_class[c], phase) for c in classes if c in flops.by_class
                   for phase in MICRO_PHASES)

    blocks = total(("linear", "lora", "attention"))
    if others * blocks > last.layer_share * blocks + total(("head",)):
        return others, False
    return last.layer_share, True


def _shape(job: Job, arch: Architecture, work: tuple, gpu: GPU, peak: float) -> float:
    """gemm.shape_efficiency, memoised with the job's work (per GPU type)."""
    memo = work[2]
    key = ("shape", gpu.name, peak)
    if key not in memo:
        ceiling = factors_for(gpu, calibrated=False).matmul
        sms = sm_count(gpu)
        memo[key] = shape_efficiency(job, arch, gemm_model(peak / sms if sms else None), sms,
                                     peak * ceiling, step=work[3])
    return memo[key]


def step_terms(job: Job, gpu: GPU, arch: Architecture | None = None) -> StepTerms:
    """The step's work per GPU and phase, before efficiency factors (fitting reuses it)."""
    arch = arch or load_architecture(job.model)
    dtype, notes = compute_dtype(job, gpu)
    peak = gpu.tflops[dtype] * 1e12
    bandwidth = gpu.bandwidth_bytes_s
    work = _work(job, arch)
    unit = _per_gpu_work(job, work)
    shape = _shape(job, arch, work, gpu, peak)
    attention_peak = peak
    if dtype == "fp32":  # CUDA cores, not tensor cores: their own measured share (attention too)
        ratio = fp32_ratio(gpu)[0]
        shape *= ratio
        attention_peak = peak * ratio
    head_rate = peak * shape  # the head's matmuls: the job's rate, except under fp8
    if dtype == "fp8":  # fp8 GEMMs reach a smaller share of their (doubled) peak
        sixteen = gpu.tflops["bf16" if "bf16" in gpu.tflops else "fp16"] * 1e12
        head_rate = sixteen * shape
        shape *= fp8_ratio(gpu)
        # float8 training converts the block linears only (engines/precision.py fp8):
        # attention and the output head run in 16-bit (torchao's float8 and Transformer
        # Engine leave SDPA / flash attention in bf16; torchtitan's train configs skip the
        # head, models/llama3/train_configs/llama3_8b.toml [float8] filter_fqns = ["output"];
        # Megatron-Core's fp8 is its transformer layers' TE linears)
        attention_peak = sixteen
        if not job.compiles_blocks:
            notes.append("fp8 without --compile: each Float8Linear cast runs as torchao's "
                         "eager kernels (6 per cast), which can cost more than the fp8 matmuls "
                         "save; torch.compile (--set compile=true) fuses them")
    if eager_torchao_nf4(job):
        per_element, kernels = nf4_dequantise_cost(job)
        notes.append(f"torchao's NF4 weights dequantise in {kernels} eager kernels per linear "
                     f"call ({per_element:.3g} bytes moved per weight, bitsandbytes' kernel "
                     f"{BNB_DEQUANTISE[0]:.3g}), in each forward, recomputation and backward")
    fused = work[3].attention != "eager"
    rates = ShapeRates()
    # fp32 SDPA (TF32 or not) runs the memory-efficient kernel: no cuDNN, no FlashAttention
    if fused and job.precision != "fp32":
        kernel = attention_kernel(job.attention, gpu)
        attention_peak *= kernel.speedup
        rates = step_shape_rates(kernel.name, work[3])
        notes += [n for n in (kernel.note, rates.note) if n]
    # torchao's rowwise_with_gw_hp keeps grad_weight's GEMM in bf16, at head_rate (torchao/
    # float8/config.py Float8LinearConfig.from_recipe_name: its grad_weight cast is
    # disabled); Transformer Engine's recipes run all three in fp8
    sixteen_bit_wgrad = dtype == "fp8" and job.fp8.recipe == "rowwise_with_gw_hp"
    # torch's selective checkpointing policy runs in Python on every op of each block's
    # forward and recompute (the head's few are left in); compiled blocks trace it away
    policy = sac_host_scale() if job.checkpointing in OP_LEVEL_CHECKPOINTING and not (
        job.compiles_blocks) else 1.0
    if policy > 1:
        notes.append(f"{job.checkpointing} checkpointing: torch's policy runs in Python on "
                     "every op of each block's forward and recompute, whose host time it "
                     f"makes {policy:.3g}x a plain step's (--set compile=true traces it away)")
    phases = []
    for phase, mm, attention, moved, kernels, modules, head_mm, wgrad_mm in unit["phases"]:
        sixteen_mm = head_mm + (wgrad_mm if sixteen_bit_wgrad else 0.0)
        phases.append(PhaseTerms(phase, job.grad_accum,
                                 (mm - sixteen_mm) / (peak * shape) + sixteen_mm / head_rate,
                                 attention / (attention_peak * (
                                     rates.backward if phase == "backward" else rates.forward)),
                                 moved / bandwidth,
                                 kernels, mm + attention, moved, modules=modules,
                                 host_scale=policy if phase in ("forward", "recompute")
                                 else 1.0))
    if job.offload.optimizer:
        # the update on the CPU, then the updated weights up in their dtype on the GPU (a
        # master copy stays with the optimizer on the CPU; the gradients came down in the
        # backward, comm.host_copies): DeepSpeed copies them after its step, torchao's
        # CPUOffloadOptimizer each one after its own parameter's step, beside the next one's;
        # with offload.params the updated weights stay on the CPU
        trainable = unit["offload_params"]
        pcie = 0.0 if job.offload.params else trainable * unit["grad_width"]
        vectorised = cpu_step_vectorised(job)
        phases.append(PhaseTerms("optimizer", 1, 0.0, 0.0, 0.0, unit["optimizer_kernels"],
                                 bytes=pcie, offload_s=pcie / gpu.host_link_bytes_s,
                                 offload_params=trainable,
                                 cpu_rate_share=1.0 if vectorised else cpu_adam_loop_share(),
                                 copies_beside_cpu=not zero_offload(job)))
        notes.append("optimizer step on the CPU (offloaded): "
                     + ("a vectorised CPU Adam (DeepSpeed's CPUAdam, or torch's fused=True)"
                        if vectorised else "torch's for-loop AdamW, its default on CPU "
                        f"tensors, {1 / cpu_adam_loop_share():.2g}x slower than fused=True "
                        "(--optimizer-impl fused)")
                     + "; timed at our 2-core VM's rate, which more CPU cores beat")
    else:
        paged = paging(job, gpu)
        phases.append(PhaseTerms("optimizer", 1, 0.0, 0.0, unit["optimizer_bytes"] / bandwidth,
                                 unit["optimizer_kernels"], bytes=unit["optimizer_bytes"],
                                 paged_s=paged.moved / gpu.host_link_bytes_s if paged else 0.0,
                                 synchronised=unit["optimizer_synchronised"]))
        notes += _paging_note(paged, gpu)
    comms, staged = [], []
    network = network_bytes_s(job, gpu)
    for c in _collectives(job, arch, work, gpu):
        times = {"micro-batch": job.grad_accum,
                 "schedule": job.parallel.pipeline_flushes}.get(c.per, 1)
        rate = link_bytes_s(c, gpu, network)
        if c.link == "host":
            comms.append(CollectiveTerms(c.name, 0.0, times, c.overlaps, False,
                                         host_s=c.bytes_per_gpu / rate))
            continue
        comms.append(CollectiveTerms(c.name, c.bytes_per_gpu / rate, times,
                                     c.overlaps, c.link == "network",
                                     c.calls * collective_latency_s(c, gpu)))
        if c.link == "network":
            via = ""
            if runs_nvls_tree(c):
                via = (f", {rate / 1e9:g} GB/s as NCCL's NVLS tree over two nodes (twice a "
                       f"ring over its {c.nics} GPUs' NICs per node, at most NVLS's inside "
                       "the node)")
            elif c.nics > 1:
                via = f", {rate / 1e9:g} GB/s over its {c.nics} GPUs' NICs per node"
            notes.append(f"{c.name} crosses nodes: {network / 1e9:g} GB/s per GPU"
                         + ("" if job.parallel.network_gb_s is None else " (parallel.network_gb_s)")
                         + via)
        elif not gpu.p2p:
            staged.append(c.name)
        elif is_bridged_pair(gpu, c.group, c.stride):
            notes.append(f"{c.name}: a bridged pair of {gpu.name}s, over its NVLink bridge "
                         f"({gpu.pair_link_bytes_s / 1e9:g} GB/s)")
        elif (speedup := nvls_share(c, gpu)) > 1:
            notes.append(f"{c.name}: NCCL's NVLS (NVLink SHARP) inside the node, "
                         f"{speedup:.3g}x a ring's bandwidth")
        elif c.link_share < 1:
            notes.append(f"{c.name}: {c.group} GPUs of a switchless node (a full mesh of "
                         f"links, one to each peer) reach {c.link_share:.2g} of its bandwidth")
    reduced = [c.name for c in comms if c.reduces_gradients]
    if reduced and reduce_width(job) is not None:
        notes.append(f"{', '.join(reduced)}: {reduce_width(job)} bytes a gradient "
                     f"(parallel.grad_reduce_dtype {job.parallel.grad_reduce_dtype})")
    if job.parallel.network_gb_s is None and any(c.crosses_nodes for c in comms):
        notes.append(f"the network between nodes is the catalog's usual {gpu.name} server's; "
                     "--set parallel.network_gb_s=GB/s per GPU for your cluster's")
    if staged:
        link = gpu.interconnect_bytes_s / 1e9
        notes.append(f"{gpu.name}s have no peer-to-peer access: NCCL stages "
                     f"{', '.join(staged)} through host memory, a {link:g} GB/s link "
                     "(collectives measure 2-15 GB/s there, by platform)")
    return StepTerms(tuple(phases), tuple(comms), fused, peak, dtype,
                     tokens_per_step=unit["tokens_per_step"],
                     samples_per_step=unit["samples_per_step"],
                     model_flops_gpu=unit["model_flops_gpu"],
                     flops_per_step=unit["flops_per_step"],
                     notes=tuple(dict.fromkeys(notes + unit["notes"])), bubble=unit["bubble"])


def cpu_step_vectorised(job: Job) -> bool:
    """Whether an offloaded optimizer step runs a vectorised CPU kernel: DeepSpeed's CPUAdam
    (ZeRO's offload), or torch's with fused=True (torchao's CPUOffloadOptimizer asks for it);
    else torch's for-loop, its default for CPU tensors (FSDP's CPUOffload steps the
    user's optimizer there)."""
    return zero_offload(job) or job.optimizer_impl == "fused"


def phase_times(terms: StepTerms, factors: Factors) -> tuple[list[PhaseTime], float]:
    """Each phase's time and bound, and the exposed communication per step."""
    out = []
    for p in terms.phases:
        attention_eff = factors.attention if terms.fused_attention else factors.matmul
        compute = p.matmul_s / factors.matmul + p.attention_s / attention_eff
        memory = p.memory_s / factors.memory
        host = (p.kernels * factors.kernel_us + p.modules * factors.module_us) * 1e-6 \
            * p.host_scale
        if p.offload_params:
            copy = p.offload_s / factors.host_link
            update = p.offload_params / (factors.cpu_adam_params_per_s * p.cpu_rate_share)
            host += max(copy, update) if p.copies_beside_cpu else copy + update
        device = compute + memory
        bound = "host" if host > device else ("compute" if compute >= memory else "memory")
        paged = p.paged_s / factors.host_link
        busy = device + host if p.synchronised else max(device, host)
        if paged > busy:
            bound = "host link"
        out.append(PhaseTime(phase=p.phase, time_s=busy + paged,
                             per_step=p.per_step,
                             bound=bound, flops=p.flops, bytes=p.bytes, kernels=p.kernels))
    if terms.bubble:
        # (p - 1) / (m + p - 1) of the step idle: the micro-batches' time / (1 - bubble)
        micro = [p for p in out if p.phase in MICRO_PHASES]
        busy = sum(p.time_s * p.per_step for p in micro)
        slowest = max(micro, key=lambda p: p.time_s * p.per_step)
        out.append(PhaseTime(phase="pipeline bubble", time_s=busy * terms.bubble
                             / (1 - terms.bubble), per_step=1, bound=slowest.bound))
    by_phase = {p.phase: p.time_s for p in out}
    exposed = 0.0
    for c in terms.collectives:
        if c.overlaps == "both":
            hide = by_phase.get("forward", 0.0) + by_phase.get("backward", 0.0)
        else:
            hide = by_phase.get(c.overlaps, 0.0)
        exposed += c.times * c.exposed(factors, hide)
    return out, exposed


def step_time(terms: StepTerms, factors: Factors) -> float:
    phases, comm = phase_times(terms, factors)
    return sum(p.time_s * p.per_step for p in phases) + comm


def predict(job: Job, gpu: GPU, amount: TrainingAmount | None = None, *,
            arch: Architecture | None = None, factors: Factors | None = None) -> Performance:
    """Predicted step time, throughput, MFU and (with `amount`) training time and cost of
    `job` on `job.parallel.num_gpus` GPUs of type `gpu`."""
    factors = factors or job_factors(job, gpu, arch)
    terms = step_terms(job, gpu, arch)
    phases, comm_s = phase_times(terms, factors)
    step = sum(p.time_s * p.per_step for p in phases) + comm_s
    if comm_s:
        phases.append(PhaseTime(phase="communication", time_s=comm_s, per_step=1,
                                bound="communication"))
    by_time = max(phases, key=lambda p: p.time_s * p.per_step)
    n = job.parallel.num_gpus
    perf = dict(
        gpu=gpu.name, num_gpus=n, compute_dtype=terms.dtype, step_time_s=step,
        tokens_per_step=terms.tokens_per_step, samples_per_step=terms.samples_per_step,
        tokens_per_s=terms.tokens_per_step / step,
        tokens_per_s_per_gpu=terms.tokens_per_step / step / n,
        samples_per_s=terms.samples_per_step / step,
        mfu=terms.model_flops_gpu / (step * terms.peak), flops_per_step=terms.flops_per_step,
        bound=by_time.bound, phases=phases, communication_s=comm_s, factors=factors.source,
        notes=list(terms.notes) + _host_note(_launching(phases, job), step, factors)
        + _gradient_reduce_note(job, terms, factors, step) + _latency_note(terms, step)
        + _host_copy_note(terms, factors, gpu))
    training = _training(amount, gpu, step, terms.tokens_per_step, terms.samples_per_step, n)
    low, high = factors.interval or job_interval(job, arch)
    perf["step_time_range_s"] = (step * low, step * high)
    if training.get("training_time_s") is not None:
        t = training["training_time_s"]
        training["training_time_range_s"] = (t * low, t * high)
    if training.get("cost_usd") is not None:
        c = training["cost_usd"]
        training["cost_range_usd"] = (c * low, c * high)
    return Performance(**perf, **training)


def job_factors(job: Job, gpu: GPU, arch: Architecture | None = None) -> Factors:
    """The factors `job` runs at on `gpu`: the user's calibrated ones, else the shipped ones
    of its kind (efficiency.factors_for: one GPU and an encoder or adapters on several take
    the single-GPU shares)."""
    arch = arch or load_architecture(job.model)
    return factors_for(gpu, num_gpus=job.parallel.num_gpus, decoder=arch.kind == "decoder",
                       adapters=job.peft is not None)


def interval_bucket_of(job: Job, arch: Architecture | None = None) -> str:
    """Which of the shipped 80% intervals `job`'s times carry (efficiency.interval_bucket)."""
    arch = arch or load_architecture(job.model)
    return interval_bucket(job.parallel.num_gpus, arch.kind == "decoder", job.peft is not None)


def job_interval(job: Job, arch: Architecture | None = None) -> tuple[float, float]:
    """The shipped 80% interval (low, high multipliers) of `job`'s predicted times."""
    return interval(interval_bucket_of(job, arch))


def _launching(phases: list[PhaseTime], job: Job) -> list[PhaseTime]:
    """The phases whose host time is kernel launches: not an offloaded optimizer step,
    whose host time is the CPU's update (its own note says so)."""
    return [p for p in phases if not (p.phase == "optimizer" and job.offload.optimizer)]


def _host_note(phases: list[PhaseTime], step: float, factors: Factors) -> list[str]:
    """Where the step mostly waits on the CPU: its time is the host's, which differs from
    machine to machine (the published runs' hosts and our H200 VM's, 3x apart)."""
    host = sum(p.time_s * p.per_step for p in phases if p.bound == "host")
    if host <= HOST_BOUND_SHARE * step:
        return []
    whose = ("calibrated on your runs" if factors.calibrated else "as on the published runs' "
             "hosts: a slower CPU runs it longer (up to 3x seen); vramplan calibrate measures "
             "yours")
    return [f"host-bound: {host / step:.0%} of the step waits on the CPU launching kernels "
            f"({factors.kernel_us:.3g} us each, {whose}); a larger batch or torch.compile "
            "hides it"]


def _host_copy_note(terms: StepTerms, factors: Factors, gpu: GPU) -> list[str]:
    """What the offloads copy to and from CPU memory, and how it is timed."""
    copies = [c for c in terms.collectives if c.host_s]
    if not copies:
        return []
    moved = sum(c.times * c.host_s for c in copies) * gpu.host_link_bytes_s
    rate = factors.host_link * gpu.host_link_bytes_s / 1e9
    return [f"offload copies {format_bytes(int(moved))} a step over the {gpu.host_link} link "
            f"to CPU memory at {rate:.3g} GB/s ({factors.host_link:.0%} of its "
            f"{gpu.host_link_bytes_s / 1e9:g}, gpus.toml host_link_gb_s): "
            f"{'; '.join(c.name.removeprefix('host copy: ') for c in copies)}; copy engines "
            "run them beside the kernels, so the step shows what they take beyond the phase "
            "each overlaps"]


def _paging_note(paged: Paging | None, gpu: GPU) -> list[str]:
    """Why a paged optimizer's step moves its states over the host link, and how much."""
    if not paged or not paged.moved:
        return []
    short = format_bytes(int(paged.states - paged.free))
    return [f"paged optimizer states ({format_bytes(int(paged.states))} in unified memory) do "
            f"not fit in the {format_bytes(int(paged.free))} the step leaves free on the "
            f"{gpu.name}: the driver evicts the least recently migrated to make room, so each "
            f"step pages all of them in and out again, {format_bytes(int(paged.moved))} over "
            f"its {gpu.host_link} link, and the optimizer waits on it (planning/paging.py); "
            f"{short} more free memory keeps them on the GPU"]


def _latency_note(terms: StepTerms, step: float) -> list[str]:
    """Where NCCL's per-call latency is a visible share of the step: it grows with the ranks
    of each ring, not with the bytes, so a larger micro-batch or a smaller ring is the fix."""
    latency = sum(c.times * c.latency_s for c in terms.collectives)
    if latency <= LATENCY_SHARE * step:
        return []
    return [f"NCCL's per-call latency adds up to {latency:.3g} s of the collectives' time in the "
            f"{step:.3g} s step (part of it hides behind compute): it grows with the GPUs in "
            "each ring, not with the bytes, so a larger micro-batch spreads it"]


def _gradient_reduce_note(job: Job, terms: StepTerms, factors: Factors,
                          step: float) -> list[str]:
    """Where the gradient reduction waits for the backward, what it costs and what hides it."""
    if job.parallel.overlap_grad_reduce:
        return []
    waiting = sum(c.times * c.seconds(factors) for c in terms.collectives
                  if c.reduces_gradients)
    if not waiting:
        return []
    return [f"the gradient reduction runs after the backward (parallel.overlap_grad_reduce "
            f"false): {waiting:.3g} s of the {step:.3g} s step; DeepSpeed's "
            "zero_optimization.overlap_comm true or Megatron-LM's --overlap-grad-reduce "
            f"overlaps it with the backward (about {factors.overlap:.0%} of it hides)"]


def performance_for(job: Job, gpu: str | GPU, *, tokens: int | None = None,
                    samples: int | None = None, epochs: float | None = None,
                    dataset_samples: int | None = None,
                    price_per_hour: float | None = None) -> Performance | None:
    """predict() from plain arguments (the API's and CLI's); None for models whose step
    time is not modelled (CNNs). Bad amounts raise JobError."""
    from vramplan.hardware import get_gpu

    amount = training_amount(tokens=tokens, samples=samples, epochs=epochs,
                             dataset_samples=dataset_samples, price_per_hour=price_per_hour)
    arch = load_architecture(job.model)
    if arch.kind == "cnn":
        return None
    return predict(job, gpu if isinstance(gpu, GPU) else get_gpu(gpu), amount, arch=arch)


def _training(amount: TrainingAmount | None, gpu: GPU, step: float, tokens_per_step: int,
              samples_per_step: int, num_gpus: int) -> dict:
    """Training time, GPU-hours and cost for `amount`; None where not computable."""
    price = (amount.price_per_hour if amount and amount.price_per_hour else gpu.price_per_hour)
    out: dict = {"price_per_hour": price, "cost_per_million_tokens_usd": (
        price * num_gpus / 3600 * step / tokens_per_step * 1e6 if price is not None else None)}
    steps = amount.steps(tokens_per_step, samples_per_step) if amount else None
    if steps is None:
        return out
    seconds = steps * step
    hours = seconds * num_gpus / 3600
    out.update(steps=steps, training_time_s=seconds, gpu_hours=hours,
               cost_usd=hours * price if price is not None else None)
    return out


SORT_KEYS = ("cost", "time", "headroom")


def per_gpu(job: Job, fits: list, amount: TrainingAmount | None = None,
            sort: str = "time") -> list[tuple[object, Performance | None]]:
    """(GpuFit, Performance or None) for each GPU of a report's fit table, the GPUs that fit
    first, sorted by cost, time or headroom (estimate's table without --gpu)."""
    from vramplan.errors import JobError
    from vramplan.hardware import get_gpu

    if sort not in SORT_KEYS:
        raise JobError(f"sort must be one of {', '.join(SORT_KEYS)} (got {sort!r})")
    arch = load_architecture(job.model)
    rows = []
    for fit in fits:
        perf = None
        if arch.kind != "cnn":
            perf = predict(job, get_gpu(fit.gpu), amount, arch=arch)
        rows.append((fit, perf))

    def key(row):
        fit, perf = row
        if sort == "headroom":
            return (not fit.fits, -fit.headroom_bytes / fit.usable_bytes)
        if perf is None:
            return (not fit.fits, float("inf"))
        if sort == "cost":
            value = (perf.cost_usd if perf.cost_usd is not None
                     else perf.cost_per_million_tokens_usd)
            return (not fit.fits, value if value is not None else float("inf"))
        return (not fit.fits, perf.step_time_s / perf.tokens_per_step)

    return sorted(rows, key=key)
