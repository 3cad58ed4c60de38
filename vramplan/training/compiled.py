"""torch.compile in the training step (issue 10, section 2): what compiling changes in memory.

Compiling changes two things. AOTAutograd traces forward and backward into one graph and
its min-cut partitioner decides which intermediate tensors the backward keeps and which it
recomputes (cheap elementwise chains such as norms and activations are recomputed from
their inputs). Inductor then fuses chains of elementwise ops into one kernel, so their
intermediate results never exist in memory.

`apply_compile` compiles what torchtitan and torchtune compile: each transformer block and
the loss. The backend depends on where the step runs:
  - trace (fake tensors): `trace_backend()`, AOTAutograd with Inductor's decompositions and
    partitioner (the saved set is the one Inductor would get), whose graphs run node by
    node; a node Inductor would fuse into its consumers (`fused_nodes`) runs inside
    `placed(FUSED)`, and the trace does not count what it allocates. What this
    approximates: Inductor's exact fusion choices (it may also materialise a chain with
    many readers), its reuse of a dead buffer for a new one of the same size, and memory
    its generated kernels allocate inside themselves;
  - measure: Inductor itself (`"inductor"`), on the GPU or the CPU.

`saved_for_backward` and `compare_saved` record what one forward saves for backward,
eager versus compiled, on real CPU tensors (tests/training/test_compiled.py).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import fx, nn

from vramplan.errors import EngineError
from vramplan.job import Job
from vramplan.training import losses
from vramplan.training.placement import FUSED, placed

# ops Inductor generates into its own loops (and so can fuse), besides those tagged
# pointwise: casts, copies, constants, indexing loads, concatenation, padding
_INLINED = {"_to_copy", "clone", "copy", "full", "full_like", "scalar_tensor", "zeros",
            "zeros_like", "ones", "ones_like", "cat", "gather",
            "index", "embedding", "where", "constant_pad_nd", "iota", "arange",
            "convert_element_type", "lift_fresh_copy", "fill"}
# ops that write into a copy of their first input: Inductor fuses the producer of that
# input into them, and rewrites a scatter into a constant (nll_loss's backward) as a
# pointwise op (fx_passes/post_grad.py, scatter_upon_const_tensor)
_SCATTERS = {"scatter", "scatter_add", "index_put", "select_scatter", "slice_scatter"}
# ops that only change how memory is viewed: a consumer reads through them
_VIEWS = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze",
          "squeeze", "expand", "alias", "slice", "select", "split", "split_with_sizes",
          "unbind", "as_strided", "chunk", "narrow", "getitem"}

def _name(node: fx.Node) -> str:
    target = node.target
    if target is getattr:
        return "getattr"
    if getattr(target, "__name__", "") == "getitem":
        return "getitem"
    packet = getattr(target, "_opname", None) or getattr(target, "__name__", "")
    return str(packet).split(".")[0]


def _kind(node: fx.Node) -> str:
    """'inline' (Inductor writes it into a fused loop), 'reduction' (a loop that can read
    inline producers), 'view', or 'kernel' (an extern kernel such as a matmul, attention
    or a fallback op: its inputs must exist in memory)."""
    if node.op != "call_function":
        return "kernel"
    name = _name(node)
    tags = getattr(node.target, "tags", ())
    if name in _VIEWS:
        return "view"
    if torch.Tag.reduction in tags:
        return "reduction"
    if torch.Tag.pointwise in tags or name in _INLINED:
        return "inline"
    if name in _SCATTERS:
        into = node.args[0] if node.args else None
        constant = isinstance(into, fx.Node) and _name(into) in ("full", "zeros")
        return "inline" if constant and name == "scatter" else "scatter"
    return "kernel"


def fused_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of an AOTAutograd graph whose result Inductor would not write to memory: an
    inlinable op whose every reader (through views) is an inlinable op or a reduction,
    and which is not a graph output (outputs include the tensors saved for backward)."""
    outputs: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            fx.node.map_arg(node.args, outputs.add)

    def readers(node: fx.Node) -> Iterator[fx.Node]:
        for user in node.users:
            if _kind(user) == "view" and user not in outputs:
                yield from readers(user)
            else:
                yield user

    fused = set()
    for node in graph.nodes:
        if node.op == "call_function" and _kind(node) == "inline" and node not in outputs:
            users = list(readers(node))
            if users and all(_kind(u) in ("inline", "reduction") or (
                    _kind(u) == "scatter" and u.args[0] is node) for u in users):
                fused.add(node)
    return fused


class _FusingInterpreter(fx.Interpreter):
    """Runs a graph node by node, fused nodes inside placed(FUSED). A fused node (or a
    view) stands for code inside the kernel of the node that reads it, so what it reads
    stays alive until that kernel has run: values are freed after their last use by a
    written node."""

    def __init__(self, module: fx.GraphModule, fused: set[fx.Node]):
        super().__init__(module)
        self.fused = fused
        order = {node: i for i, node in enumerate(module.graph.nodes)}

        def kernels_reading(node: fx.Node) -> Iterator[fx.Node]:
            for user in node.users:
                if user in fused or _kind(user) == "view":
                    yield from kernels_reading(user)
                else:
                    yield user

        self.user_to_last_uses = {}
        for node in module.graph.nodes:
            readers = list(kernels_reading(node))
            if readers:
                last = max(readers, key=order.__getitem__)
                self.user_to_last_uses.setdefault(last, []).append(node)

    def run_node(self, n: fx.Node):
        if n in self.fused:
            with placed(FUSED):
                return super().run_node(n)
        return super().run_node(n)


def _fusing_compiler(gm: fx.GraphModule, example_inputs) -> Callable:
    fused = fused_nodes(gm.graph)

    def run(args: list) -> object:
        return _FusingInterpreter(gm, fused).boxed_run(args)

    run._boxed_call = True  # AOTAutograd passes a list it may empty: inputs freed early
    return run


@functools.cache
def trace_backend() -> Callable:
    """AOTAutograd with Inductor's decompositions and partitioner; graphs run node by node
    with Inductor's fusion modelled (fused_nodes)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    return aot_autograd(
        fw_compiler=_fusing_compiler, bw_compiler=_fusing_compiler,
        decompositions=select_decomp_table(),
        partition_fn=functools.partial(min_cut_rematerialization_partition,
                                       compiler="inductor"))


def compile_blocks(model: nn.Module, backend) -> int:
    """Compile each transformer block's forward (torchtitan's and torchtune's per-block
    compile); the block's own call, and so checkpointing around it, stays eager. Returns
    the number of blocks compiled."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    # blocks of a few kinds (dense and MoE, sliding and global attention) each compile
    # once; past the limit Dynamo would run the rest eagerly without saying so
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for block in blocks:
        block.forward = torch.compile(_class_forward(block), backend=backend, dynamic=False)
    return len(blocks)


def _class_forward(block: nn.Module) -> Callable:
    """The block's forward as its class has it when called, not when compiled: FSDP2's
    fully_shard (after compile, as torchtitan orders them) swaps in an FSDP<Block> subclass,
    and transformers checkpoints only in the outermost class's forward wrapper
    (GradientCheckpointingLayer.__init_subclass__, `is_outermost`). A forward bound before
    the swap would run without checkpointing."""

    def forward(*args, **kwargs):
        return type(block).forward(block, *args, **kwargs)

    return forward


def compile_loss(model: nn.Module, backend) -> bool:
    """Compile a Hugging Face model's loss function (logits upcast and cross-entropy), as
    torchtune's compile_loss and torchtitan's loss compile do. False if it has none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(type(base), "loss_function"):
        return False
    base.loss_function = torch.compile(base.loss_function, backend=backend, dynamic=False)
    return True


def compile_chunked_loss(compute_loss: Callable, job: Job, backend) -> Callable | None:
    """torchtune's chunked losses with their per-chunk function compiled
    (apply_compile_strategy in torchtune/modules/loss/cross_entropy_loss.py and
    ce_chunked_output_loss.py, bd2a0fc7): the projection and cross-entropy of a chunk, or
    the cross-entropy of a returned logits chunk. None for the other losses."""
    score = {"chunked:torchtune-linear": losses.project_and_score,
             "chunked:torchtune-output": losses._chunk_ce}.get(job.loss)
    if score is None:
        return None
    return functools.partial(compute_loss, score=torch.compile(score, backend=backend,
                                                               dynamic=False))


def apply_compile(model: nn.Module, job: Job, backend, notes: list[str],
                  compute_loss: Callable) -> Callable:
    """Compile the job's blocks and loss, as job.compile_components says (torchtitan's
    compile.components); returns the loss function to use."""
    torch._dynamo.reset()  # no graph cached from another job's model or shapes
    # and the garbage it leaves collected now: without this, the first compiled trace in a
    # process freed Llama's position ids (seq_len x 8 bytes) at their last use and every
    # later one only after the step (seen in run_trace's events; with the collector off
    # all free early), so the CLI and the web server's worker disagreed by those bytes
    gc.collect()
    blocks = compile_blocks(model, backend) if job.compiles_blocks else 0
    if job.compiles_blocks and not blocks:
        raise EngineError(f"compile: vramplan compiles each transformer block (a "
                          f"transformers GradientCheckpointingLayer) and "
                          f"{type(model).__name__} has none: drop compile (the eager step's "
                          "memory is an upper bound)")
    chunked = compile_chunked_loss(compute_loss, job, backend) if job.compiles_loss else None
    loss = chunked is not None or (job.compiles_loss and job.loss == "standard"
                                   and compile_loss(model, backend))
    how = ("Inductor" if backend == "inductor" else "the partitioner's saved tensors, "
           "Inductor's elementwise fusion modelled")
    parts = [f"{blocks} blocks"] if blocks else []
    if loss:
        parts.append("the loss")
    eager = "" if loss else (f" (the {job.loss} loss runs eagerly)" if job.compiles_loss
                             else " (the loss runs eagerly)")
    notes.append(f"torch.compile: {' and '.join(parts) or 'nothing'} compiled{eager} "
                 f"({how})")
    return chunked or compute_loss


@dataclass(frozen=True)
class SavedTensors:
    """Distinct storages autograd keeps for backward after one forward."""

    bytes: int
    count: int
    shapes: tuple[tuple[int, ...], ...]  # one per storage, the first tensor seen on it


def saved_for_backward(step: Callable[[nn.Module], torch.Tensor], model: nn.Module) -> SavedTensors:
    """Run `step(model)` (a forward that returns the loss) and record what it saves."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, tuple[int, ...]]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen[key] = (storage.nbytes(), tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = step(model)
    del loss  # the graph (and what it saved) goes with it
    return SavedTensors(sum(n for n, _ in seen.values()), len(seen),
                        tuple(shape for _, shape in seen.values()))


def compare_saved(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], *,
                  backend: str | Callable = "aot_eager_decomp_partition",
                  ) -> tuple[SavedTensors, SavedTensors]:
    """(eager, compiled) saved tensors of one forward of `step` on `model`."""
    eager = saved_for_backward(step, model)
    torch._dynamo.reset()  # a fresh compile: no graph cached from another model or shape
    compiled = saved_for_backward(step, torch.compile(model, backend=backend))
    return eager, compiled
