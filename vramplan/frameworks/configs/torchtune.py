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
    _data_parallel(flat, table, mapping)
    core.map_keys(table, flat, mapping, handled={
        "model._component_", "model.lora_attn_modules", "model.apply_lora_to_mlp",
        "model.apply_lora_to_output", *_DP_KEYS})
    if "tokenizer.max_seq_len" not in mapping.mapped:
        mapping.notes.append("tokenizer.max_seq_len is not set: samples are as long as the "
                             "data makes them; vramplan assumes its default sequence length "
                             "(pass tokenizer.max_seq_len=N or --seq-len N)")
    return mapping


# keys only the distributed recipes read (full_ / lora_finetune_distributed.py): a file with
# one is a distributed recipe's, which shards with FSDP2 even on one GPU
_DISTRIBUTED = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "data_parallel_shard_dim",
                "data_parallel_replicate_dim", "tensor_parallel_dim", "context_parallel_dim",
                "custom_sharded_layers")
_DP_KEYS = ("data_parallel_shard_dim", "data_parallel_replicate_dim")


def _data_parallel(flat: dict[str, Any], table, mapping: Mapping) -> None:
    """The strategy (and GPUs, where the degrees fix them) of a distributed recipe's file,
    as its ParallelDims and shard_model decide: FSDP2 over dp_shard x cp, HSDP with
    replicas. A file without those keys leaves it to the profile (FSDP2 on several GPUs)."""
    if not any(flat.get(k) is not None for k in _DISTRIBUTED):
        return
    for key in _DP_KEYS:
        if flat.get(key) is not None:
            core.check_type(table, table.entries[key], flat[key])
            mapping.mapped.append(key)
    shard = flat.get("data_parallel_shard_dim")
    shard = -1 if shard is None else shard
    replicate = flat.get("data_parallel_replicate_dim") or 1
    cp = flat.get("context_parallel_dim") or 1
    tp = flat.get("tensor_parallel_dim") or 1
    if shard == 0 or shard < -1 or replicate < 1:
        raise ConfigError(f"torchtune data_parallel_shard_dim {shard} / "
                          f"data_parallel_replicate_dim {replicate}: torchtune takes a shard "
                          "degree of -1 (inferred) or at least 1, and at least 1 replica")
    keys = "data_parallel_shard_dim / data_parallel_replicate_dim"
    if shard == -1 and replicate > 1:
        raise ConfigError("torchtune data_parallel_replicate_dim > 1 with "
                          "data_parallel_shard_dim -1: the shard degree is what the launcher's "
                          "GPU count leaves, which vramplan needs to size HSDP's groups; set "
                          "data_parallel_shard_dim")
    if shard == 1 and replicate > 1 and cp == 1:
        raise ConfigError("torchtune data_parallel_shard_dim 1 with data_parallel_replicate_dim "
                          f"{replicate}: the recipe then applies no FSDP (shard_model runs "
                          "only when dp_shard or cp > 1) and no DDP, so nothing reduces the "
                          "replicas' gradients; set data_parallel_shard_dim")
    if shard == -1:
        mapping.notes.append("data_parallel_shard_dim -1 shards over the GPUs `tune run "
                             f"--nproc_per_node` gives: vramplan assumes {tp * cp} GPU(s); "
                             "pass -n N for N")
        mapping.assign("parallel.strategy", "fsdp", "a distributed recipe's keys (FSDP2)")
        mapping.assign("parallel.num_gpus", tp * cp, "tensor_parallel_dim x context_parallel_dim")
        return
    strategy = ("hybrid-shard" if replicate > 1 else
                "fsdp" if shard > 1 or cp > 1 else "none")
    mapping.assign("parallel.strategy", strategy, keys)
    mapping.assign("parallel.num_gpus", replicate * shard * cp * tp, f"{keys} x tp x cp")
    if strategy == "hybrid-shard":  # each replica shards over dp_shard x cp
        mapping.assign("parallel.gpus_per_node", shard * cp, "data_parallel_shard_dim x cp")


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
