"""Every private torch / transformers API the trace and its CPU stand-ins rely on, in one
place, with the versions they were tested on. An upgrade that moves one fails here, at
import, with a message that names it, instead of deep inside a trace.

    torch._subclasses.fake_tensor     FakeTensorMode and its exceptions, is_fake
    torch.utils._python_dispatch      TorchDispatchMode, is_traceable_wrapper_subclass,
                                      _disable_current_modes
    torch.utils._pytree               tree_leaves
    torch._C                          DispatchKeySet, DispatchKey.AutocastCPU,
                                      _ExcludeDispatchKeyGuard (CUDA's autocast lists on CPU)
    torch.library.Library._destroy    removes our AutocastCPU kernels again
    torch.testing._internal.distributed.fake_pg.FakeStore   the fake process group
    torch.distributed.fsdp._fully_shard._fsdp_param(.alloc_storage, .free_storage),
        _fsdp_param_group.alloc_storage                      FSDP2's all-gather buffers
    FSDPModule._get_fsdp_state()._fsdp_param_group.fsdp_params[i].unsharded_accumulated_grad
                                      the whole gradients held without gradient sync
    transformers.masking_utils.find_packed_sequence_indices  (see patches.py)
"""

from __future__ import annotations

from vramplan.errors import EngineError

# The versions CI runs (requirements-dev.txt); the GPU runs used torch 2.11.
TESTED_VERSIONS = {"torch": ("2.11.0", "2.13.0"), "transformers": ("5.24.0",),
                   "peft": ("0.21.2",)}


def _missing(what: str, error: Exception) -> EngineError:
    import torch

    return EngineError(
        f"this torch ({torch.__version__}) has no {what} ({error}); the trace relies on it and "
        f"was tested with torch {', '.join(TESTED_VERSIONS['torch'])}: install one of those, "
        "or use --engine formula")


try:
    import torch
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
        UnsupportedOperatorException,
        is_fake,
    )
    from torch.utils._python_dispatch import (
        TorchDispatchMode,
        _disable_current_modes,
        is_traceable_wrapper_subclass,
    )
    from torch.utils._pytree import tree_leaves

    AUTOCAST_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    ExcludeDispatchKeyGuard = torch._C._ExcludeDispatchKeyGuard
except (ImportError, AttributeError) as _error:  # pragma: no cover - only on an upgrade
    raise _missing("fake-tensor / dispatch internals", _error) from None


def destroy_library(lib: torch.library.Library) -> None:
    """Remove the kernels a Library registered (torch has no public way)."""
    lib._destroy()


def fake_store():
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as error:  # pragma: no cover
        raise _missing("fake process group (torch.testing._internal...fake_pg)", error) from None
    return FakeStore()


def fsdp_storage_modules():
    """FSDP2's modules whose alloc_storage / free_storage the trace wraps."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
        _fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage  # noqa: B018
    except (ImportError, AttributeError) as error:  # pragma: no cover
        raise _missing("FSDP2 storage hooks (_fsdp_param.alloc_storage)", error) from None
    return _fsdp_param, _fsdp_param_group


def fsdp_accumulated_grads(model) -> list:
    """The whole gradients FSDP2 holds without gradient sync (set_requires_gradient_sync
    False: FSDPParam.unsharded_accumulated_grad, its fp32 reduce-dtype copy)."""
    out = []
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        group = state_of()._fsdp_param_group if state_of is not None else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if grad is not None:
                out.append(grad)
    return out


def transformers_masking():
    """transformers.masking_utils, or None when this transformers has no packed-sequence
    detection to switch off."""
    try:
        import transformers.masking_utils as masking
    except ImportError:
        return None
    return masking if hasattr(masking, "find_packed_sequence_indices") else None


__all__ = [
    "AUTOCAST_CPU_KEYS", "DataDependentOutputException", "DynamicOutputShapeException",
    "ExcludeDispatchKeyGuard", "FakeTensorMode", "TESTED_VERSIONS", "TorchDispatchMode",
    "UnsupportedOperatorException", "_disable_current_modes", "destroy_library", "fake_store",
    "fsdp_accumulated_grads", "fsdp_storage_modules", "is_fake", "is_traceable_wrapper_subclass",
    "transformers_masking", "tree_leaves",
]
