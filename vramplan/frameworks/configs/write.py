"""Writers: a change to a Job (make-it-fit's fix) as a change to the user's own file: the
file keys and values, a patched copy (the lines that change, comments kept), a unified
diff, and the override line of that framework's launcher."""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

from vramplan.frameworks.configs.core import Table, load_table, set_dotted
from vramplan.frameworks.configs.read import _MODULES, ConfigRead
from vramplan.job import Job

# the Job fields a fix, a plan's pick or a what-if changes that files can hold
_FIELDS = ("batch_size", "grad_accum", "seq_len", "checkpointing", "optimizer",
           "optimizer_impl", "loss", "activation_offload", "compile", "precision",
           "optimizer_in_backward", "peft.method", "peft.rank", "peft.alpha",
           "parallel.strategy", "parallel.num_gpus", "parallel.tensor_parallel",
           "parallel.fsdp_no_sync", "parallel.reshard_after_forward", "offload.optimizer",
           "offload.params")


def config_changes(read: ConfigRead, before: Job, after: Job) -> tuple[dict[str, Any], list[str]]:
    """(file key -> new value, the Job changes the format has no key for)."""
    tables = [load_table(read.format)] + (  # LLaMA-Factory files hold TrainingArguments too
        [load_table("hf-trainer")] if read.format == "llama-factory" else [])
    # fields whose keys the format works out itself (torchtitan's pipelined batch)
    own = getattr(_MODULES[read.format], "own_changes", None)
    changes, handled = own(read.content, before, after) if own else ({}, ())
    missing: list[str] = []
    for name in _FIELDS:
        new = _get(after, name)
        if _get(before, name) == new or name in handled:
            continue
        found = next((f for t in tables if (f := _key_for(t, read, name, after))), None)
        if found is None:
            missing.append(f"{name}={new}")
        elif changes.get(found[0], found[1]) != found[1]:
            missing.append(f"{name}={new} (its key {found[0]} is already changed)")
        else:
            changes[found[0]] = found[1]
    missing += [f"{d}={_get(after, d)}" for d in _other_fields(after)
                if d not in _FIELDS and _get(before, d) != _get(after, d)]
    if before.peft is not None and after.peft is None:
        missing.append("peft=None")
    return changes, missing


# set by the framework itself (its profile), never by a fix: not compared
_FRAMEWORK_SET = {"peft.adapter_dtype", "parallel.gpus_per_node",
                  "parallel.shard_over_context_parallel"}


def _other_fields(job: Job) -> list[str]:
    """Every dotted field of the job's parts (peft, parallel, offload, fp8)."""
    out = []
    for part in ("peft", "parallel", "offload", "fp8"):
        value = getattr(job, part)
        if value is not None:
            out += [f"{part}.{f}" for f in type(value).model_fields
                    if f"{part}.{f}" not in _FRAMEWORK_SET]
    return out


def _key_for(table: Table, read: ConfigRead, name: str, after: Job) -> tuple[str, Any] | None:
    """The file key (and its value) that sets Job field `name` as `after` has it: a key
    that takes the value as it is, or one whose spelt value sets it (and any other field
    it sets agrees with `after` too); keys the file already has first."""
    present = set(_flat_keys(read.content))
    value = _get(after, name)
    candidates = []
    for key, entry in table.entries.items():
        if entry.field == name:
            candidates.append((key in present, key, value))
        for spelt, fields in entry.values.items():
            if fields.get(name, object()) == value and all(
                    _get(after, dotted) == v for dotted, v in fields.items()):
                candidates.append((key in present, key, _unspell(spelt, entry.type)))
    if not candidates:
        return None
    candidates.sort(key=lambda c: not c[0])  # a key the file already has first
    return candidates[0][1], candidates[0][2]


def _get(job: Job, dotted: str) -> Any:
    value: Any = job
    for part in dotted.split("."):
        value = getattr(value, part, None)
    return value


def _unspell(spelt: str, kind: str) -> Any:
    if kind in ("bool", "bool_or_str") and spelt in ("true", "false"):
        return spelt == "true"
    if kind in ("int", "int_or_str") and spelt.isdigit():
        return int(spelt)
    return spelt


def _flat_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        if isinstance(value, dict):
            keys += _flat_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def patched_text(read: ConfigRead, changes: dict[str, Any]) -> str:
    """The file with `changes` made: JSON rewritten, YAML and TOML patched line by line."""
    if read.syntax == "json":
        data = json.loads(read.text)
        for key, value in changes.items():
            set_dotted(data, key, value)
        first = re.search(r"^( +)\"", read.text, re.M)  # the file's own indent
        indent = len(first.group(1)) if first else 2
        return json.dumps(data, indent=indent) + ("\n" if read.text.endswith("\n") else "")
    lines = read.text.splitlines(keepends=True)
    for key, value in changes.items():
        lines = (_patch_toml if read.syntax == "toml" else _patch_yaml)(lines, key, value)
    return "".join(lines)


def _yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _patch_yaml(lines: list[str], key: str, value: Any) -> list[str]:
    *parents, leaf = key.split(".")
    start, indent = 0, ""
    for part in parents:  # find each section, one level deeper each time
        for i in range(start, len(lines)):
            if re.match(rf"^{indent}{re.escape(part)}:\s*(#.*)?$", lines[i]):
                start = i + 1
                nxt = next((ln for ln in lines[start:] if ln.strip()), "")
                indent = re.match(r"^\s*", nxt).group(0)
                break
        else:
            return lines + [f"{key.replace('.', '_')}: {_yaml_value(value)}\n"] if not parents \
                else lines + _yaml_section(parents, leaf, value)
    pattern = re.compile(rf"^({indent}{re.escape(leaf)}:\s*)([^#\n]*?)(\s*#.*)?$")
    for i in range(start, len(lines)):
        line = lines[i].rstrip("\n")
        if parents and line.strip() and not line.startswith(indent):
            break  # left the section
        match = pattern.match(line)
        if match:
            lines[i] = f"{match.group(1)}{_yaml_value(value)}{match.group(3) or ''}\n"
            return lines
    lines.insert(start if parents else len(lines), f"{indent}{leaf}: {_yaml_value(value)}\n")
    return lines


def _yaml_section(parents: list[str], leaf: str, value: Any) -> list[str]:
    out = [f"{'  ' * i}{p}:\n" for i, p in enumerate(parents)]
    return out + [f"{'  ' * len(parents)}{leaf}: {_yaml_value(value)}\n"]


def _toml_value(value: Any) -> str:
    return json.dumps(value)  # TOML's strings, numbers, booleans and arrays read the same


def _patch_toml(lines: list[str], key: str, value: Any) -> list[str]:
    section, _, leaf = key.rpartition(".")
    header = re.compile(rf"^\[{re.escape(section)}\]\s*(#.*)?$")
    start = next((i + 1 for i, ln in enumerate(lines) if header.match(ln.strip())), None)
    if start is None:
        return lines + [f"\n[{section}]\n", f"{leaf} = {_toml_value(value)}\n"]
    pattern = re.compile(rf"^(\s*{re.escape(leaf)}\s*=\s*)([^#\n]*?)(\s*#.*)?$")
    for i in range(start, len(lines)):
        if lines[i].lstrip().startswith("["):
            break
        match = pattern.match(lines[i].rstrip("\n"))
        if match:
            lines[i] = f"{match.group(1)}{_toml_value(value)}{match.group(3) or ''}\n"
            return lines
    lines.insert(start, f"{leaf} = {_toml_value(value)}\n")
    return lines


def unified_diff(read: ConfigRead, changes: dict[str, Any]) -> str:
    return "".join(difflib.unified_diff(
        read.text.splitlines(keepends=True), patched_text(read, changes).splitlines(
            keepends=True), fromfile=f"a/{read.path.name}", tofile=f"b/{read.path.name}"))


def override_line(read: ConfigRead, changes: dict[str, Any]) -> str:
    """The same change as the framework's launcher takes it on its command line."""
    return _MODULES[read.format].override_line(read.path.name, changes)


def fix_in_config(read: ConfigRead, before: Job, after: Job) -> str | None:
    """A fix as the framework's launcher line, or None when the file has no key for part of
    it (the fix then stays in vramplan's flags)."""
    changes, missing = config_changes(read, before, after)
    return override_line(read, changes) if changes and not missing else None
