"""torchtune recipe configs: `model._component_` names the model builder, LoRA arguments
are the builder's; `tune run RECIPE --config FILE key=value` overrides (torchtune.toml)."""

from __future__ import annotations

from typing import Any

from vramplan.frameworks.configs import core
from vramplan.frameworks.configs.core import ConfigError, Mapping

NAME = "torchtune"


def detect(content: dict[str, Any], syntax: str) -> bool:
    return any(isinstance(v, dict) and "_component_" in v for v in content.values())


def apply_overrides(content: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`key=value` as `tune run` takes them (values read as YAML scalars); `~key` drops one."""
    return core.key_value_overrides(content, overrides, "torchtune")


def read(content: dict[str, Any], ctx) -> Mapping:
    table = core.load_table(NAME)
    flat = core.flatten(content)
    mapping = Mapping(table)
    builder = flat.get("model._component_")
    if builder is not None:
        _read_model(builder, flat, table, mapping, ctx)
    core.map_keys(table, flat, mapping, handled={
        "model._component_", "model.lora_attn_modules", "model.apply_lora_to_mlp",
        "model.apply_lora_to_output"})
    if "tokenizer.max_seq_len" not in mapping.mapped:
        mapping.notes.append("tokenizer.max_seq_len is not set: samples are as long as the "
                             "data makes them; vramplan assumes its default sequence length "
                             "(pass tokenizer.max_seq_len=N or --seq-len N)")
    return mapping


def _read_model(builder: Any, flat: dict[str, Any], table, mapping: Mapping, ctx) -> None:
    core.check_type(table, table.entries["model._component_"], builder)
    short = builder.rpartition(".")[2]
    method = None
    for prefix, peft in (("qlora_", "qlora"), ("lora_", "lora")):
        if short.startswith(prefix):
            short, method = short.removeprefix(prefix), peft
    name = table.extra["models"].get(short)
    if name is None and ctx.model is None:
        raise ConfigError(
            f"{ctx.path.name}: model._component_ {builder!r} is not a torchtune builder of a "
            "catalog model; save the model's config.json in a folder and pass the folder "
            f"(`vramplan estimate ./my-model/ --config {ctx.path.name}`)")
    mapping.mapped.append("model._component_")
    if ctx.model is None:
        mapping.assign("model", name, f"model._component_={builder}")
    if method is None:
        return
    mapping.assign("peft.method", method, f"model._component_={builder}")
    names = table.extra["lora_names"]
    modules = flat.get("model.lora_attn_modules", [])
    core.check_type(table, table.entries["model.lora_attn_modules"], modules)
    targets: list[str] = []
    for module in modules:
        if module not in names or module == "mlp":
            mapping.not_understood.append(f"model.lora_attn_modules={module}")
            continue
        targets += names[module]
    mlp = flat.get("model.apply_lora_to_mlp", False)
    core.check_type(table, table.entries["model.apply_lora_to_mlp"], mlp)
    if mlp:
        targets += names["mlp"]
    mapping.mapped += ["model.lora_attn_modules", "model.apply_lora_to_mlp"]
    mapping.assign("peft.target_modules", tuple(targets), "model.lora_attn_modules")
    # the builders' own defaults (lora_llama3_2_1b(lora_rank=8, lora_alpha=16, lora_dropout=0.0))
    for key, dotted, default in (("model.lora_rank", "peft.rank", 8),
                                 ("model.lora_alpha", "peft.alpha", 16.0),
                                 ("model.lora_dropout", "peft.dropout", 0.0)):
        if key not in flat:
            mapping.assign(dotted, default, f"{key} (builder default)", weak=True)
    if flat.get("model.apply_lora_to_output"):
        mapping.not_understood.append("model.apply_lora_to_output=True")
    elif "model.apply_lora_to_output" in flat:
        mapping.ignored.append("model.apply_lora_to_output")


def override_line(recipe_file: str, changes: dict[str, Any]) -> str:
    """`tune run RECIPE --config FILE key=value ...`."""
    parts = [f"{key}={core.override_value(value, ('True', 'False'), None)}"
             for key, value in changes.items()]
    return f"tune run <recipe> --config {recipe_file} " + " ".join(parts)
