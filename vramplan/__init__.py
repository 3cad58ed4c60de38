"""vramplan: how much GPU memory a training job needs, and where it fits.

    >>> import vramplan
    >>> report = vramplan.estimate(vramplan.Job(model="llama-3.2-1b", batch_size=4))
    >>> report.peak_allocated  # bytes per GPU

Importing vramplan never imports torch: the formula engine answers instantly; trace,
measure and track import it when called. The names below load on first use (PEP 562), so
that the command's entry point (cli/entry.py) is running within milliseconds and a Ctrl-C
while the libraries load gets its one line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from vramplan import hooks
from vramplan._version import __version__

if TYPE_CHECKING:
    from vramplan.api import estimate, measure, plan, run_engine, trace
    from vramplan.engines.memory_report import CATEGORIES, GpuFit, MemoryReport
    from vramplan.errors import (
        EngineError,
        JobError,
        JobFileError,
        ModelConfigError,
        UnknownNameError,
        VramplanError,
    )
    from vramplan.integrations.preflight import preflight
    from vramplan.job import Float8, Job, Offload, Parallel, Peft, Runtime
    from vramplan.models.arch import Architecture
    from vramplan.planning.results import Performance
    from vramplan.search import max_batch_size, max_seq_len, sweep
    from vramplan.tracking import track

_HOME = {  # public name -> the module that defines it
    **dict.fromkeys(("estimate", "measure", "plan", "run_engine", "trace"), "vramplan.api"),
    **dict.fromkeys(("CATEGORIES", "GpuFit", "MemoryReport"), "vramplan.engines.memory_report"),
    "Performance": "vramplan.planning.results",
    **dict.fromkeys(("EngineError", "JobError", "JobFileError", "ModelConfigError",
                     "UnknownNameError", "VramplanError"), "vramplan.errors"),
    "preflight": "vramplan.integrations.preflight",
    **dict.fromkeys(("Float8", "Job", "Offload", "Parallel", "Peft", "Runtime"),
                    "vramplan.job"),
    **dict.fromkeys(("max_batch_size", "max_seq_len", "sweep"), "vramplan.search"),
    "track": "vramplan.tracking",
}

__all__ = [
    "CATEGORIES", "EngineError", "Float8", "GpuFit", "Job", "JobError", "JobFileError",
    "MemoryReport", "ModelConfigError", "Offload", "Parallel", "Peft", "Performance", "Runtime",
    "UnknownNameError", "VramplanError", "__version__", "estimate", "max_batch_size", "max_seq_len",
    "measure", "plan", "preflight", "run_engine", "sweep", "trace", "track",
]


def _read_built_model(config: dict, name: str, source: str) -> Architecture:
    """The shapes of a model type derive.py has no builder for, from the model transformers
    builds on the meta device; torch is imported here, on first use only."""
    from vramplan.training.meta_architecture import architecture_from_built_model
    return architecture_from_built_model(config, name, source)


# the root wires the torch side's reader into models/, which never imports training itself
hooks.built_model_reader = _read_built_model


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'vramplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
