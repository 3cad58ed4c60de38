"""What torch.compile changes in memory: the tensors a step saves for backward, eager versus
compiled (issue 10, section 2).

AOTAutograd traces forward and backward into one graph and its partitioner decides which
intermediate tensors the backward keeps and which it recomputes (the min-cut partitioner
recomputes cheap elementwise chains such as norms and activations from their inputs).
`saved_for_backward` runs one forward on real (CPU) tensors and records, through
saved-tensor hooks, every distinct storage autograd keeps, parameters left out.

`COMPILED_BACKEND` is AOTAutograd with Inductor's decompositions and the min-cut
partitioner, without Inductor's code generation: the saved set is the one Inductor's
partitioner chooses; what it approximates is Inductor's buffer reuse and fusion inside the
forward and backward kernels (transient memory), which it does not model. The trace engine
does not run compiled steps yet (a Job with compile=True is refused there); this module is
what it will build on.

    >>> eager, compiled = compare_saved(model, lambda m: m(input_ids=ids, labels=ids).loss)
    >>> compiled.bytes < eager.bytes
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

COMPILED_BACKEND = "aot_eager_decomp_partition"


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
                  backend: str = COMPILED_BACKEND) -> tuple[SavedTensors, SavedTensors]:
    """(eager, compiled) saved tensors of one forward of `step` on `model`."""
    eager = saved_for_backward(step, model)
    torch._dynamo.reset()  # a fresh compile: no graph cached from another model or shape
    compiled = saved_for_backward(step, torch.compile(model, backend=backend))
    return eager, compiled
