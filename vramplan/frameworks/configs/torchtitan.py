"""torchtitan job configs (TOML): model name + flavor, the parallelism degrees, op-level
or per-layer selective checkpointing; `--section.key=value` overrides (torchtitan.toml)."""

from __future__ import annotations

import math
from typing import Any

from vramplan.frameworks.configs import core
from vramplan.frameworks.configs.core import ConfigError, Mapping

NAME = "torchtitan"
_SECTIONS = {"training", "parallelism", "activation_checkpoint", "model", "optimizer"}


def detect(content: dict[str, Any], syntax: str) -> bool:
    model = content.get("model")
    return syntax == "toml" and (len(_SECTIONS & set(content)) >= 2 or (
        isinstance(model, dict) and "flavor" in model))


def apply_overrides(content: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`--training.local_batch_size=2` or `--training.local_batch_size 2`."""
    content = core.dashed_overrides(content, overrides, "torchtitan")
    converters = content.get("model", {}).get("converters") if isinstance(
        content.get("model"), dict) else None
    if isinstance(converters, str):  # --model.converters=float8,mx
        content["model"]["converters"] = [c for c in converters.split(",") if c]
    return content


def read(content: dict[str, Any], ctx) -> Mapping:
    table = core.load_table(NAME)
    flat = core.flatten(content)
    mapping = Mapping(table)
    handled = {"model.name", "model.flavor", "activation_checkpoint.mode",
               "activation_checkpoint.selective_ac_option", "model.converters",
               "parallelism.data_parallel_replicate_degree",
               "parallelism.data_parallel_shard_degree", "training.global_batch_size"}
    for key in handled & set(flat):
        core.check_type(table, table.entries[key], flat[key])
        mapping.mapped.append(key)
    for kind in ("tensor", "context", "pipeline"):  # read by _parallel too: typed first
        key = f"parallelism.{kind}_parallel_degree"
        if flat.get(key) is not None:
            core.check_type(table, table.entries[key], flat[key])
    _model(flat, table, mapping, ctx)
    _checkpointing(flat, mapping)
    _parallel(flat, mapping)
    converters = flat.get("model.converters", [])
    if "float8" in converters:
        mapping.assign("precision", "fp8", "model.converters=['float8']")
        if flat.get("quantize.linear.float8.recipe_name") is None:
            mapping.assign("fp8.recipe", "tensorwise", "quantize.linear.float8.recipe_name "
                           "(None: tensorwise)")
    for other in set(converters) - {"float8"}:
        mapping.not_understood.append(f"model.converters={other}")
    if "float8" not in converters:  # float8 options of a job that does not convert
        handled |= {k for k in flat if k.startswith("quantize.linear.float8.")}
        mapping.ignored += [k for k in flat if k.startswith("quantize.linear.float8.")]
    return core.map_keys(table, flat, mapping, handled=handled)


def _model(flat: dict[str, Any], table, mapping: Mapping, ctx) -> None:
    if ctx.model is not None:
        return
    name, flavor = flat.get("model.name", "llama3"), flat.get("model.flavor", "debugmodel")
    model = table.extra["models"].get(name, {}).get(flavor)
    if model is None:
        raise ConfigError(
            f"{ctx.path.name}: torchtitan model {name} flavor {flavor} is not a catalog "
            "model; save its Hugging Face config.json in a folder and pass the folder "
            f"(`vramplan estimate ./my-model/ --config {ctx.path.name}`)")
    mapping.assign("model", model, f"model.name={name} model.flavor={flavor}")


def _checkpointing(flat: dict[str, Any], mapping: Mapping) -> None:
    mode = flat.get("activation_checkpoint.mode")
    option = str(flat.get("activation_checkpoint.selective_ac_option", "2"))
    key = f"activation_checkpoint.mode={mode!r}"
    if mode is None:
        return  # the table's default (selective, option '2')
    if mode in ("none", "full"):
        mapping.assign("checkpointing", mode, key)
    elif mode == "selective" and option == "op":
        mapping.assign("checkpointing", "selective:torchtitan-op", key)
    elif mode == "selective" and option == "2":
        mapping.assign("checkpointing", "selective:every-2nd-layer", key)
    else:
        raise ConfigError(f"torchtitan activation_checkpoint.mode={mode!r} with "
                          f"selective_ac_option={option!r} is not modelled: vramplan "
                          "models none, full, selective with 'op' or '2'")


def _parallel(flat: dict[str, Any], mapping: Mapping) -> None:
    def degree(name: str, default: int) -> int:  # null: the default
        value = flat.get(f"parallelism.{name}")
        return default if value is None else value

    replicate = degree("data_parallel_replicate_degree", 1)
    shard = degree("data_parallel_shard_degree", -1)
    model_parallel = math.prod(degree(f"{k}_parallel_degree", 1)
                               for k in ("tensor", "context", "pipeline"))
    if shard == -1:
        mapping.notes.append("data_parallel_shard_degree = -1 shards over the GPUs the "
                             "launcher gives: vramplan assumes "
                             f"{replicate * model_parallel} GPU(s); pass -n N for N")
        shard = 1
    gpus = replicate * shard * model_parallel
    strategy = ("hybrid-shard" if replicate > 1 and shard > 1 else "ddp" if replicate > 1
                else "fsdp")  # torchtitan applies FSDP2 whenever it does not replicate
    mapping.assign("parallel.strategy", strategy, "parallelism.data_parallel_*_degree")
    mapping.assign("parallel.num_gpus", gpus, "parallelism.*_degree")
    if strategy == "hybrid-shard":
        mapping.assign("parallel.gpus_per_node", shard, "data_parallel_shard_degree")
    global_batch = flat.get("training.global_batch_size", -1)
    local = flat.get("training.local_batch_size", 8)
    if global_batch > 0 and isinstance(local, int) and local > 0:
        # train.py: the accumulation that makes up the global batch over the DP ranks
        steps, rest = divmod(global_batch, local * replicate * shard)
        if rest or steps < 1:
            raise ConfigError(f"torchtitan training.global_batch_size {global_batch} is not a "
                              f"multiple of local_batch_size x data-parallel degree "
                              f"({local} x {replicate * shard}), as train.py requires")
        mapping.assign("grad_accum", steps, "training.global_batch_size")


def override_line(config_file: str, changes: dict[str, Any]) -> str:
    parts = [f"--{key}={core.override_value(value, ('true', 'false'), ',')}"
             for key, value in changes.items()]
    return f"torchrun ... -m torchtitan.train --job.config_file {config_file} " + " ".join(parts)
