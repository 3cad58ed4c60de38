"""User factories: "package.module:function" returning a model (and its inputs)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramplan.errors import EngineError, ModelConfigError
from vramplan.job import Job
from vramplan.training.losses import generic_loss
from vramplan.training.tensors import model_dtype, replace_tensors


def is_factory_ref(ref: str) -> bool:
    module, sep, attr = ref.partition(":")
    return bool(sep) and bool(attr) and "/" not in module and "\\" not in module \
        and not Path(ref).exists()


def from_factory(job: Job, device: torch.device, notes: list[str]):
    """Call a user factory. It returns an nn.Module, (module, batch_fn), or a dict with
    'model' and optionally 'batch' (callable(batch_size, device)), 'input_shapes'
    ({name: per-sample shape} or one shape) and 'loss' (callable(output, batch))."""
    module_name, _, attr = job.model.partition(":")
    try:
        factory: Any = _import_from_working_directory(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except SystemExit as stop:  # sys.exit() in the user's module would end vramplan silently
        raise ModelConfigError(f"importing factory module {module_name!r} called "
                               f"sys.exit({stop.code!r}); a factory module must not exit") from None
    except Exception as error:  # any import-time failure of the user's module
        raise ModelConfigError(f"cannot load factory {job.model!r}: {type(error).__name__}: "
                               f"{error}") from None
    try:
        if isinstance(factory, nn.Module):  # `pkg.mod:model`, a module object, not a factory
            result = factory
        else:
            wants_job = len(inspect.signature(factory).parameters) > 0
            result = factory(job) if wants_job else factory()
    except SystemExit as stop:
        raise ModelConfigError(f"factory {job.model!r} called sys.exit({stop.code!r}); return "
                               "a model instead of exiting") from None
    except Exception as error:
        raise ModelConfigError(f"factory {job.model!r} raised {type(error).__name__}: "
                               f"{error}") from None
    batch_fn, shapes, loss_fn = None, None, None
    if isinstance(result, tuple) and len(result) == 2:
        result, batch_fn = result
    elif isinstance(result, dict):
        batch_fn, shapes, loss_fn = result.get("batch"), result.get("input_shapes"), \
            result.get("loss")
        result = result.get("model")
    if not isinstance(result, nn.Module):
        raise ModelConfigError(f"factory {job.model!r} returned {type(result).__name__}, not a "
                               "torch.nn.Module (return a module, (module, batch_fn) or "
                               "{'model': module, 'input_shapes': ...})")
    model = result
    floats = None if model_dtype(job) == torch.float32 else model_dtype(job)
    replace_tensors(model, lambda t: t.to(device, floats if t.is_floating_point() else None))
    if job.peft is not None:
        raise EngineError("peft on a factory model is not supported yet: apply LoRA inside "
                          "the factory")
    if job.checkpointing != "none":
        notes.append("checkpointing is applied to Hugging Face models only: a factory model "
                     "has to checkpoint itself")
    floats = model_dtype(job)
    if batch_fn is None and shapes is None:  # a bare module: inputs from its first layer
        batch_fn = _inputs_of_first_layer(model, job, floats, notes)
    if batch_fn is not None:
        make_batch = lambda: batch_fn(job.batch_size, device)  # noqa: E731
    elif isinstance(shapes, dict):
        make_batch = lambda: {k: torch.randn(job.batch_size, *s, dtype=floats,  # noqa: E731
                                             device=device) for k, s in shapes.items()}
    else:
        make_batch = lambda: torch.randn(job.batch_size, *shapes, dtype=floats,  # noqa: E731
                                         device=device)
    return model, make_batch, lambda m, batch: generic_loss(m, batch, loss_fn)


def _import_from_working_directory(module_name: str):
    """Import as `python -m` would: the working directory first on the path (the `vramplan`
    script's own folder is there instead, so `my_pkg.models:build` would not be found)."""
    import sys

    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _inputs_of_first_layer(model: nn.Module, job: Job, floats: torch.dtype, notes: list[str]):
    """batch_fn for a factory that returned a bare nn.Module: random inputs shaped for its
    first Linear (batch x in_features), Embedding (batch x seq_len token ids) or Conv2d
    (batch x channels x image_size^2); otherwise ask for inputs."""
    first = next((m for m in model.modules()
                  if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d))), None)
    seq, side = job.seq_len or 512, job.image_size or 224
    if isinstance(first, nn.Embedding):
        shape, what = (seq,), f"{seq} token ids (seq_len)"
        def make(b, device):
            return torch.randint(0, first.num_embeddings, (b, *shape), device=device)
    elif first is not None:
        shape = ((first.in_features,) if isinstance(first, nn.Linear) else
                 (first.in_channels, seq) if isinstance(first, nn.Conv1d) else
                 (first.in_channels, side, side))
        what = f"shape {tuple(shape)}"
        def make(b, device):
            return torch.randn(b, *shape, dtype=floats, device=device)
    else:
        raise ModelConfigError(f"factory {job.model!r} returned a module whose inputs cannot "
                               "be guessed (no Linear, Embedding or Conv first layer): return "
                               "(module, batch_fn) or {'model': module, 'input_shapes': {...}}")
    notes.append(f"factory returned a bare module: inputs guessed from its first layer "
                 f"({type(first).__name__}): {what} per sample; return (module, batch_fn) "
                 "to give the real ones")
    return make
