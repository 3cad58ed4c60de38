"""The GPU catalog: gpus.toml beside this file, plus an optional user file.

    load_gpus(extra_file=None) -> {name: GPU}
    get_gpu("h100 sxm")        -> GPU   (names and aliases; case, '-', '_', ' ' ignored)
    list_gpus(vendor=..., min_memory_bytes=..., name_contains=...) -> [GPU, ...]

The user file has the same layout as gpus.toml. It comes from the `extra_file`
argument, else the VRAMPLAN_GPUS_FILE environment variable, else gpus.toml in the user
config folder (vramplan.config.user_config_dir(): ~/.config/vramplan on Linux) when it
exists. An entry whose name (or alias) is
already in the catalog overrides only the keys it gives; a new name adds a GPU and
needs every required key. Units are described at the top of gpus.toml.
"""

from __future__ import annotations

import functools
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vramplan.config import user_config_dir
from vramplan.errors import UnknownNameError, VramplanError
from vramplan.hardware.gpu import GPU, GpuEntry

ENV_VAR = "VRAMPLAN_GPUS_FILE"

_SEPARATORS = re.compile(r"[-_\s]+")
# Vendor words that device names carry ("NVIDIA GeForce RTX 4090", "AMD Instinct MI300X").
_PREFIXES = ("nvidia", "geforce", "tesla", "quadro", "amd", "instinct", "radeon")


def _key(name: str) -> str:
    """Look-up key: lower case, without '-', '_' and spaces."""
    return _SEPARATORS.sub("", name).lower()


def _strip_prefixes(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if key.startswith(prefix) and len(key) > len(prefix):
                key, changed = key[len(prefix):], True
    return key


class _Source:
    """Where an entry came from, for error messages."""

    def __init__(self, path: str):
        self.path = path

    def error(self, entry: str | None, message: str) -> VramplanError:
        where = f"{self.path}: gpu {entry!r}" if entry else self.path
        return VramplanError(f"GPU catalog {where}: {message}")


def _read_toml(path: Path, source: _Source) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise source.error(None, "file not found") from None
    except OSError as e:
        raise source.error(None, f"cannot read the file ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise source.error(None, f"not valid TOML: {e}") from None
    return _entries(data, source)


def _entries(data: Mapping[str, Any], source: _Source) -> dict[str, Any]:
    extra = sorted(set(data) - {"gpus"})
    if extra:
        raise source.error(None, f"unexpected top-level key(s) {', '.join(extra)}; "
                                 "write each GPU as a [gpus.NAME] table")
    gpus = data.get("gpus", {})
    if not isinstance(gpus, dict):
        raise source.error(None, "'gpus' must be a table of [gpus.NAME] tables")
    for name, entry in gpus.items():
        if not isinstance(entry, dict):
            raise source.error(name, "must be a table ([gpus.NAME] with keys under it)")
    return gpus


def _build(name: str, raw: Mapping[str, Any], source: _Source) -> GPU:
    """Validate a complete merged entry into a GPU; the first problem names its key."""
    try:
        return GpuEntry.model_validate(raw).gpu(name)
    except ValidationError as error:
        first = error.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            message = f"unknown key {key!r}; allowed: {', '.join(GpuEntry.model_fields)}"
        elif first["type"] == "missing":
            missing = [".".join(str(p) for p in e["loc"]) for e in error.errors()
                       if e["type"] == "missing"]
            message = (f"missing required key(s) {', '.join(missing)} (a GPU not in the "
                       "built-in catalog needs all of them)")
        else:
            got = first.get("input")
            message = (f"{key}: {first['msg'].removeprefix('Value error, ')}"
                       + ("" if isinstance(got, dict) else f" (got {got!r})"))
        raise source.error(name, message) from None


def _index(raws: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Look-up key -> catalog name, for names and aliases."""
    index: dict[str, str] = {}
    for name, raw in raws.items():
        for label in (name, *raw.get("aliases", ())):
            index.setdefault(_key(label), name)
    return index


def _merge(raws: dict[str, dict[str, Any]], user: Mapping[str, Any], source: _Source) -> None:
    index = _index(raws)
    for name, entry in user.items():
        target = name if name in raws else index.get(_key(name))
        if target is None:
            raws[name] = {**entry, "_source": source}
            index.setdefault(_key(name), name)
            continue
        merged = dict(raws[target])
        for key, value in entry.items():
            if key in ("tflops", "sources"):  # tables merge key by key
                merged[key] = {**merged.get(key, {}), **value}
            elif key == "aliases":  # aliases are added to the built-in ones
                known = merged.get(key, [])
                merged[key] = [*known, *(a for a in value if a not in known)]
            else:
                merged[key] = value
        merged["_source"] = source
        raws[target] = merged


def _check_keys(gpus: Mapping[str, GPU]) -> None:
    """Two GPUs must not answer to the same look-up key."""
    seen: dict[str, str] = {}
    for name, gpu in gpus.items():
        for label in (name, *gpu.aliases):
            k = _key(label)
            if seen.setdefault(k, name) != name:
                raise VramplanError(
                    f"GPU catalog: {label!r} (gpu {name!r}) looks the same as a name or alias of "
                    f"gpu {seen[k]!r} once case, '-', '_' and spaces are ignored; rename one")


# ---------------------------------------------------------------- loading

def _builtin_path() -> Path:
    return Path(str(resources.files("vramplan.hardware").joinpath("gpus.toml")))


@functools.lru_cache(maxsize=1)
def _builtin_raw() -> dict[str, dict[str, Any]]:
    path = _builtin_path()
    source = _Source(str(path))
    raws = _read_toml(path, source)
    return {name: {**entry, "_source": source} for name, entry in raws.items()}


@functools.lru_cache(maxsize=8)
def _load(user_path: str | None, _mtime_ns: int | None) -> dict[str, GPU]:
    """GPUs by name; cached per user file and its modification time."""
    raws = {name: dict(raw) for name, raw in _builtin_raw().items()}
    if user_path is not None:
        source = _Source(user_path)
        _merge(raws, _read_toml(Path(user_path), source), source)
    gpus = {name: _build(name, {k: v for k, v in raw.items() if k != "_source"},
                          raw["_source"]) for name, raw in raws.items()}
    _check_keys(gpus)
    return gpus


def _user_file(extra_file: str | Path | None) -> Path | None:
    if extra_file is not None:
        return Path(extra_file).expanduser()
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return Path(env).expanduser()
    default = user_config_dir() / "gpus.toml"
    return default if default.is_file() else None


def _cached_gpus(extra_file: str | Path | None = None) -> dict[str, GPU]:
    """The merged catalog as cached (never handed out: see _fresh)."""
    path = _user_file(extra_file)
    mtime = None
    if path is not None:
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            mtime = None  # _read_toml reports the missing/unreadable file with its name
    return _load(str(path) if path is not None else None, mtime)


def _fresh(gpu: GPU) -> GPU:
    """A copy with its own tables: a caller that edits them must not edit the cache."""
    return gpu.model_copy(update={"tflops": dict(gpu.tflops), "sources": dict(gpu.sources)})


def load_gpus(extra_file: str | Path | None = None) -> dict[str, GPU]:
    """All GPUs by catalog name: the built-in catalog merged with the user file (if any)."""
    return {name: _fresh(gpu) for name, gpu in _cached_gpus(extra_file).items()}


def _all_labels(gpus: Mapping[str, GPU]) -> list[str]:
    return [label for gpu in gpus.values() for label in (gpu.name, *gpu.aliases)]


def get_gpu(name: str, gpus: Mapping[str, GPU] | None = None) -> GPU:
    """One GPU by name or alias; case, '-', '_' and spaces do not matter.

    Device names as drivers print them ("NVIDIA GeForce RTX 4090") also match.
    """
    if gpus is None:  # copy only the GPU asked for (estimate asks on every call)
        return _fresh(get_gpu(name, _cached_gpus()))
    if name in gpus:
        return gpus[name]
    wanted = _key(name)
    index: dict[str, str] = {}
    for gpu in gpus.values():
        for label in (gpu.name, *gpu.aliases):
            index.setdefault(_key(label), gpu.name)
    for key in (wanted, _strip_prefixes(wanted)):
        if key in index:
            return gpus[index[key]]
    raise UnknownNameError("gpu", name, _suggestion_labels(gpus, name))


def _suggestion_labels(gpus: Mapping[str, GPU], name: str) -> list[str]:
    """What to suggest from: catalog names first, then aliases (a typo is often of an alias)."""
    return list(dict.fromkeys([*sorted(gpus), *_all_labels(gpus)]))


def list_gpus(vendor: str | None = None, min_memory_bytes: int | None = None,
              name_contains: str | None = None) -> list[GPU]:
    """GPUs, optionally filtered, sorted by usable memory then name."""
    gpus: Iterable[GPU] = load_gpus().values()
    if vendor is not None:
        gpus = [g for g in gpus if g.vendor == vendor.lower()]
    if min_memory_bytes is not None:
        gpus = [g for g in gpus if g.usable_bytes >= min_memory_bytes]
    if name_contains is not None:
        needle = _key(name_contains)
        gpus = [g for g in gpus if any(needle in _key(label) for label in (g.name, *g.aliases))]
    return sorted(gpus, key=lambda g: (g.usable_bytes, g.name))
