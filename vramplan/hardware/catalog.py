"""The GPU catalog: gpus.toml beside this file, plus an optional user file.

    load_gpus(extra_file=None) -> {name: GPU}
    get_gpu("h100 sxm")        -> GPU   (names and aliases; case, '-', '_', ' ' ignored)
    list_gpus(vendor=..., min_memory_bytes=..., name_contains=...) -> [GPU, ...]

The user file has the same layout as gpus.toml. It comes from the `extra_file`
argument, else the VRAMPLAN_GPUS_FILE environment variable, else
~/.config/vramplan/gpus.toml when that exists. An entry whose name (or alias) is
already in the catalog overrides only the keys it gives; a new name adds a GPU and
needs every required key. Units are described at the top of gpus.toml.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from vramplan.errors import UnknownNameError, VramplanError
from vramplan.hardware.gpu import GPU
from vramplan.units import parse_bytes

ENV_VAR = "VRAMPLAN_GPUS_FILE"
DEFAULT_USER_FILE = Path("~/.config/vramplan/gpus.toml")

VENDORS = ("nvidia", "amd", "intel")
DTYPES = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "fp6", "fp4", "int8")

# key in the TOML -> (required for a new GPU, accepted types, description for messages)
_FIELDS: dict[str, tuple[bool, tuple[type, ...], str]] = {
    "vendor": (True, (str,), "one of " + ", ".join(VENDORS)),
    "memory": (True, (str, int), "a size with a unit, e.g. \"80 GiB\", or a number of bytes"),
    "usable": (True, (str, int), "a size with a unit, e.g. \"81559 MiB\", or a number of bytes"),
    "usable_estimated": (False, (bool,), "true or false"),
    "memory_type": (True, (str,), "a string such as \"HBM3\""),
    "bandwidth_gb_s": (True, (int, float), "a positive number of decimal GB/s"),
    "interconnect": (True, (str,), "a string such as \"NVLink 4\""),
    "interconnect_gb_s": (True, (int, float), "a positive number of decimal GB/s, one direction"),
    "gpus_per_node": (False, (int,), "a positive whole number of GPUs in one server"),
    "network_gb_s": (False, (int, float), "a positive number of decimal GB/s per GPU between nodes"),
    "compute_capability": (False, (str,), "a string such as \"9.0\" (\"\" for AMD)"),
    "price_per_hour": (False, (int, float), "a positive number of USD per GPU-hour"),
    "price_date": (True, (str, _dt.date), "a date written YYYY-MM-DD"),
    "price_provider": (False, (str,), "a string"),
    "aliases": (False, (list,), "a list of strings"),
    "notes": (False, (str,), "a string"),
    "tflops": (True, (dict,), "a table of dtype = dense TFLOP/s"),
    "sources": (False, (dict,), "a table of fact = URL"),
}

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


def _check_fields(name: str, entry: Mapping[str, Any], source: _Source, *, new: bool) -> None:
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise source.error(name, f"unknown key(s) {', '.join(unknown)}; "
                                 f"allowed: {', '.join(_FIELDS)}")
    if new:
        missing = [k for k, (req, _, _) in _FIELDS.items() if req and k not in entry]
        if missing:
            raise source.error(name, f"missing required key(s) {', '.join(missing)} "
                                     "(a GPU not in the built-in catalog needs all of them)")
    for key, value in entry.items():
        _, types, what = _FIELDS[key]
        # bool is an int subclass: reject true/false where a number is wanted.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise source.error(name, f"{key} must be {what} (got {value!r})")


def _positive(name: str, key: str, value: Any, source: _Source) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise source.error(name, f"{key} must be a positive number (got {value!r})")
    return float(value)


def _bytes(name: str, key: str, value: Any, source: _Source) -> int:
    try:
        n = parse_bytes(value)
    except VramplanError as e:
        raise source.error(name, f"{key}: {e}") from None
    if n <= 0:
        raise source.error(name, f"{key} must be more than 0 bytes (got {value!r})")
    return n


def _build(name: str, raw: Mapping[str, Any], source: _Source) -> dict[str, Any]:
    """Validate a complete merged entry and return GPU keyword arguments."""
    vendor = raw["vendor"].lower()
    if vendor not in VENDORS:
        raise source.error(name, f"vendor must be one of {', '.join(VENDORS)} (got {raw['vendor']!r})")
    memory = _bytes(name, "memory", raw["memory"], source)
    usable = _bytes(name, "usable", raw["usable"], source)
    if usable > memory:
        raise source.error(name, f"usable ({raw['usable']}) is more than memory ({raw['memory']}); "
                                 "memory is the nominal size, usable what the driver reports")
    tflops: dict[str, float] = {}
    for dtype, value in raw["tflops"].items():
        if dtype not in DTYPES:
            raise source.error(name, f"tflops has unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
        tflops[dtype] = _positive(name, f"tflops.{dtype}", value, source)
    if not tflops:
        raise source.error(name, "tflops is empty; give at least fp32")
    price = raw.get("price_per_hour")
    if price is not None:
        price = _positive(name, "price_per_hour", price, source)
    date = raw["price_date"]
    if isinstance(date, _dt.datetime):
        date = date.date()
    if isinstance(date, _dt.date):
        date = date.isoformat()
    try:
        _dt.date.fromisoformat(date)
    except ValueError:
        raise source.error(name, f"price_date must be a date written YYYY-MM-DD (got {date!r})") from None
    aliases = raw.get("aliases", [])
    if not all(isinstance(a, str) and a.strip() for a in aliases):
        raise source.error(name, "aliases must be a list of non-empty strings")
    sources = raw.get("sources", {})
    if not all(isinstance(v, str) for v in sources.values()):
        raise source.error(name, "sources must map each fact to a string (a URL or a description)")
    return dict(
        name=name,
        vendor=vendor,
        memory_bytes=memory,
        usable_bytes=usable,
        memory_type=raw["memory_type"],
        bandwidth_bytes_s=_positive(name, "bandwidth_gb_s", raw["bandwidth_gb_s"], source) * 1e9,
        tflops=tflops,
        interconnect_bytes_s=_positive(name, "interconnect_gb_s", raw["interconnect_gb_s"], source) * 1e9,
        interconnect=raw["interconnect"],
        compute_capability=raw.get("compute_capability", ""),
        gpus_per_node=int(_positive(name, "gpus_per_node", raw.get("gpus_per_node", 8), source)),
        network_bytes_s=_positive(name, "network_gb_s", raw.get("network_gb_s", 12.5), source) * 1e9,
        price_per_hour=price,
        price_date=date,
        aliases=tuple(aliases),
        sources=dict(sources),
        usable_estimated=bool(raw.get("usable_estimated", False)),
        price_provider=raw.get("price_provider", ""),
        notes=raw.get("notes", ""),
    )


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
        _check_fields(name, entry, source, new=target is None)
        if target is None:
            raws[name] = {**entry, "_source": source}
            index.setdefault(_key(name), name)
            continue
        merged = dict(raws[target])
        for key, value in entry.items():
            if key in ("tflops", "sources"):  # tables merge key by key
                merged[key] = {**merged.get(key, {}), **value}
            elif key == "aliases":  # aliases are added to the built-in ones
                merged[key] = [*merged.get(key, []), *(a for a in value if a not in merged.get(key, []))]
            else:
                merged[key] = value
        merged["_source"] = source
        raws[target] = merged


def _check_keys(gpus: Mapping[str, dict[str, Any]]) -> None:
    """Two GPUs must not answer to the same look-up key."""
    seen: dict[str, str] = {}
    for name, kw in gpus.items():
        for label in (name, *kw["aliases"]):
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
    for name, entry in raws.items():
        _check_fields(name, entry, source, new=True)
    return {name: {**entry, "_source": source} for name, entry in raws.items()}


@functools.lru_cache(maxsize=8)
def _load(user_path: str | None, _mtime_ns: int | None) -> dict[str, dict[str, Any]]:
    """GPU keyword arguments by name; cached per user file and its modification time."""
    raws = {name: dict(raw) for name, raw in _builtin_raw().items()}
    if user_path is not None:
        source = _Source(user_path)
        _merge(raws, _read_toml(Path(user_path), source), source)
    gpus = {name: _build(name, raw, raw["_source"]) for name, raw in raws.items()}
    _check_keys(gpus)
    return gpus


def _user_file(extra_file: str | Path | None) -> Path | None:
    if extra_file is not None:
        return Path(extra_file).expanduser()
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return Path(env).expanduser()
    default = DEFAULT_USER_FILE.expanduser()
    return default if default.is_file() else None


def load_gpus(extra_file: str | Path | None = None) -> dict[str, GPU]:
    """All GPUs by catalog name: the built-in catalog merged with the user file (if any)."""
    path = _user_file(extra_file)
    mtime = None
    if path is not None:
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            mtime = None  # _read_toml reports the missing/unreadable file with its name
    gpus = _load(str(path) if path is not None else None, mtime)
    # Fresh objects each call: callers may not mutate the cached dicts.
    return {name: GPU(**{**kw, "tflops": dict(kw["tflops"]), "sources": dict(kw["sources"])})
            for name, kw in gpus.items()}


def _all_labels(gpus: Mapping[str, GPU]) -> list[str]:
    return [label for gpu in gpus.values() for label in (gpu.name, *gpu.aliases)]


def get_gpu(name: str, gpus: Mapping[str, GPU] | None = None) -> GPU:
    """One GPU by name or alias; case, '-', '_' and spaces do not matter.

    Device names as drivers print them ("NVIDIA GeForce RTX 4090") also match.
    """
    gpus = load_gpus() if gpus is None else gpus
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
