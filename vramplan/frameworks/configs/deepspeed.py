"""DeepSpeed config JSON: ZeRO stage, CPU offload, bf16/fp16, micro-batch and accumulation
(deepspeed.toml). Other formats that name a DeepSpeed file read it through `include`."""

from __future__ import annotations

import json
from typing import Any

from vramplan.frameworks.configs import core
from vramplan.frameworks.configs.core import ConfigError, Mapping
from vramplan.job import MASTER_OF

NAME = "deepspeed"
_MARKERS = {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size",
            "zero_allow_untested_optimizer"}


def detect(content: dict[str, Any], syntax: str) -> bool:
    return bool(_MARKERS & set(content))


def apply_overrides(content: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    return core.no_overrides(content, overrides, "a DeepSpeed JSON takes no overrides on the "
                             "command line; use vramplan's flags (--strategy, -b, --grad-accum)")


def _map(flat: dict[str, Any]) -> Mapping:
    """The file's keys through deepspeed.toml, with DeepSpeed's own default for
    overlap_comm where the file leaves it out: on for stage 3 only (runtime/zero/config.py
    overlap_comm_valid; stage 0, plain data parallelism, reduces after the backward)."""
    mapping = core.map_keys(core.load_table(NAME), flat)
    stage = flat.get("zero_optimization.stage", 0)
    if "zero_optimization.overlap_comm" not in flat and stage in (0, 1, 2, 3):
        mapping.assign("parallel.overlap_grad_reduce", stage == 3,
                       f"zero_optimization.stage={stage} (overlap_comm's default)", weak=True)
    return mapping


def read(content: dict[str, Any], ctx) -> Mapping:
    """A DeepSpeed JSON on its own. bf16.enabled "auto" is the launcher's bf16, which
    nearly every run sets: bf16-master unless the job says otherwise."""
    flat = core.flatten(content)
    mapping = _map(flat)
    if flat.get("bf16.enabled") == "auto" and flat.get("fp16.enabled") in ("auto", None, False):
        mapping.assign("precision", "bf16-master", "bf16.enabled auto (the launcher's bf16)",
                       weak=True)
    return mapping


def as_master_weights(mapping: Mapping) -> None:
    """A launcher's bf16 / fp16 under DeepSpeed turn DeepSpeed's own on (accelerate 1.16
    DeepSpeedPlugin.set_mixed_precision; the Trainer fills "auto" from its arguments): the
    16-bit model with fp32 master weights, not autocast: DeepSpeed casts the module
    (runtime/engine.py _configure_distributed_model)."""
    value, key, weak = mapping.assigned.get("precision", (None, "", False))
    if value in MASTER_OF:
        mapping.assigned["precision"] = (MASTER_OF[value], f"{key} under DeepSpeed", weak)


def include_named(parent: Mapping, content: dict[str, Any], ctx) -> None:
    """A training config's `deepspeed` key (popped from `content`'s copy by the caller and
    passed here with it), read once the config's own keys are mapped: their bf16 / fp16
    are then DeepSpeed's (as_master_weights). null or empty: no DeepSpeed."""
    if content.get("deepspeed"):
        as_master_weights(parent)
        include(parent, content["deepspeed"], "deepspeed", ctx)
        # the Trainer's no_sync skips DeepSpeed, which reduces as its own config says
        parent.assign("parallel.fsdp_no_sync", False, "deepspeed (the HF Trainer runs no "
                      "no_sync under DeepSpeed)", weak=True)
    elif "deepspeed" in content:
        parent.ignored.append("deepspeed")


def include(parent: Mapping, value: Any, key: str, ctx) -> None:
    """Map the DeepSpeed config a key names (a path, or the dict itself) into `parent`:
    its settings count as set by `key`, so they conflict with the parent's own."""
    if isinstance(value, str):
        path = ctx.sibling(value)
        if path is None:
            parent.not_understood.append(f"{key}={value} (file not found next to the config "
                                         "or in the working directory)")
            return
        content, _ = core.parse_text(core.read_text(path), path)
    elif isinstance(value, dict):
        content = value
    else:
        raise ConfigError(f"{parent.table.title} config key {key!r}: expected a path to a "
                          f"DeepSpeed JSON or its content, got {json.dumps(value)[:60]} "
                          f"(see {parent.table.docs})")
    child = _map(core.flatten(content))
    parent.mapped.append(key)
    for dotted, (field_value, source, weak) in child.assigned.items():
        parent.assign(dotted, field_value, f"{key} ({source})", weak=weak)
    parent.ignored += [f"{key}:{k}" for k in child.ignored]
    parent.not_understood += [f"{key}:{k}" for k in child.not_understood]


def override_line(config_file: str, changes: dict[str, Any]) -> str:
    return f"edit {config_file}: " + ", ".join(f"{k} = {json.dumps(v)}"
                                                for k, v in changes.items())
