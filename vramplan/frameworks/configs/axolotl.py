"""Axolotl YAML: base model, micro-batch, sequence length, LoRA/QLoRA, precision and
checkpointing (axolotl.toml); a `deepspeed` JSON it names is read as DeepSpeed."""

from __future__ import annotations

from typing import Any

from vramplan.frameworks.configs import core, deepspeed
from vramplan.frameworks.configs.core import ConfigError, Mapping
from vramplan.frameworks.configs.hf import check_adapter, check_modules_to_save

NAME = "axolotl"


def detect(content: dict[str, Any], syntax: str) -> bool:
    return "base_model" in content and bool(
        {"micro_batch_size", "sequence_len", "adapter", "datasets"} & set(content))


def apply_overrides(content: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`--key=value`, as `axolotl train FILE --micro_batch_size=2` takes them."""
    return core.dashed_overrides(content, overrides, "Axolotl")


def read(content: dict[str, Any], ctx) -> Mapping:
    table = core.load_table(NAME)
    content = {k: v for k, v in content.items() if k != "datasets"}  # a list of sources
    ds = {"deepspeed": content.pop("deepspeed")} if "deepspeed" in content else {}
    flat = core.flatten(content)
    mapping = Mapping(table)
    mapping.ignored.append("datasets")
    if flat.get("base_model") is not None:
        mapping.mapped.append("base_model")
        model = ctx.resolve_model(flat["base_model"], "base_model", mapping)
        if model:
            mapping.assign("model", model, "base_model")
    if flat.get("load_in_8bit"):
        raise ConfigError("load_in_8bit: an 8-bit base model is not modelled by vramplan; "
                          "use adapter: qlora with load_in_4bit: true, or a 16-bit base")
    adapter = flat.get("adapter")
    check_modules_to_save(flat, "lora_modules_to_save", mapping)
    check_adapter(flat.get("load_in_4bit"), adapter in ("lora", "qlora"), mapping,
                  "load_in_4bit", "adapter: qlora")
    if adapter == "qlora" and not flat.get("load_in_4bit"):
        mapping.notes.append("adapter qlora without load_in_4bit: Axolotl loads the base in "
                             "4-bit for qlora; modelled as QLoRA")
    targets = flat.get("lora_target_modules")
    if targets is not None:
        core.check_type(table, table.entries["lora_target_modules"], targets)
        mapping.mapped.append("lora_target_modules")
        mapping.assign("peft.target_modules", tuple([targets] if isinstance(targets, str)
                                                    else targets), "lora_target_modules")
    core.map_keys(table, flat, mapping, handled={"base_model", "lora_target_modules", "deepspeed",
                                            "load_in_4bit", "load_in_8bit",
                                            "lora_modules_to_save"})
    for key in ("load_in_4bit", "load_in_8bit"):
        if key in flat:
            mapping.mapped.append(key)
    deepspeed.include_named(mapping, ds, ctx)  # last: the config's bf16 / fp16 are DeepSpeed's
    return mapping


def override_line(config_file: str, changes: dict[str, Any]) -> str:
    parts = [f"--{key}={value}" for key, value in changes.items()]
    return f"axolotl train {config_file} " + " ".join(parts)
