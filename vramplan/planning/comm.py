"""Communication of one training step: which collectives run, how many bytes each GPU
sends, over which link, and with which compute they can overlap.

Ring collectives over n ranks (NCCL's ring algorithm; NCCL docs, "Performance: busBw"):
each rank sends (n - 1) / n of the buffer for a reduce-scatter or an all-gather, and twice
that for an all-reduce. A group that fits in one node runs over the GPU interconnect
(NVLink / PCIe); a group that spans nodes is limited by the network share of each GPU.
Across nodes NCCL runs one ring per channel and spreads the channels' node crossings over
the NICs of the node's GPUs (NCCL docs, NCCL_CROSS_NIC), and a collective's bus bandwidth is
that of its bottleneck link (nccl-tests doc/PERFORMANCE.md): so a group with k ranks in
each node moves its ring traffic at k x one GPU's network share, at most the NVLink rate
(our reading of both, checked on the published runs: benchmarks/published_accuracy.py);
point-to-point sends (pipeline, the context-parallel ring) use one GPU's NIC. An
all-reduce over exactly two NVLS nodes runs NCCL's NVLS tree instead, at up to twice the
ring's network rate (runs_nvls_tree). Each NCCL
call also pays a latency (collective_latency_s: NCCL's own tuning model, efficiency.toml
[nccl]), and one collective here stands for `calls` of them (DDP buckets, FSDP units, the
tensor-parallel all-reduces of every block).

The node is the job's `parallel.gpus_per_node` where the job sets it, else the GPU
catalog's. An NVLink node of at most 4 GPUs has no NVSwitch (HGX 4-GPU boards, NVL 4-way
bridges: a full mesh, each GPU's links split evenly among its peers), and AMD's MI300X and
MI325X nodes are a full mesh of Infinity Fabric links, one to each of the 7 peers, so a
group of g of its m GPUs reaches only (g - 1) / (m - 1) of the GPU's interconnect
bandwidth (efficiency.toml [topology]).

  ddp         all-reduce of the gradients once per optimizer step (no_sync while
              accumulating), overlapped with the last micro-batch's backward (buckets)
  zero1/2     reduce-scatter of gradients (overlapped with backward), all-gather of the
              updated parameters after the step (not overlapped)
              (every gradient collective: after the backward, not overlapped, when
              parallel.overlap_grad_reduce is false)
  zero3/fsdp  per micro-batch: all-gather of 16-bit parameters in forward and again in
              backward (prefetched: overlapped), reduce-scatter of gradients (overlapped;
              with parallel.fsdp_no_sync once per step, the last micro-batch's); without
              parallel.reshard_after_forward no backward all-gather; under a pipeline
              (torch's schedules defer FSDP's sync and resharding to a schedule's last
              micro-batch) one reduce-scatter per schedule, and without resharding after
              forward one all-gather per schedule too;
              with fp8.fsdp_float8_all_gather the block linears' weights travel in float8
  hybrid      fsdp inside a node, plus an all-reduce of the gradient shards between nodes
  (the gradient collectives move the gradients' own dtype unless parallel.grad_reduce_dtype
  names another: reduce_share)
  tensor par. 2 all-reduces of the activations per block in forward, 2 in backward (and
              the forward's 2 again when full checkpointing recomputes the block)
              (Megatron-LM), on the critical path; with sequence parallelism each is an
              all-gather and a reduce-scatter (twice the calls, the same bytes); with
              parallel.async_tp (torchtitan's async TP, Megatron's --tp-comm-overlap)
              overlapped with forward and backward
  context     ring attention: each rank passes its k and v chunk around the ring,
              forward and (with their gradients) backward, overlapped with attention
  pipeline    per micro-batch, each stage sends its output activation forward and the
              gradient of its input back (point to point; v times over for an
              interleaved schedule of v chunks), on the critical path. Stages are the
              outermost dimension (Megatron-LM's order): they cross nodes when the job does

Copies between the GPU and CPU memory (link "host": the GPU's PCIe, or NVLink-C2C on a Grace
superchip, gpus.toml host_link; host_copies) run on copy engines beside the kernels, hidden
where the phase they overlap takes longer:
  offload.params        each micro-batch's forward and backward upload the GPU's parameter
                        shard as stored (FSDP's CPUOffload reshards after forward; ZeRO-3's
                        offload_param alike); the gradient shard goes down once per reduce
  activation_offload    what the offload hooks take (formula.saved.offloaded_bytes) goes
                        down in forward and comes back in backward
  offload.optimizer     the gradients go down during the backward: DeepSpeed's ZeRO-Offload
                        (zero1-3) casts its partition to fp32 on the GPU first and copies it
                        at the accumulation boundary (runtime/zero/stage_1_and_2.py
                        copy_grads_in_partition, DeepSpeed 0.19.8); torchao's
                        CPUOffloadOptimizer copies each gradient as it is, from a post-
                        accumulate-grad hook on a side stream, every micro-batch
                        (torchao/optim/cpu_offload.py). The updated weights come back after
                        the CPU step (performance.py: its optimizer phase)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from vramplan.engines import pipeline
from vramplan.engines.formula.saved import offloaded_bytes
from vramplan.engines.precision import dtypes_for
from vramplan.engines.step import Step, describe_step
from vramplan.hardware.gpu import GPU
from vramplan.job import Job
from vramplan.models import Architecture
from vramplan.planning.efficiency import (
    architecture_of,
    collective_calls,
    nccl_latency,
    nvlink_mesh_max_gpus,
    nvls_all_reduce_speedup,
)


@dataclass(frozen=True)
class Collective:
    name: str            # e.g. "gradient all-reduce (ddp)"
    bytes_per_gpu: float  # bytes each GPU sends, per occurrence
    per: str             # "step", "micro-batch" or "schedule" (once per pipeline flush, per
    #                      step without a pipeline)
    overlaps: str        # the phase it can hide behind: "backward", "forward", "" (none)
    link: str            # "interconnect", "network" or "host" (to CPU memory)
    group: int           # ranks in the collective
    link_share: float = 1.0  # of the link's bandwidth the group reaches: a switchless NVLink
    #                          mesh's share, x NVLS's speedup of an all-reduce (nvls_share)
    nics: int = 1        # network: the group's GPUs per node, whose NICs its rings share
    kind: str = "p2p"    # "all-reduce", "all-gather", "reduce-scatter", "p2p" (sends) or
    #                      "copy" (host)
    calls: int = 1       # NCCL calls it stands for, per occurrence (buckets, FSDP units)
    nvls: bool = False   # its node runs NCCL's NVLS (switched Hopper / Blackwell: nvls_node)
    stride: int = 1      # ranks between two of its group's (1: neighbours; a bridged pair)


def ring_bytes(kind: str, buffer: float, n: int) -> float:
    """Bytes one rank sends in a ring collective of `buffer` bytes over n ranks."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n * buffer
    return 2 * share if kind == "all-reduce" else share


def collective_latency_s(c: Collective, gpu: GPU) -> float:
    """The latency of one NCCL call of `c` by NCCL's tuning model ([nccl]): ring steps at
    their hop's latency; NVLS's inside an NVSwitch node of Hopper or later; an all-reduce
    the lowest of ring, tree and NVLS tree. Point-to-point sends (pipeline, the
    context-parallel ring) are left at 0: one hop each, beside transfers of milliseconds."""
    n = c.group
    if c.kind == "p2p" or n <= 1:
        return 0.0
    lat = nccl_latency()
    per_node = c.nics if c.link == "network" else n
    nodes = -(-n // per_node)
    hop = lat["nvlink_hop"] if _nvlink(gpu) and gpu.p2p else lat["pcie_hop"]
    if c.kind == "all-reduce":
        steps, crossing = 2 * (n - 1), 2 * nodes if nodes > 1 else 0
    else:
        steps, crossing = n - 1, nodes - 1
    ring = lat["ring_base"] + (steps - crossing) * hop + crossing * lat["net_hop"]
    nvls = c.nvls
    if c.kind != "all-reduce":
        return min(ring, lat["nvls"]) if nvls and nodes == 1 else ring
    doublings = math.floor(math.log2(nodes))
    options = [ring, 2 * ((per_node - 1) + doublings) * lat["tree_hop"]]
    if nvls:
        options.append(lat["nvls"] + 2 * doublings * lat["nvls_tree_net_hop"])
    return min(options)


def nvls_node(gpu: GPU, per_node: int) -> bool:
    """Whether NCCL runs NVLS (NVLink SHARP) in a node of `per_node` such GPUs: Hopper and
    Blackwell GPUs behind an NVSwitch (more than a switchless mesh's GPUs)."""
    switched = _nvlink(gpu) and per_node > nvlink_mesh_max_gpus()
    return architecture_of(gpu) in ("hopper", "blackwell") and switched and gpu.p2p


def is_bridged_pair(gpu: GPU, group: int, stride: int) -> bool:
    """Two neighbouring GPUs of a kind sold in NVLink-bridged pairs (gpus.toml
    pair_link_gb_s): they exchange over the bridge, not PCIe."""
    return gpu.pair_link_bytes_s is not None and group == 2 and stride == 1


def nvls_share(c: Collective, gpu: GPU) -> float:
    """An all-reduce inside an NVLS node reaches [nvls_all_reduce]'s multiple of a ring's
    bus bandwidth; every other collective the ring's."""
    if c.nvls and c.kind == "all-reduce" and c.link == "interconnect":
        return nvls_all_reduce_speedup(architecture_of(gpu))
    return 1.0


def _nvlink(gpu: GPU) -> bool:
    # an NVLink interconnect names itself first; "PCIe 4.0 x16 (no NVLink)" is not one
    return gpu.interconnect.startswith("NVLink")


def node_size(job: Job, gpu: GPU) -> int:
    """GPUs per node: the job's own where it says so, else the catalog's for `gpu`."""
    par = job.parallel
    return par.gpus_per_node if "gpus_per_node" in par.model_fields_set else gpu.gpus_per_node


def network_bytes_s(job: Job, gpu: GPU) -> float:
    """The network between nodes, per GPU, one direction: the job's own where it says so
    (parallel.network_gb_s, the user's cluster), else the catalog's for `gpu`."""
    own = job.parallel.network_gb_s
    return own * 1e9 if own is not None else gpu.network_bytes_s


def _full_mesh(gpu: GPU, per_node: int) -> bool:
    """A node whose GPUs are wired pairwise, without a switch: NVLink nodes of at most
    [topology]'s GPUs, and a catalog interconnect that says "full mesh" (AMD's Infinity
    Fabric on MI300X / MI325X: 7 links, one to each peer)."""
    return (_nvlink(gpu) and per_node <= nvlink_mesh_max_gpus()) or (
        "full mesh" in gpu.interconnect)


def mesh_share(gpu: GPU, per_node: int, group: int) -> float:
    """Of its interconnect bandwidth, what one GPU reaches in a group of `group` ranks
    inside a node of `per_node`: 1 behind a switch (or over PCIe), (g - 1) / (m - 1) on a
    switchless full mesh, where only the links to the group's own peers carry its data."""
    if not _full_mesh(gpu, per_node):
        return 1.0
    if group >= per_node or per_node <= 1:
        return 1.0
    return (group - 1) / (per_node - 1)


# bytes per element of each parallel.grad_reduce_dtype that names its width
REDUCE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def reduce_width(job: Job) -> int | None:
    """Bytes per element the gradient collectives move (parallel.grad_reduce_dtype: compute,
    the compute dtype's width; else the named dtype's); None for grad, the gradients' own."""
    choice = job.parallel.grad_reduce_dtype
    if choice == "grad":
        return None
    return dtypes_for(job).compute if choice == "compute" else REDUCE_BYTES[choice]


def reduce_share(job: Job, gradient_bytes: float, trainable: int) -> float:
    """The gradient collectives' bytes over the gradients' own."""
    width = reduce_width(job)
    if width is None or not trainable or not gradient_bytes:
        return 1.0
    return width / (gradient_bytes / trainable)


def link_bytes_s(c: Collective, gpu: GPU, network: float) -> float:
    """The rate one GPU moves its share of `c` at, before the collective efficiency: inside
    a node the interconnect (a bridged pair's bridge); across nodes `network` (bytes/s per
    GPU) times the group's GPUs per node, whose NICs its rings share, at most the
    interconnect (an NVLS tree's: runs_nvls_tree); x the group's link share (placed). A host
    copy runs at the GPU's link to CPU memory."""
    if c.link == "host":
        return gpu.host_link_bytes_s
    if c.link == "interconnect":
        rate = (gpu.pair_link_bytes_s if is_bridged_pair(gpu, c.group, c.stride)
                else gpu.interconnect_bytes_s)
    else:
        rate = min(network * c.nics, gpu.interconnect_bytes_s)
        if runs_nvls_tree(c):
            inside = gpu.interconnect_bytes_s * nvls_all_reduce_speedup(architecture_of(gpu))
            rate = max(rate, min(2 * network * c.nics, inside))
    return rate * c.link_share


def runs_nvls_tree(c: Collective) -> bool:
    """An all-reduce over exactly two NVLS nodes, several of its GPUs in each: NCCL runs its
    NVLS tree. Of a double binary tree over two nodes each node roots one tree and is the
    other's leaf (src/graph/trees.cc), so each node sends the buffer across once each way,
    where a ring sends it almost twice; NCCL's tuning model gives it twice the ring's
    network rate, at most NVLS's inside the node (src/graph/tuning.cc, "2 node case of
    NVLSTree"). Over more nodes the trees carry as much as the ring, which NCCL keeps."""
    return (c.nvls and c.kind == "all-reduce" and c.link == "network" and c.nics > 1
            and c.group == 2 * c.nics)


def _block_linear_params(arch: Architecture) -> int:
    return sum(s.num_layers * ln.in_features * ln.out_features * ln.count
               for s in arch.stacks for ln in s.linears)


def collectives(job: Job, arch: Architecture, gpu: GPU, *,
                step: Step | None = None) -> list[Collective]:
    """Every collective of one step of `job` on GPUs of kind `gpu`."""
    par = job.parallel
    step = step or describe_step(job, arch)
    dt, shapes = step.activations, step.shapes
    # with a pipeline, the last stage (its blocks and the head) is the busiest
    stage = step.stages[-1]
    params = step.stage_params(stage)
    share = stage.layer_share
    tp, cp, dp = par.tensor_parallel, par.context_parallel, par.data_parallel
    stored = params.gradients / tp  # bytes of gradients per model-parallel rank
    # ... at the dtype the collectives move them in
    grads = stored * reduce_share(job, params.gradients, params.trainable)
    per_node = node_size(job, gpu)
    out: list[Collective] = []

    def link(group: int, stride: int) -> str:
        # ranks of a group sit `stride` apart; the group stays in a node if it fits there
        return "interconnect" if group * stride <= per_node else "network"

    def in_node(group: int, stride: int) -> int:
        # the group's ranks in one node: NCCL's rings cross the network through each one's NIC
        return max(1, min(group, per_node // stride))

    model_parallel = tp * cp
    pp = par.pipeline_parallel
    buckets = collective_calls()
    blocks = stage.blocks or sum(s.num_layers for s in arch.stacks)
    units = blocks + 1  # FSDP: each block and the root (embeddings, head)
    grad_phase = "backward" if par.overlap_grad_reduce else ""
    if dp > 1:
        strategy = par.strategy
        dp_link = link(dp, model_parallel)
        if strategy == "ddp":
            out.append(Collective("gradient all-reduce (ddp)", ring_bytes("all-reduce", grads, dp),
                                  "step", grad_phase, dp_link, dp,
                                  nics=in_node(dp, model_parallel), kind="all-reduce",
                                  stride=model_parallel,
                                  # DDP's buckets hold the gradients as stored
                                  calls=max(1, math.ceil(stored / buckets["ddp_bucket_bytes"]))))
        elif strategy in ("zero1", "zero2"):
            weights16 = params.trainable * dtypes_for(job).compute / tp
            calls = max(1, math.ceil(params.trainable / tp / buckets["zero_bucket_elements"]))
            out.append(Collective(f"gradient reduce-scatter ({strategy})",
                                  ring_bytes("reduce-scatter", grads, dp), "step", grad_phase,
                                  dp_link, dp, nics=in_node(dp, model_parallel),
                                  kind="reduce-scatter", calls=calls, stride=model_parallel))
            out.append(Collective(f"parameter all-gather ({strategy})",
                                  ring_bytes("all-gather", weights16, dp), "step", "", dp_link,
                                  dp, nics=in_node(dp, model_parallel), kind="all-gather",
                                  calls=calls, stride=model_parallel))
        else:  # zero3, fsdp, hybrid-shard: the whole model is gathered per micro-batch
            shard = par.shard_degree
            gathered = params.total * dtypes_for(job).compute / tp
            if job.peft is not None:
                gathered = params.weights / tp  # frozen base stays in its stored dtype
            if params.fp8_gathered_block:
                # torchao's float8 all-gather: block linears' weights travel as 1 byte
                # (engines/param_memory.py, fp8_gathered_block), the rest in 16-bit
                gathered -= share * _block_linear_params(arch) * (2 - 1) / tp
            shard_link = link(shard, model_parallel)
            # kept gathered from forward to backward (reshard_after_forward false), the
            # backward gathers nothing; under a pipeline then, nor does any later forward
            gathers = ("forward", "backward") if par.reshard_after_forward else ("forward",)
            once = "schedule" if pp > 1 else "step"  # a pipeline flushes every schedule
            for phase in gathers:
                out.append(Collective(f"parameter all-gather, {phase} ({strategy})",
                                      ring_bytes("all-gather", gathered, shard),
                                      once if par.gathers_once_per_schedule
                                      else "micro-batch",
                                      phase, shard_link, shard,
                                      nics=in_node(shard, model_parallel), kind="all-gather",
                                      calls=units, stride=model_parallel))
            # without gradient sync (fsdp_no_sync, a pipeline's schedule) only the last
            # micro-batch reduce-scatters
            out.append(Collective(f"gradient reduce-scatter ({strategy})",
                                  ring_bytes("reduce-scatter", grads, shard),
                                  once if par.defers_gradient_sync else "micro-batch",
                                  grad_phase, shard_link, shard,
                                  nics=in_node(shard, model_parallel), kind="reduce-scatter",
                                  calls=units, stride=model_parallel))
            replicas = dp // shard
            if replicas > 1:
                out.append(Collective("gradient all-reduce between replicas (hybrid)",
                                      ring_bytes("all-reduce", grads / shard, replicas), "step",
                                      grad_phase, "network", replicas,
                                      nics=in_node(replicas, shard * model_parallel),
                                      kind="all-reduce", calls=units,
                                      stride=shard * model_parallel))
    if tp > 1:
        # 2 all-reduces (or all-gather + reduce-scatter with sequence parallelism) per block
        # forward, 2 backward; full checkpointing runs the forward's 2 again in recomputation
        per_block = 4 + (2 if job.checkpointing == "full" else 0)
        activations = share * sum(per_block * s.num_layers * job.batch_size * seq * s.hidden_size
                                  * dt.compute for s, seq in zip(arch.stacks, shapes.stack_seq)
                                  ) / cp
        # with sequence parallelism each all-reduce is an all-gather and a reduce-scatter
        # (the same bytes in two calls, and no NVLS all-reduce)
        sp = par.sequence_parallel
        out.append(Collective("activation all-gathers and reduce-scatters (tensor and "
                              "sequence parallel)" if sp else
                              "activation all-reduces (tensor parallel)",
                              ring_bytes("all-reduce", activations, tp), "micro-batch",
                              "both" if par.async_tp else "", link(tp, 1), tp,
                              nics=in_node(tp, 1), kind="all-gather" if sp else "all-reduce",
                              calls=(2 if sp else 1) * per_block * blocks))
    if cp > 1:
        # each rank's k and v chunk goes round the ring (cp - 1 hops) forward; backward
        # sends k, v and their gradients: 3x the forward volume in all
        kv = share * sum(s.num_layers * 2 * job.batch_size * seq / cp * s.num_kv_heads
                         * s.head_dim * dt.compute for s, seq in zip(arch.stacks,
                                                                     shapes.stack_seq))
        out.append(Collective("k/v ring exchange (context parallel)", 3 * (cp - 1) * kv / tp,
                              "micro-batch", "both", link(cp, tp), cp, stride=tp))
    if pp > 1:
        chunks = pipeline.chunks(job)
        boundary = job.batch_size * shapes.stack_seq[-1] * arch.stacks[-1].hidden_size * (
            dt.compute) / (tp * cp)
        # point to point: one neighbour's links carry it, whatever the number of stages
        # (inside a switchless node, the links to that one peer; across nodes, its NIC)
        pp_link = link(pp, tp * cp * dp)
        out.append(Collective("activation send / gradient receive (pipeline)",
                              2 * chunks * boundary, "micro-batch", "", pp_link, pp,
                              mesh_share(gpu, per_node, 2) if pp_link == "interconnect"
                              else 1.0, stride=tp * cp * dp))
    return [placed(c, gpu, per_node) for c in out] + host_copies(job, arch, step)


def placed(c: Collective, gpu: GPU, per_node: int, *, nvls: bool | None = None) -> Collective:
    """`c` in its node's wiring (a node of `per_node` GPUs of kind `gpu`): a switchless
    mesh's share of the interconnect (a pipeline send's was set for its one peer), whether
    the node runs NVLS (`nvls`, else NCCL's default there: nvls_node), and NVLS's speedup
    of an all-reduce. (A bridged pair's link is link_bytes_s's: a rate, not a share.)"""
    share = (mesh_share(gpu, per_node, c.group)
             if c.link == "interconnect" and "pipeline" not in c.name else c.link_share)
    c = dataclasses.replace(c, nvls=nvls_node(gpu, per_node) if nvls is None else nvls)
    return dataclasses.replace(c, link_share=share * nvls_share(c, gpu))


def zero_offload(job: Job) -> bool:
    """An offloaded optimizer run by DeepSpeed's ZeRO-Offload: zero1-3 are DeepSpeed's
    stages wherever the optimizer alone is offloaded (FSDP offloads the parameters with it,
    and names its strategies fsdp / hybrid-shard, or zero2 with no offload of its own)."""
    return job.offload.optimizer and job.parallel.strategy in ("zero1", "zero2", "zero3")


def host_copies(job: Job, arch: Architecture, step: Step) -> list[Collective]:
    """The step's copies between GPU and CPU memory: offloaded parameters and gradients
    (offload.params), offloaded activations (activation_offload)."""
    par = job.parallel
    tp, shard = par.tensor_parallel, par.shard_degree
    params = step.stage_params(step.stages[-1])
    out: list[Collective] = []
    if job.offload.params:  # (kept gathered after forward: the backward uploads nothing)
        for phase in ("forward", "backward") if par.reshard_after_forward else ("forward",):
            out.append(Collective(f"host copy: parameters to the GPU, {phase} (offload.params)",
                                  params.weights / (tp * shard), "micro-batch", phase, "host",
                                  1, kind="copy"))
        out.append(Collective("host copy: gradients to the CPU (offload.params)",
                              params.gradients / (tp * shard),
                              ("schedule" if par.pipeline_parallel > 1 else "step")
                              if par.defers_gradient_sync else "micro-batch", "backward",
                              "host", 1, kind="copy"))
    if job.offload.optimizer and not job.offload.params:
        if zero_offload(job):
            out.append(Collective("host copy: gradients to the CPU in fp32 (ZeRO-Offload)",
                                  4 * params.trainable / (tp * shard), "step", "backward",
                                  "host", 1, kind="copy"))
        else:
            out.append(Collective("host copy: gradients to the CPU (optimizer offload)",
                                  params.gradients / (tp * shard), "micro-batch", "backward",
                                  "host", 1, kind="copy"))
    if job.activation_offload:
        moved = offloaded_bytes(job, arch, step.shapes, step.activations) / (
            tp * par.context_parallel)
        out.append(Collective("host copy: activations to the CPU (activation_offload)", moved,
                              "micro-batch", "forward", "host", 1, kind="copy"))
        out.append(Collective("host copy: activations back to the GPU (activation_offload)",
                              moved, "micro-batch", "backward", "host", 1, kind="copy"))
    return out
