"""Axolotl YAML: base model, micro-batch, sequence length, LoRA/QLoRA, precision,
checkpointing and FSDP (axolotl.toml); a `deepspeed` JSON it names is read as DeepSpeed."""

from __future__ import annotations

from typing import Any

from vramplan.frameworks.configs import core, deepspeed
from vramplan.frameworks.configs.core import ConfigError, Mapping
from vramplan.frameworks.configs.hf import (
    check_adapter,
    check_modules_to_save,
    fsdp_words,
    unprefixed_fsdp_config,
)

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
    # Axolotl drops the prefix but fsdp_version's (schemas/validation.py
    # check_fsdp_config_kwargs_prefix)
    flat = unprefixed_fsdp_config(core.flatten(content), keep=("fsdp_config.fsdp_version",))
    mapping = Mapping(table)
    mapping.ignored.append("datasets")
    handled = _fsdp(flat, mapping)
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
                                            "lora_modules_to_save", *handled})
    for key in ("load_in_4bit", "load_in_8bit"):
        if key in flat:
            mapping.mapped.append(key)
    deepspeed.include_named(mapping, ds, ctx)  # last: the config's bf16 / fp16 are DeepSpeed's
    return mapping


def _fsdp(flat: dict[str, Any], mapping: Mapping) -> set[str]:
    """A fsdp_config block, or the deprecated fsdp list, makes the job FSDP (Axolotl's
    `cfg.fsdp_config or cfg.fsdp`, utils/trainer.py); returns the keys read here."""
    config = any(k.startswith("fsdp_config.") or (k == "fsdp_config" and v is not None)
                 for k, v in flat.items())
    words = flat.get("fsdp") or []
    if config or words:
        # weak: a hybrid_shard word of the list says which FSDP
        mapping.assign("parallel.strategy", "fsdp", "fsdp_config" if config else "fsdp",
                       weak=True)
    # the deprecated list goes to the Trainer's fsdp as it is
    fsdp_words([words] if isinstance(words, str) else list(words), f"fsdp={words!r}", mapping)
    handled = {k for k in ("fsdp", "fsdp_config") if k in flat}
    if "fsdp" in flat:
        (mapping.mapped if words else mapping.ignored).append("fsdp")
    if flat.get("fsdp_config", 0) is None:
        mapping.ignored.append("fsdp_config")
    return handled


def override_line(config_file: str, changes: dict[str, Any]) -> str:
    parts = [f"--{key}={value}" for key, value in changes.items()]
    return f"axolotl train {config_file} " + " ".join(parts)
