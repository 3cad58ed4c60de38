"""The Engine protocol and the one registry every face takes engines from.

An engine turns a Job into a MemoryReport. The CLI, search, the planner and the web app
ask the registry for an engine by name and never special-case one: what differs between
engines (whether torch is needed, which options they take) is declared here.

    >>> from vramplan.engines.registry import get_engine
    >>> report = get_engine("formula").run(job)
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from vramplan.engines.memory_report import MemoryReport
from vramplan.errors import UnknownNameError
from vramplan.job import Job


@runtime_checkable
class Engine(Protocol):
    """What an engine is: a name, whether it needs torch, and run(job) -> MemoryReport."""

    name: str
    needs_torch: bool
    options: frozenset[str]  # keyword options run() accepts
    description: str

    def run(self, job: Job, **options: Any) -> MemoryReport: ...


@dataclass(frozen=True)
class LazyEngine:
    """An engine whose code is imported on first use (trace and measure import torch)."""

    name: str
    needs_torch: bool
    module: str
    function: str
    options: frozenset[str]
    description: str

    def run(self, job: Job, **options: Any) -> MemoryReport:
        unknown = set(options) - self.options
        if unknown:
            raise TypeError(f"engine {self.name!r} takes no option(s) {sorted(unknown)}")
        if job.parallel.pipeline_parallel > 1 and self.name != "formula":
            from vramplan.errors import EngineError
            raise EngineError(f"the {self.name} engine does not run pipeline parallelism yet: "
                              "use --engine formula")
        if self.needs_torch:
            require_torch(f"the {self.name} engine")
        if self.name != "formula":  # the formula runs the same checks on its Architecture
            from vramplan.engines.checks import check_job_for_engine
            check_job_for_engine(job, options.get("model_config"))
        return getattr(importlib.import_module(self.module), self.function)(job, **options)

    def accepted(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The subset of `options` this engine takes (callers offer every option they have)."""
        return {k: v for k, v in options.items() if k in self.options and v is not None}


_ENGINES: dict[str, Engine] = {}


def require_torch(what: str) -> None:
    """One line naming the extra when torch, transformers or peft is not installed (the
    formula's install has none of them), in place of a ModuleNotFoundError traceback."""
    import importlib.util

    missing = [m for m in ("torch", "transformers", "peft") if importlib.util.find_spec(m) is None]
    if missing:
        from vramplan.errors import EngineError
        raise EngineError(f"{what} builds the real model and needs {', '.join(missing)}, "
                          "which this install lacks: pip install 'vramplan[torch]' (in this "
                          "repository: make setup), or use --engine formula")


def register_engine(engine: Engine) -> None:
    """Add (or replace) an engine; the CLI's --engine choices come from here."""
    _ENGINES[engine.name] = engine


def get_engine(name: str) -> Engine:
    try:
        return _ENGINES[name]
    except KeyError:
        raise UnknownNameError("engine", name, _ENGINES) from None


def engine_names() -> tuple[str, ...]:
    return tuple(_ENGINES)


def run_engine(job: Job, engine: str = "formula", **options: Any) -> MemoryReport:
    """Run `job` through the named engine, passing only the options that engine takes."""
    chosen = get_engine(engine)
    accepted = getattr(chosen, "accepted", None)
    return chosen.run(job, **(accepted(options) if accepted else options))


register_engine(LazyEngine(
    "formula", False, "vramplan.engines.formula", "estimate", frozenset({"gpus", "model_config"}),
    "closed form from the architecture: instant, any size, no torch"))
register_engine(LazyEngine(
    "trace", True, "vramplan.engines.trace", "trace", frozenset({"time_limit_s", "model_config"}),
    "the real training step on fake tensors: exact, no GPU"))
register_engine(LazyEngine(
    "measure", True, "vramplan.engines.measure", "measure",
    frozenset({"steps", "warmup", "emulate_gpu", "budget_bytes", "device", "model_config"}),
    "real steps on this machine's device (CUDA, else CPU)"))
