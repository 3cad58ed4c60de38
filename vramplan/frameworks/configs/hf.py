"""Hugging Face TrainingArguments (JSON/YAML), TRL's `--config` YAML, and peft's LoraConfig
(as `peft_config` or a file of its own): hf.toml. TRL's SFTConfig changes three of
TrainingArguments' defaults; a file with TRL's model keys gets those."""

from __future__ import annotations

import json
from typing import Any

from vramplan.frameworks.configs import core, deepspeed
from vramplan.frameworks.configs.core import ConfigError, Mapping
from vramplan.job import SAVED_MODULE_NAMES

NAME = "hf-trainer"
_MARKERS = {"per_device_train_batch_size", "gradient_accumulation_steps", "peft_type",
            "peft_config", "model_name_or_path", "output_dir"}
_TRL_KEYS = {"model_name_or_path", "dataset_name", "use_peft", "max_length"}
# fsdp's words -> (strategy, reshard_after_forward): torch's SHARD_GRAD_OP shards the
# parameters too and keeps each unit gathered from its forward to its backward (FSDP
# without resharding, not DeepSpeed's ZeRO-2); None: no such setting (DDP)
_FSDP = {"full_shard": ("fsdp", True), "shard_grad_op": ("fsdp", False),
         "hybrid_shard": ("hybrid-shard", True), "hybrid_shard_zero2": ("hybrid-shard", False),
         "no_shard": ("ddp", None)}


def detect(content: dict[str, Any], syntax: str) -> bool:
    return syntax != "toml" and bool(_MARKERS & set(content))


def apply_overrides(content: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`--key value` / `--key=value`, as HfArgumentParser takes them."""
    return core.dashed_overrides(content, overrides, "HF TrainingArguments")


def read(content: dict[str, Any], ctx) -> Mapping:
    table = core.load_table(NAME)
    content = dict(content)
    peft_config = content.pop("peft_config", None)
    if isinstance(peft_config, dict):  # a LoraConfig's keys, as if at the top
        content = {**peft_config, **content}
        content.setdefault("peft_type", "LORA")
    ds = {"deepspeed": content.pop("deepspeed")} if "deepspeed" in content else {}
    flat = unprefixed_fsdp_config(core.flatten(content))
    mapping = Mapping(table)
    handled = {"model_name_or_path", "deepspeed", "lora_target_modules",
               "target_modules", "load_in_8bit", "modules_to_save", "base_model_name_or_path",
               *UNMODELLED_PEFT}
    check_modules_to_save(flat, "modules_to_save", mapping)
    for key, why in UNMODELLED_PEFT.items():
        given = {k: v for k, v in flat.items() if k == key or k.startswith(f"{key}.")}
        if any(v not in (None, {}, []) for v in given.values()):  # a dict flattens to key.*
            raise ConfigError(f"{key}: {why}, which vramplan does not model; drop it for an "
                              "estimate without it")
        mapping.ignored += list(given)  # None or empty: peft's default
        handled |= set(given)
    if _TRL_KEYS & set(flat):  # trl sft_config.py: SFTConfig's own defaults
        if "fp16" not in flat or not flat["fp16"]:
            mapping.assign("precision", "bf16-mixed", "trl SFTConfig bf16 default", weak=True)
        mapping.assign("checkpointing", "full", "trl SFTConfig gradient_checkpointing "
                       "default", weak=True)
        mapping.assign("seq_len", 1024, "trl SFTConfig max_length default", weak=True)
        if flat.get("use_peft"):  # trl model_config.py: ModelConfig's LoRA defaults
            for dotted, value in (("peft.rank", 16), ("peft.alpha", 32.0),
                                  ("peft.dropout", 0.05)):
                mapping.assign(dotted, value, "trl ModelConfig default", weak=True)
    # a peft adapter_config.json names its model as base_model_name_or_path
    key = next((k for k in ("model_name_or_path", "base_model_name_or_path")
                if flat.get(k) is not None), None)
    for unset in ("model_name_or_path", "base_model_name_or_path"):
        if unset in flat and flat[unset] is None:
            mapping.ignored.append(unset)
    if key is not None:
        core.check_type(table, table.entries["model_name_or_path"], flat[key])
        mapping.mapped.append(key)
        model = ctx.resolve_model(flat[key], key, mapping)
        if model:
            mapping.assign("model", model, key)
    handled |= read_fsdp(flat, table, mapping)
    _targets(flat, table, mapping)
    if flat.get("load_in_8bit"):
        raise ConfigError("load_in_8bit: an 8-bit base model is not modelled by vramplan; "
                          "use load_in_4bit (QLoRA) or a 16-bit base")
    core.map_keys(table, flat, mapping, handled=handled)
    check_adapter(flat.get("load_in_4bit"), bool(flat.get("use_peft")) or "peft_type" in flat,
                  mapping, "load_in_4bit", "use_peft: true")
    deepspeed.include_named(mapping, ds, ctx)  # last: the config's bf16 / fp16 are DeepSpeed's
    return mapping


def check_adapter(four_bit: Any, has_adapter: bool, mapping: Mapping, key: str,
                  hint: str) -> None:
    """A 4-bit base trains only adapters: without one there is nothing to train."""
    if four_bit and not has_adapter:
        raise ConfigError(f"{key} without an adapter: 4-bit weights cannot be trained; add "
                          f"LoRA ({hint}) or drop {key} ({mapping.table.docs})")


# peft LoraConfig keys whose non-default values change the memory in ways vramplan does not
# count (peft 0.21.2 tuners/lora/config.py)
UNMODELLED_PEFT = {
    "layer_replication": "peft stacks extra copies of the given layer ranges (more layers, "
                         "each with its own adapters and activations)",
    "target_parameters": "LoRA on nn.Parameters (e.g. an MoE's stacked experts) adds "
                         "adapters the formula does not count",
    "rank_pattern": "a rank per module other than r changes the adapters' size"}


# peft's modules_to_save: whole modules trained beside the adapters (peft keeps the frozen
# original and a trainable copy, with its gradients and optimizer states). A classification
# task's new head is counted with the task; the token embedding and the LM head, under any
# model's name for them (job.SAVED_MODULE_NAMES), are Job.peft.modules_to_save.
HEAD_MODULES = ("classifier", "score")


def check_modules_to_save(flat: dict[str, Any], key: str, mapping: Mapping) -> None:
    """Modules trained in full beside the adapters: the token embedding and the LM head
    become Job.peft.modules_to_save; others vramplan would not count are refused."""
    if key not in flat:
        return
    value = flat[key]
    if not value:  # None or empty: none
        mapping.ignored.append(key)
        return
    names = ([n.strip() for n in value.split(",") if n.strip()] if isinstance(value, str)
             else [str(n) for n in value] if isinstance(value, list) else [str(value)])
    others = [n for n in names if n not in HEAD_MODULES and n not in SAVED_MODULE_NAMES]
    if others:
        raise ConfigError(
            f"{key}: {', '.join(others)} would train in full beside the adapters (peft keeps "
            "a trainable copy of each, with its gradients and optimizer states), which "
            "vramplan does not model (it counts the token embedding, the LM head and a "
            f"classifier head: {', '.join([*SAVED_MODULE_NAMES, *HEAD_MODULES])}); drop them "
            "for an estimate that leaves those copies out")
    saved = tuple(n for n in names if n in SAVED_MODULE_NAMES)  # Job reads each model's name
    if saved:
        mapping.assign("peft.modules_to_save", saved, key)
    mapping.mapped.append(key)


def unprefixed_fsdp_config(flat: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """fsdp_config's keys as the Trainer reads them: a leading fsdp_ dropped
    (training_args.py _process_fsdp_args: fsdp_config[k[5:]] for k starting with fsdp_),
    except the keys in `keep` (Axolotl keeps fsdp_version)."""
    head = "fsdp_config.fsdp_"
    return {("fsdp_config." + k[len(head):] if k.startswith(head) and k not in keep else k): v
            for k, v in flat.items()}


def read_fsdp(flat: dict[str, Any], table, mapping: Mapping) -> set[str]:
    """fsdp (True, or the legacy words) and the fsdp_config keys the table cannot read by
    itself; returns the keys read here (the table maps the rest of fsdp_config)."""
    value = flat.get("fsdp")
    config_keys = {k for k in flat if k == "fsdp_config" or k.startswith("fsdp_config.")}
    if not value:
        if "fsdp" in flat:
            mapping.ignored.append("fsdp")  # '' or [] or false: no FSDP
        mapping.ignored += sorted(config_keys)  # the Trainer reads fsdp_config only with fsdp
        return config_keys | ({"fsdp"} & set(flat))
    if isinstance(flat.get("fsdp_config"), str):  # a path to a JSON file of its keys
        mapping.not_understood.append("fsdp_config (a file path: put its keys inline)")
    handled = {"fsdp", *({"fsdp_config"} & config_keys)}
    mapping.mapped.append("fsdp")
    if value is True:  # transformers 5: fsdp=True, everything else in fsdp_config
        mapping.assign("parallel.strategy", "fsdp", "fsdp=True")
        words = []
    else:
        core.check_type(table, table.entries["fsdp"], value)
        words = value.split() if isinstance(value, str) else [str(v) for v in value]
    spelt = flat.get("fsdp_config.reshard_after_forward")
    if str(flat.get("fsdp_config.version", 2)) == "1" and isinstance(spelt, str):
        # FSDP1 spells its sharding strategy here (full_shard, shard_grad_op, ...)
        words.append(spelt.lower())
        handled.add("fsdp_config.reshard_after_forward")
    fsdp_words(words, f"fsdp={value!r}", mapping)
    return handled


def own_changes(content: dict[str, Any], before, after) -> tuple[dict[str, Any], tuple]:
    """A resharding change to an FSDP1 file (fsdp_config version 1) spells the sharding
    strategy in fsdp_config.reshard_after_forward, as FSDP1 reads it there."""
    config = content.get("fsdp_config")
    config = config if isinstance(config, dict) else {}
    version = config.get("version", config.get("fsdp_version", 2))
    was, now = before.parallel.reshard_after_forward, after.parallel.reshard_after_forward
    if str(version) != "1" or was == now:
        return {}, ()
    hybrid = after.parallel.strategy == "hybrid-shard"
    strategy = {(False, True): "full_shard", (False, False): "shard_grad_op",
                (True, True): "hybrid_shard", (True, False): "hybrid_shard_zero2"}[(hybrid, now)]
    return {"fsdp_config.reshard_after_forward": strategy}, ("parallel.reshard_after_forward",)


def fsdp_words(words: list[str], key: str, mapping: Mapping) -> None:
    """The Trainer's fsdp words (FSDPOption), set from `key` (Axolotl hands its list on)."""
    for word in words:
        if word in _FSDP:
            strategy, reshard = _FSDP[word]
            mapping.assign("parallel.strategy", strategy, key)
            if reshard is not None:  # weak: an FSDP2 fsdp_config's own value wins (setdefault)
                mapping.assign("parallel.reshard_after_forward", reshard, key, weak=True)
        elif word == "offload":
            mapping.assign("offload.params", True, key)
            mapping.assign("offload.optimizer", True, key)
        elif word != "auto_wrap":
            mapping.not_understood.append(f"fsdp={word}")


def _targets(flat: dict[str, Any], table, mapping: Mapping) -> None:
    for key in ("lora_target_modules", "target_modules"):
        value = flat.get(key)
        if value is None:
            continue
        core.check_type(table, table.entries[key], value)
        mapping.mapped.append(key)
        # peft keeps target_modules as a set (adapter_config.json lists it in any order)
        targets = ("all-linear",) if value == "all-linear" else tuple(
            [value] if isinstance(value, str) else sorted(value))
        mapping.assign("peft.target_modules", targets, f"{key}={value!r}")


def override_line(config_file: str, changes: dict[str, Any]) -> str:
    """HfArgumentParser flags; a nested key (accelerator_config.*) goes in its top-level
    argument as JSON, the only way that parser takes a dict."""
    flat: dict[str, Any] = {}
    for key, value in changes.items():
        top, _, rest = key.partition(".")
        if rest:
            core.set_dotted(flat.setdefault(top, {}), rest, value)
        else:
            flat[key] = value
    parts = [f"--{key} '{json.dumps(value)}'" if isinstance(value, dict) else f"--{key} {value}"
             for key, value in flat.items()]
    return f"python train.py {config_file} " + " ".join(parts)
