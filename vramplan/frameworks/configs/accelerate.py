"""accelerate config YAML: distributed type, processes, mixed precision and the FSDP /
DeepSpeed plugins (accelerate.toml); a `deepspeed_config_file` is read as DeepSpeed JSON."""

from __future__ import annotations

from typing import Any

from vramplan.frameworks.configs import core, deepspeed
from vramplan.frameworks.configs.core import ConfigError, Mapping

NAME = "accelerate"


def detect(content: dict[str, Any], syntax: str) -> bool:
    return "distributed_type" in content or "compute_environment" in content


def apply_overrides(content: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    return core.no_overrides(content, overrides, "an accelerate config takes no overrides "
                             "here; use vramplan's flags (--strategy, -n, -p)")


def read(content: dict[str, Any], ctx) -> Mapping:
    table = core.load_table(NAME)
    flat = core.flatten(content)
    mapping = Mapping(table)
    key = "deepspeed_config.deepspeed_config_file"
    core.map_keys(table, flat, mapping, handled={key})
    kind = flat.get("distributed_type")
    if kind == "DEEPSPEED":  # mixed_precision is DeepSpeed's
        deepspeed.as_master_weights(mapping)
    if key in flat:
        deepspeed.include(mapping, flat[key], key, ctx)
    if kind == "FSDP" and any(k.startswith("deepspeed_config.") for k in flat):
        raise ConfigError("conflicting settings in this accelerate config: distributed_type "
                          "FSDP with a deepspeed_config; keep one of them "
                          f"({table.docs})")
    return mapping


def override_line(config_file: str, changes: dict[str, Any]) -> str:
    return f"edit {config_file}: " + ", ".join(f"{k}: {v}" for k, v in changes.items())
