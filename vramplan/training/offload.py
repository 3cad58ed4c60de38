"""CPU offload in the trace's step: activations as torchtune offloads them, and the
optimizer step on the host. Host memory is made under training/placement.py's HOST marker,
so the trace counts it apart from the GPU.

Activation offload follows torchtune's OffloadActivations with its defaults
(torchtune/training/_activation_offloading.py, pytorch/torchtune bd2a0fc7, 2026-04-23;
docs/frameworks.md "Activation offloading"):
* a saved_tensors_hooks pair; the pack hook offloads a saved tensor when it is on the GPU,
  at least min_offload_size = 1024 bytes (element size x elements: a view counts its own
  elements) and not an nn.Parameter or buffer (a view of a weight, `weight.t()` saved by a
  matmul, is neither, so it is copied too);
* use_streams=True: an offloaded tensor stays referenced in a forward stash until
  max_fwd_stash_size = 5 later saved tensors (offloaded or not: the ids count every pack)
  have been packed; what is left in the stash when the forward ends stays on the GPU until
  the first backward node that unpacks an offloaded tensor has run;
* in backward, a tensor still in the forward stash is used as is; any other is copied back
  to a new GPU tensor, kept until the next autograd node that unpacks an offloaded tensor
  has run (or backward ends), and its host copy is dropped on unpack;
* the output head runs under NoOpManager and the loss outside the context: here offloading
  stops when the decoder's forward returns or the output head starts, whichever is first.
Under activation checkpointing the hooks see what checkpoint saves outside its own hooks:
the checkpointed blocks' inputs (torch.utils.checkpoint save_inputs). Tensors that
selective checkpointing keeps are held in its own cache, never packed: they stay on the
GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vramplan.training.placement import HOST, placed

MIN_OFFLOAD_BYTES = 1024   # OffloadActivations(min_offload_size=1024)
MAX_FWD_STASH = 5          # OffloadActivations(max_fwd_stash_size=5)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """torchtune's hooks (streams on), with host copies made under the HOST marker: the
    same references kept and dropped at the same points, so the same GPU memory."""

    def __init__(self, device: torch.device):
        self.device = device
        self.saved: dict[int, tuple[torch.Tensor, bool]] = {}  # id -> (tensor, offloaded)
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_stash: dict[int, torch.Tensor] = {}
        self.next_id = 0
        self.first_backward_call = True
        self.graph_id: int | None = None
        self.node = None
        super().__init__(self._pack, self._unpack)

    def new_forward(self) -> None:
        self.saved.clear()  # torchtune asserts backward emptied it
        self.first_backward_call = True

    def _offloads(self, t: torch.Tensor) -> bool:
        buffer = getattr(nn, "Buffer", None)
        return (t.device == self.device and t.element_size() * t.nelement() >= MIN_OFFLOAD_BYTES
                and not isinstance(t, nn.Parameter)
                and not (buffer is not None and isinstance(t, buffer)))

    def _pack(self, t: torch.Tensor) -> int:
        self.next_id += 1
        tid = self.next_id
        if not self._offloads(t):
            self.saved[tid] = (t, False)
            return tid
        for old in list(self.fwd_stash):  # copies issued 5 packs ago are done: drop them
            if old > tid - MAX_FWD_STASH:
                break
            del self.fwd_stash[old]
        with placed(HOST):
            host = torch.empty_like(t, device="cpu")
            host.copy_(t)
        self.saved[tid] = (host, True)
        self.fwd_stash[tid] = t
        return tid

    def _unpack(self, tid: int) -> torch.Tensor:
        if self.first_backward_call:
            self.first_backward_call = False
            self.graph_id = torch._C._current_graph_task_id()
            torch.autograd.Variable._execution_engine.queue_callback(self.bwd_stash.clear)
        t, offloaded = self.saved.pop(tid)
        if not offloaded:
            return t
        node = torch._C._current_autograd_node()
        previous: list[int] = []
        if torch._C._current_graph_task_id() == self.graph_id and node != self.node:
            self.node = node
            previous = list(self.bwd_stash)
        uses = 0
        if tid in self.fwd_stash:
            t, brought_back = self.fwd_stash[tid], False
        else:
            gpu = torch.empty_like(t, device=self.device)
            gpu.copy_(t)
            t, brought_back = gpu, True
            self.bwd_stash[tid] = gpu
            uses = _storage_uses(gpu)

        def after_node(outputs, inputs):
            # torchtune: when something else now holds the storage (a view in the node's
            # outputs, a tensor a checkpoint recomputed), record_stream and drop the stash's
            # reference at once; else keep it until the next such node has run
            if brought_back and tid in self.bwd_stash \
                    and _storage_uses(self.bwd_stash[tid]) > uses:
                del self.bwd_stash[tid]
            self.fwd_stash.clear()  # in backward now: the forward stash goes
            for old in previous:
                self.bwd_stash.pop(old, None)
            return outputs

        if node is not None:
            node.register_hook(after_node)
        return t


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def offloading_loss(compute_loss: Callable[[nn.Module, Any], torch.Tensor], model: nn.Module,
                    device: torch.device) -> Callable[[nn.Module, Any], torch.Tensor]:
    """compute_loss with torchtune's activation offloading around the model's trunk."""
    hooks = OffloadActivations(device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    state = {"on": False}

    def stop(*_args) -> None:  # NoOpManager for the head; the loss is outside the context
        if state["on"]:
            state["on"] = False
            hooks.__exit__()

    decoder, head = _decoder(base), _head(base)
    if decoder is not None:
        decoder.register_forward_hook(stop, always_call=True)
    if head is not None:
        head.register_forward_pre_hook(stop)

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        hooks.new_forward()
        hooks.__enter__()
        state["on"] = True
        try:
            return compute_loss(model, batch)
        finally:
            stop()

    return loss


def _decoder(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_decoder", None)
    with contextlib.suppress(Exception):
        decoder = getter() if callable(getter) else None
        if isinstance(decoder, nn.Module) and decoder is not model:
            return decoder
    return None


def _head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, nn.Module) else None


class HostStepOptimizer(torch.optim.Optimizer):
    """The optimizer step on the CPU (DeepSpeed ZeRO-Offload's CPU Adam, FSDP's
    CPUOffload): the states it makes and the step's temporaries are host memory; the
    updated values land in the GPU's parameters in place, so the GPU holds weights and
    gradients only."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.state = inner.state

    @torch.no_grad()
    def step(self, closure=None):
        with placed(HOST):
            return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
