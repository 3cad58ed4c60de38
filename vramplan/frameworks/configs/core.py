"""The shared core of the framework-config readers: read a file with bounded time and
memory, flatten it to dotted keys, and map each key through its format's table.

A table (`<format>.toml` beside this module) is data: every key the format's file may hold
is *mapped* (to Job fields, with the framework file and commit the meaning was read from),
*ignored* (learning rate, logging, paths: irrelevant to memory and time) or, when it is in
neither, *not understood*. Ignored and not-understood keys are listed in the read's notes,
so nothing is silently dropped. Two keys that set one Job field to different values are a
conflict and refused, never resolved by a guess. Torch-free.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from dataclasses import field as _field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from vramplan.errors import JobFileError

# the job files' caps and alias-counting loader: one set of limits for every file we read
from vramplan.files import MAX_FILE_BYTES, parse_mapping, read_capped_text

MAX_CONFIG_BYTES = MAX_FILE_BYTES  # a training config is a few hundred lines


class ConfigError(JobFileError):
    """A framework config that cannot be read, or that asks for something contradictory."""


# --- reading a file, bounded ----------------------------------------------------------------


def read_text(path: Path) -> str:
    """The file's text, refusing folders, missing files and files over the cap."""
    return read_capped_text(path, "training config", ConfigError,
                            "--config takes a recipe YAML, a TOML job config, a JSON ...")


def parse_text(text: str, path: Path) -> tuple[dict[str, Any], str]:
    """(content, syntax) where syntax is toml, json or yaml; TOML by suffix, else JSON when
    it parses as JSON, else YAML (with the job files' alias and node caps)."""
    return parse_mapping(text, path, "training config", ConfigError, json_without_suffix=True)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists and scalars are leaves."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def override_value(value: Any, booleans: tuple[str, str], list_separator: str | None) -> str:
    """A value as a framework's command-line override spells it: its own true/false, and a
    list joined by list_separator (None: Python's list text, which OmegaConf reads)."""
    if isinstance(value, bool):
        return booleans[0] if value else booleans[1]
    if isinstance(value, list) and list_separator is not None:
        return list_separator.join(map(str, value))
    return str(value)


def no_overrides(content: dict[str, Any], overrides: list[str], refusal: str) -> dict[str, Any]:
    """A copy of the content of a format whose tool takes no command-line overrides."""
    if overrides:
        raise ConfigError(refusal)
    return copy_data(content)


def copy_data(data: Any) -> Any:
    """A deep copy of parsed file content (dicts, lists, scalars)."""
    if isinstance(data, dict):
        return {k: copy_data(v) for k, v in data.items()}
    if isinstance(data, list):
        return [copy_data(v) for v in data]
    return data


def _scalar(text: str) -> Any:
    """An override's value as YAML reads a scalar (2, True, null, [a, b]), else the text."""
    try:
        return yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return text


def key_value_overrides(content: dict[str, Any], overrides: list[str],
                        title: str) -> dict[str, Any]:
    """`key=value` overrides (torchtune's `tune run`, LLaMA-Factory); `~key` drops one."""
    content = copy_data(content)
    for text in overrides:
        if text.startswith("~"):
            *parents, leaf = text[1:].split(".")
            part = content
            for name in parents:
                part = part.get(name, {}) if isinstance(part, dict) else {}
            if isinstance(part, dict):
                part.pop(leaf, None)
            continue
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise ConfigError(f"{title} override {text!r}: expected key=value, e.g. "
                              "batch_size=2")
        set_dotted(content, key, _scalar(value))
    return content


def dashed_overrides(content: dict[str, Any], overrides: list[str],
                     title: str) -> dict[str, Any]:
    """`--section.key=value` or `--section.key value` overrides (torchtitan, HfArgumentParser,
    Axolotl's CLI)."""
    content = copy_data(content)
    items = list(overrides)
    while items:
        text = items.pop(0)
        if not text.startswith("--"):
            raise ConfigError(f"{title} override {text!r}: expected --key=value, e.g. "
                              "--training.local_batch_size=2")
        key, sep, value = text[2:].partition("=")
        if not sep:
            if not items:
                raise ConfigError(f"{title} override {text!r} has no value")
            value = items.pop(0)
        set_dotted(content, key, _scalar(value))
    return content


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set data['a']['b'] for 'a.b', creating sections as needed."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = data.get(part)
        if not isinstance(child, dict):
            child = data[part] = {}
        data = child
    data[leaf] = value


# --- the tables ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """How one key of a format maps to Job fields."""

    key: str
    type: str                       # int, float, bool, str, list, str_or_list
    field: str | None = None        # the Job field the value goes to as it is
    values: dict[str, dict[str, Any]] = _field(default_factory=dict)  # value -> Job fields
    weak: bool = False              # loses silently to a non-weak key setting the field
    auto: bool = False              # "auto" means: left to the launcher (unset)
    strict: bool = False            # a value outside `values` is an error: the key chooses
                                    # what is trained, and a guess would be a wrong number
    source: str = ""


@dataclass(frozen=True)
class Table:
    format: str
    title: str
    framework: str                  # the profile that fills what the file leaves unset
    docs: str
    source: str
    entries: dict[str, Entry]
    ignored: frozenset[str]
    ignored_prefixes: tuple[str, ...]
    defaults: dict[str, Any]        # Job field -> what the framework does when the key is absent
    extra: dict[str, Any]           # the format's own tables (model names, module names)


@lru_cache(maxsize=None)
def load_table(name: str) -> Table:
    text = resources.files("vramplan.frameworks.configs").joinpath(f"{name}.toml").read_text()
    raw = tomllib.loads(text)
    entries = {key: Entry(key=key, **body) for key, body in raw.get("keys", {}).items()}
    ignored = raw.get("ignored", {})
    known = {"title", "framework", "docs", "source", "keys", "ignored", "defaults"}
    return Table(format=name, title=raw["title"], framework=raw["framework"],
                 docs=raw["docs"], source=raw["source"], entries=entries,
                 ignored=frozenset(ignored.get("keys", ())),
                 ignored_prefixes=tuple(ignored.get("prefixes", ())),
                 defaults={k: v["value"] for k, v in raw.get("defaults", {}).items()},
                 extra={k: v for k, v in raw.items() if k not in known})


_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "list": (list,),
    "str_or_list": (str, list), "int_or_str": (int, str), "bool_or_str": (bool, str),
}


def value_key(value: Any) -> str:
    """How a file value is spelt in a table's `values`: true/false, numbers as text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --- mapping a file ---------------------------------------------------------------------------


@dataclass
class Mapping:
    """What mapping a file's keys gave: Job fields with the key that set each, and the
    keys sorted into mapped / ignored / not understood."""

    table: Table
    # Job field -> (value, the key that set it, weak)
    assigned: dict[str, tuple[Any, str, bool]] = _field(default_factory=dict)
    mapped: list[str] = _field(default_factory=list)
    ignored: list[str] = _field(default_factory=list)
    not_understood: list[str] = _field(default_factory=list)
    notes: list[str] = _field(default_factory=list)

    def assign(self, dotted: str, value: Any, key: str, *, weak: bool = False) -> None:
        """Set a Job field from `key`; two strong keys that disagree are a conflict."""
        old = self.assigned.get(dotted)
        if old is None or (old[2] and not weak):
            self.assigned[dotted] = (value, key, weak)
            return
        if weak or old[0] == value:
            return
        raise ConfigError(
            f"conflicting settings in this {self.table.title} config: {old[1]} sets "
            f"{dotted}={old[0]!r} but {key} sets {dotted}={value!r}; keep one of them "
            f"({self.table.docs})")

    def job_data(self) -> dict[str, Any]:
        """The Job fields the file set, then the framework's own defaults for what it left
        unset (its code's, e.g. a cfg.get default; the profile fills the rest)."""
        data: dict[str, Any] = {}
        assigned = dict(self.assigned)
        for dotted, value in self.table.defaults.items():
            if dotted not in assigned and not (dotted.startswith("peft.")
                                               and "peft.method" not in assigned):
                assigned[dotted] = (value, "default", True)
        for dotted, (value, _, _) in sorted(assigned.items()):
            set_dotted(data, dotted, value)
        return data


def is_ignored(table: Table, key: str) -> bool:
    return key in table.ignored or key.startswith(table.ignored_prefixes)


def check_type(table: Table, entry: Entry, value: Any) -> None:
    expected = _TYPES[entry.type]
    ok = isinstance(value, expected) and not (isinstance(value, bool) and bool not in expected)
    if entry.type in ("list", "str_or_list") and isinstance(value, list):
        ok = all(isinstance(v, str) for v in value)
    if not ok:
        raise ConfigError(
            f"{table.title} config key {entry.key!r}: expected {entry.type.replace('_', ' ')}, "
            f"got {type(value).__name__} {str(value)[:60]!r} (see {table.docs})")


def map_keys(table: Table, flat: dict[str, Any], mapping: Mapping | None = None,
             *, handled: set[str] = frozenset()) -> Mapping:
    """Map every key of a flattened file through `table`; keys in `handled` were mapped by
    the format's own code already."""
    mapping = mapping or Mapping(table)
    for key, value in flat.items():
        if key in handled:
            continue
        entry = table.entries.get(key)
        if entry is None and value in (None, {}, []):
            mapping.ignored.append(key)  # null: left unset, whatever the key means
            continue
        if entry is None:
            (mapping.ignored if is_ignored(table, key) else mapping.not_understood).append(key)
            continue
        if value is None or (entry.auto and value == "auto"):
            mapping.ignored.append(key)  # unset: the framework's default applies
            continue
        check_type(table, entry, value)
        mapping.mapped.append(key)
        if entry.field:
            mapping.assign(entry.field, value, f"{key}={value!r}", weak=entry.weak)
        if entry.values:
            spelt = value_key(value)
            fields = entry.values.get(spelt, entry.values.get(spelt.lower()))
            if fields is None and entry.strict:
                raise ConfigError(f"{key}: {spelt[:40]} is not modelled; vramplan models "
                                  f"{' or '.join(entry.values)} ({table.docs})")
            if fields is None:
                mapping.mapped.remove(key)
                mapping.not_understood.append(f"{key}={spelt[:40]}")
                continue
            for dotted, target in fields.items():
                mapping.assign(dotted, target, f"{key}={value!r}", weak=entry.weak)
    return mapping


def summary_notes(mapping: Mapping) -> list[str]:
    """The report's lines about the file: what was not understood, what was ignored."""
    notes = list(mapping.notes)
    if mapping.not_understood:
        notes.append(f"{mapping.table.title} keys not understood (not modelled; they may "
                     f"change memory): {', '.join(sorted(mapping.not_understood))}")
    if mapping.ignored:
        notes.append(f"{mapping.table.title} keys ignored as irrelevant to memory and time, "
                     f"or left unset: {', '.join(sorted(mapping.ignored))}")
    return notes
