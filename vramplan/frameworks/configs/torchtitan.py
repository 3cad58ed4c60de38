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
    for section, key in (("model", "converters"), ("compile", "components")):
        table = content.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        if isinstance(value, str):  # --model.converters=float8,mx (a list on the command line)
            table[key] = [c for c in value.split(",") if c]
    return content


def read(content: dict[str, Any], ctx) -> Mapping:
    table = core.load_table(NAME)
    flat = core.flatten(content)
    mapping = Mapping(table)
    handled = {"model.name", "model.flavor", "activation_checkpoint.mode",
               "activation_checkpoint.selective_ac_option", "model.converters",
               "parallelism.data_parallel_replicate_degree",
               "parallelism.data_parallel_shard_degree", "training.global_batch_size",
               "compile.components", "parallelism.enable_async_tensor_parallel",
               *_PIPELINE_KEYS}
    if (flat.get("parallelism.pipeline_parallel_degree") or 1) > 1:
        handled.add("training.local_batch_size")  # the pipeline splits it (_pipeline)
    for key in handled & set(flat):
        if flat[key] is not None:
            core.check_type(table, table.entries[key], flat[key])
        mapping.mapped.append(key)
    for kind in ("tensor", "context", "pipeline"):  # read by _parallel too: typed first
        key = f"parallelism.{kind}_parallel_degree"
        if flat.get(key) is not None:
            core.check_type(table, table.entries[key], flat[key])
    _model(flat, table, mapping, ctx)
    _checkpointing(flat, mapping)
    accumulation = _parallel(flat, mapping)
    _pipeline(flat, table, mapping, ctx, accumulation)
    _compile(flat, mapping)
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


def _parallel(flat: dict[str, Any], mapping: Mapping) -> int | None:
    """Strategy and GPUs from the degrees; returns the accumulation steps the global batch
    asks for (None: no global batch, no accumulation)."""
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
    _reshard(flat, strategy, degree("pipeline_parallel_degree", 1), mapping)
    if strategy == "hybrid-shard":  # each replica shards over dp_shard x cp (the fsdp mesh)
        mapping.assign("parallel.gpus_per_node", shard * degree("context_parallel_degree", 1),
                       "data_parallel_shard_degree x context_parallel_degree")
    global_batch = flat.get("training.global_batch_size", -1)
    local = flat.get("training.local_batch_size", 8)
    if global_batch > 0 and isinstance(local, int) and local > 0:
        # train.py: the accumulation that makes up the global batch over the DP ranks
        steps, rest = divmod(global_batch, local * replicate * shard)
        if rest or steps < 1:
            raise ConfigError(f"torchtitan training.global_batch_size {global_batch} is not a "
                              f"multiple of local_batch_size x data-parallel degree "
                              f"({local} x {replicate * shard}), as train.py requires")
        return steps
    return None


# fsdp_reshard_after_forward -> FSDP2's reshard_after_forward (distributed/fsdp.py
# get_fsdp_reshard_after_forward_policy): 'default' reshards unless a pipeline runs
RESHARD_POLICIES = {"always": lambda pp: True, "never": lambda pp: False,
                    "default": lambda pp: pp == 1}


def _reshard(flat: dict[str, Any], strategy: str, pp: int, mapping: Mapping) -> None:
    key = "parallelism.fsdp_reshard_after_forward"
    policy = flat.get(key, "default")
    if policy not in RESHARD_POLICIES:
        raise ConfigError(f"torchtitan {key} {policy!r}: torchtitan takes "
                          f"{', '.join(RESHARD_POLICIES)}")
    if strategy in ("fsdp", "hybrid-shard"):
        mapping.assign("parallel.reshard_after_forward", RESHARD_POLICIES[policy](pp),
                       f"{key}={policy!r}" + (f" with pipeline_parallel_degree {pp}"
                                              if policy == "default" else ""))


_PIPELINE_KEYS = ("parallelism.pipeline_parallel_schedule",
                  "parallelism.pipeline_parallel_microbatch_size",
                  "parallelism.pipeline_parallel_layers_per_stage",
                  "parallelism.pipeline_parallel_first_stage_less_layers",
                  "parallelism.pipeline_parallel_last_stage_less_layers")


def _pipeline(flat: dict[str, Any], table, mapping: Mapping, ctx, accumulation: int | None):
    """The schedule, its micro-batches and stages per rank, as pipeline_parallel.py builds
    them; without a pipeline the local batch is one micro-batch of each accumulation step."""
    pp = flat.get("parallelism.pipeline_parallel_degree") or 1
    if pp == 1:
        if accumulation is not None:
            mapping.assign("grad_accum", accumulation, "training.global_batch_size")
        return
    name = flat.get("parallelism.pipeline_parallel_schedule") or "1F1B"
    schedules = table.extra["pipeline_schedules"]
    if name not in schedules:
        raise ConfigError(f"torchtitan pipeline_parallel_schedule {name!r} is not modelled: "
                          f"vramplan models {', '.join(schedules)}; name one of them for "
                          "an estimate")
    local = flat.get("training.local_batch_size", 8)
    size = flat.get("parallelism.pipeline_parallel_microbatch_size", 1)
    if not isinstance(local, int) or local < 1 or size < 1 or local % size:
        raise ConfigError(f"torchtitan training.local_batch_size {local} is not a multiple of "
                          f"pipeline_parallel_microbatch_size {size}, as "
                          "pipeline_parallel.py requires")
    micro = local // size
    key = "parallelism.pipeline_parallel_microbatch_size"
    mapping.assign("batch_size", size, f"{key}={size} (local_batch_size {local})")
    mapping.assign("grad_accum", micro * (accumulation or 1),
                   f"training.local_batch_size / {key}"
                   + (" x the accumulation steps" if accumulation else ""))
    if accumulation and accumulation > 1:  # train.py: one pp_schedule.step per accumulation
        mapping.assign("parallel.pipeline_flushes", accumulation, "training.global_batch_size")
    mapping.assign("parallel.pipeline_schedule", schedules[name],
                   f"parallelism.pipeline_parallel_schedule={name!r}")
    for part, (key, weight) in zip(("embedding", "head"), _stage_weights(flat)):
        mapping.assign(f"parallel.pipeline_{part}_layers", weight,
                       key if key in flat else f"{key} (torchtitan's default, 1)")
    if schedules[name] == "interleaved":
        mapping.assign("parallel.pipeline_chunks", _stages_per_rank(flat, pp, ctx, mapping),
                       "parallelism.pipeline_parallel_layers_per_stage")


def _stage_weights(flat: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """(key, value) of first_stage_less_layers and last_stage_less_layers: the blocks the
    embedding and the output count as in the split (1 each by default, job_config.py)."""
    keys = (f"parallelism.pipeline_parallel_{end}_stage_less_layers" for end in ("first", "last"))
    return tuple((key, flat.get(key, 1)) for key in keys)


def _stages_per_rank(flat: dict[str, Any], pp: int, ctx, mapping: Mapping) -> int:
    """pipeline_parallel.py pipeline_llm: 2 per rank for a multi-stage schedule, or
    ceil((layers + first_less + last_less) / layers_per_stage) stages over the pp ranks."""
    per_stage = flat.get("parallelism.pipeline_parallel_layers_per_stage")
    if per_stage is None:
        return 2
    model = ctx.model or mapping.assigned.get("model", (None,))[0]
    if model is None or per_stage < 1:
        raise ConfigError("torchtitan pipeline_parallel_layers_per_stage needs a model with "
                          "a layer count and a positive value")
    from vramplan.models import load_architecture

    layers = sum(s.num_layers for s in load_architecture(model).stacks)
    extra = sum(weight for _, weight in _stage_weights(flat))
    stages = math.ceil((layers + extra) / per_stage)
    if stages % pp or stages // pp < 2:
        raise ConfigError(f"torchtitan: {layers} layers at pipeline_parallel_layers_per_stage "
                          f"{per_stage} make {stages} stages, which an interleaved schedule "
                          f"cannot spread over {pp} ranks (a multiple of {pp}, at least 2 per "
                          "rank, as pipeline_parallel.py requires)")
    return stages // pp


def _compile(flat: dict[str, Any], mapping: Mapping) -> None:
    """compile.components (blocks 'model', 'loss'), and async TP, which needs the blocks
    compiled (tensor_parallel.py maybe_enable_async_tp)."""
    enabled = bool(flat.get("compile.enable"))
    components = flat.get("compile.components") or ["model", "loss"]
    if enabled:
        unknown = set(components) - {"model", "loss"}
        if unknown or not components:
            raise ConfigError(f"torchtitan compile.components {components!r}: vramplan models "
                              "'model' (the blocks) and 'loss'")
        what = "+".join(n for k, n in (("model", "blocks"), ("loss", "loss"))
                        if k in components)
        mapping.assign("compile_components", what, f"compile.components={components!r}")
    tp = flat.get("parallelism.tensor_parallel_degree") or 1
    if flat.get("parallelism.enable_async_tensor_parallel") and tp > 1:
        if not (enabled and "model" in components):
            raise ConfigError("torchtitan enable_async_tensor_parallel needs compile.enable "
                              "and 'model' in compile.components (tensor_parallel.py "
                              "maybe_enable_async_tp refuses it otherwise)")
        mapping.assign("parallel.async_tp", True, "parallelism.enable_async_tensor_parallel")


def own_changes(content: dict[str, Any], before, after) -> tuple[dict[str, Any], tuple]:
    """A pipelined job's batch as torchtitan's keys: its micro-batch is
    pipeline_parallel_microbatch_size, local_batch_size that times the micro-batches of one
    schedule, and global_batch_size (where the file sets one) that times the data-parallel
    ranks and the schedules per step (the accumulation steps)."""
    par = after.parallel
    fields = ("batch_size", "grad_accum")
    if par.pipeline_parallel == 1 or all(getattr(before, f) == getattr(after, f)
                                         for f in fields):
        return {}, ()
    local = after.batch_size * (after.grad_accum // par.pipeline_flushes)
    changes = {"parallelism.pipeline_parallel_microbatch_size": after.batch_size,
               "training.local_batch_size": local}
    if (core.flatten(content).get("training.global_batch_size") or -1) > 0:
        changes["training.global_batch_size"] = local * par.data_parallel * par.pipeline_flushes
    return changes, fields


def override_line(config_file: str, changes: dict[str, Any]) -> str:
    parts = [f"--{key}={core.override_value(value, ('true', 'false'), ',')}"
             for key, value in changes.items()]
    return f"torchrun ... -m torchtitan.train --job.config_file {config_file} " + " ".join(parts)
