"""What autograd saves for backward, in bytes: the activations of a real step.

measure splits its peak into activations (tensors saved for backward) and temporaries
(everything else the step allocates) with this recorder; the trace classifies every
storage itself. The pack hook keeps a detached view (same storage, no grad_fn), which is
what autograd keeps for a saved tensor anyway, so the step's memory is unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


class SavedTensorBytes:
    """Distinct storages saved during one forward, less the excluded ones (parameters,
    the batch): `snapshot()` at the start of backward fixes the figure for the step.

    Storages are told apart by address. The parameters keep theirs for the whole run; a
    batch's tensors are freed after their step, and the allocator hands their addresses to
    the next step's tensors, so the batch is excluded for one forward only."""

    def __init__(self, excluded: Iterable[torch.Tensor] = ()):
        self.excluded = {_key(t) for t in excluded}  # for the whole run
        self._batch: set[int] = set()  # for the current forward
        self._sizes: dict[int, int] = {}
        self.last_forward_bytes = 0  # saved bytes when the last recorded backward began
        self._paused = False

    def stop_at(self, head: torch.nn.Module) -> None:
        """Stop recording when `head` (the output layer) runs: what the head and the loss
        save (logits, log-probabilities) are loss buffers, counted as temporary."""
        head.register_forward_pre_hook(lambda module, args: setattr(self, "_paused", True))

    def exclude_batch(self, tensors: Iterable[torch.Tensor]) -> None:
        """Leave out this forward's batch (counted as inputs)."""
        self._batch |= {_key(t) for t in tensors if isinstance(t, torch.Tensor)}

    def reset(self) -> None:
        self._sizes.clear()
        self._batch.clear()
        self._paused = False

    def snapshot(self) -> None:
        self.last_forward_bytes = sum(size for key, size in self._sizes.items()
                                      if key not in self.excluded and key not in self._batch)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = _storage(tensor)
        if storage is not None and storage.device.type != "meta" and not self._paused:
            self._sizes[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved):
            yield


def _storage(tensor: torch.Tensor):
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor shard
    try:
        return local.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
        return None


def _key(tensor: torch.Tensor) -> int:
    storage = _storage(tensor)
    return storage.data_ptr() if storage is not None else -1
