"""LLaMA-Factory YAML: its own model / data / fine-tuning arguments (llamafactory.toml)
and the HF TrainingArguments beside them (hf.toml), in one file."""

from __future__ import annotations

from typing import Any

from vramplan.frameworks.configs import core, deepspeed, hf
from vramplan.frameworks.configs.core import ConfigError, Mapping

NAME = "llama-factory"


def detect(content: dict[str, Any], syntax: str) -> bool:
    return bool({"stage", "finetuning_type", "cutoff_len", "lora_target"} & set(content))


def apply_overrides(content: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`key=value`, as `llamafactory-cli train FILE key=value` takes them."""
    return core.key_value_overrides(content, overrides, "LLaMA-Factory")


def read(content: dict[str, Any], ctx) -> Mapping:
    table, hf_table = core.load_table(NAME), core.load_table(hf.NAME)
    content = dict(content)
    ds = {"deepspeed": content.pop("deepspeed")} if "deepspeed" in content else {}
    flat = core.flatten(content)
    mapping = Mapping(table)
    stage = flat.get("stage", "sft")
    if stage not in ("sft", "pt"):
        raise ConfigError(f"LLaMA-Factory stage {stage!r} trains beside a reference or value "
                          "model, which vramplan does not model; it models stage sft and pt")
    if flat.get("finetuning_type") in ("freeze", "oft"):
        raise ConfigError(f"LLaMA-Factory finetuning_type {flat['finetuning_type']!r} is not "
                          "modelled; vramplan models lora and full")
    if flat.get("quantization_bit") not in (None, 4):
        raise ConfigError(f"quantization_bit {flat['quantization_bit']}: only a 4-bit base "
                          "(QLoRA) is modelled")
    if flat.get("model_name_or_path") is not None:
        mapping.mapped.append("model_name_or_path")
        model = ctx.resolve_model(flat["model_name_or_path"], "model_name_or_path", mapping)
        if model:
            mapping.assign("model", model, "model_name_or_path")
    finetuning = flat.get("finetuning_type", "lora")
    hf.check_modules_to_save(flat, "additional_target", mapping)
    if finetuning == "lora":
        mapping.assign("peft.method", "lora", "finetuning_type (default lora)", weak=True)
        rank = flat.get("lora_rank", 8)
        if "lora_alpha" not in flat and isinstance(rank, int):
            mapping.assign("peft.alpha", 2.0 * rank, "lora_alpha (None: 2 x lora_rank)")
        target = flat.get("lora_target")
        if target is not None:
            core.check_type(table, table.entries["lora_target"], target)
            mapping.mapped.append("lora_target")
            mapping.assign("peft.target_modules", ("all-linear",) if target == "all" else
                           tuple(t.strip() for t in target.split(",")), "lora_target")
    own = {k: v for k, v in flat.items() if k in table.entries or k in table.ignored}
    rest = hf.unprefixed_fsdp_config({k: v for k, v in flat.items() if k not in own})
    handled = {"model_name_or_path", "lora_target", "deepspeed", "additional_target"}
    handled |= hf.read_fsdp(rest, hf_table, mapping)  # TrainingArguments' fsdp, fsdp_config
    core.map_keys(table, own, mapping, handled=handled)
    hf_mapping = core.map_keys(hf_table, rest, handled=handled)
    for dotted, (value, source, weak) in hf_mapping.assigned.items():
        mapping.assign(dotted, value, source, weak=weak)
    mapping.mapped += hf_mapping.mapped
    mapping.ignored += hf_mapping.ignored
    mapping.not_understood += hf_mapping.not_understood
    for dotted, value in hf_table.defaults.items():  # TrainingArguments' own defaults
        if dotted not in mapping.assigned and not dotted.startswith("peft."):
            mapping.assign(dotted, value, "TrainingArguments default", weak=True)
    deepspeed.include_named(mapping, ds, ctx)  # last: the config's bf16 / fp16 are DeepSpeed's
    return mapping


def override_line(config_file: str, changes: dict[str, Any]) -> str:
    parts = [f"{key}={value}" for key, value in changes.items()]
    return f"llamafactory-cli train {config_file} " + " ".join(parts)
