"""The model catalog (catalog.toml + configs/*.json beside this file) and model lookup.

load_architecture(ref) accepts a catalog name, a Hugging Face id of a catalog model, a path to
a config.json, or a local model folder holding config.json. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import ModelConfigError, UnknownNameError
from .arch import Architecture
from .derive import architecture_from_config

_HERE = Path(__file__).resolve().parent
CATALOG_FILE = _HERE / "catalog.toml"


@dataclass(frozen=True)
class CatalogEntry:
    name: str           # catalog name, e.g. "llama-3.1-8b"
    hf_id: str          # e.g. "meta-llama/Llama-3.1-8B"
    family: str         # e.g. "llama"
    source: str         # URL of the publisher's config.json
    date: str           # when it was read, YYYY-MM-DD
    description: str
    params: int         # total parameters with the default task head (tied counted once)
    path: Path          # the shipped config.json


def _norm(s: str) -> str:
    return re.sub(r"[-_.\s]", "", s.lower())


def read_config_file(path: str | os.PathLike) -> dict:
    """Parse a config.json; errors name the file (and the line for malformed JSON)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelConfigError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{p}: cannot read config: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelConfigError(
            f"{p}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{p}: a config.json must hold a JSON object, "
                               f"got {type(data).__name__}")
    return data


@lru_cache(maxsize=1)
def _raw_catalog() -> dict[str, dict]:
    try:
        with CATALOG_FILE.open("rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:   # a broken install, not a user error
        raise ModelConfigError(f"{CATALOG_FILE}: cannot read the model catalog: {e}") from None
    return data.get("models", {})


@lru_cache(maxsize=None)
def _catalog_architecture(name: str) -> Architecture:
    meta = _raw_catalog()[name]
    path = _HERE / meta["file"]
    return architecture_from_config(read_config_file(path), name, meta.get("source", ""))


@lru_cache(maxsize=1)
def _entries() -> tuple[CatalogEntry, ...]:
    out = []
    for name, meta in _raw_catalog().items():
        out.append(CatalogEntry(
            name=name, hf_id=meta.get("hf_id", ""), family=meta.get("family", ""),
            source=meta.get("source", ""), date=str(meta.get("date", "")),
            description=meta.get("description", ""),
            params=_catalog_architecture(name).total_params(), path=_HERE / meta["file"]))
    return tuple(out)


@lru_cache(maxsize=1)
def _lookup() -> tuple[dict[str, str], dict[str, set[str]]]:
    """exact (lower-case) key -> name, and normalised key -> names."""
    exact: dict[str, str] = {}
    loose: dict[str, set[str]] = {}
    for name, meta in _raw_catalog().items():
        keys = {name}
        for hf in [meta.get("hf_id", ""), *meta.get("aliases", [])]:
            if hf:
                keys |= {hf, hf.split("/")[-1]}
        for k in keys:
            exact.setdefault(k.lower(), name)
            loose.setdefault(_norm(k), set()).add(name)
    return exact, loose


def list_models(family: str | None = None, name_contains: str | None = None,
                min_params: int | None = None, max_params: int | None = None
                ) -> list[CatalogEntry]:
    """Catalog entries, in catalog order, filtered (family and name_contains ignore case)."""
    out = []
    for e in _entries():
        if family is not None and e.family.lower() != family.lower():
            continue
        needle = (name_contains or "").lower()
        if name_contains is not None and not (needle in e.name.lower()
                                              or needle in e.hf_id.lower()):
            continue
        if min_params is not None and e.params < min_params:
            continue
        if max_params is not None and e.params > max_params:
            continue
        out.append(e)
    return out


# Fine-tuned variants publishers name by a suffix keep the base model's shapes (chat and
# instruction tuning change weights, not the architecture): "Llama-3.1-8B-Instruct",
# "Llama-2-7b-chat-hf", "gemma-2-9b-it", "Qwen3-8B-Base". Variants whose names differ
# otherwise are listed as `aliases` in catalog.toml.
_VARIANT_WORDS = ("instruct", "chat", "it", "base")


def _without_variant_word(ref: str) -> str | None:
    """ref with one variant word (-Instruct, -Chat, -it, -Base) removed from its last path
    component, or None when it has none."""
    head, _, tail = ref.strip().rpartition("/")
    parts = tail.split("-")
    for i, part in enumerate(parts):
        if i > 0 and part.lower() in _VARIANT_WORDS:
            stripped = "-".join(parts[:i] + parts[i + 1:])
            return f"{head}/{stripped}" if head else stripped
    return None


def resolve_catalog_name(ref: str) -> str | None:
    """The catalog name ref refers to (name, hf id or alias, any case, '-', '_', '.' ignored
    when that is unambiguous; an -Instruct/-Chat/-it/-Base variant resolves to its base), or
    None."""
    exact, loose = _lookup()
    if ref.strip().lower() in exact:
        return exact[ref.strip().lower()]
    names = loose.get(_norm(ref), set())
    if len(names) == 1:
        return next(iter(names))
    base = _without_variant_word(ref)
    return resolve_catalog_name(base) if base else None


def _looks_like_hf_id(ref: str) -> bool:
    owner, sep, name = ref.partition("/")
    return bool(sep) and bool(owner) and bool(name) and "/" not in name \
        and not ref.endswith(".json")


def looks_like_factory(ref: str) -> bool:
    """'package.module:factory' (a Python factory, which only trace and measure can build)."""
    return isinstance(ref, str) and _looks_like_factory(ref) and not Path(ref).exists()


def _looks_like_factory(ref: str) -> bool:
    module, sep, attr = ref.partition(":")
    return bool(sep) and bool(attr) and bool(module) and "/" not in module \
        and "\\" not in module and all(p.isidentifier() for p in module.split("."))


def _looks_like_path(ref: str) -> bool:
    return (ref.endswith(".json") or ref.startswith(("/", "./", "../", "~", ".\\"))
            or ref.count("/") > 1 or "\\" in ref)


def load_architecture(ref: str | os.PathLike) -> Architecture:
    """Architecture of a catalog model, a config.json file, or a folder holding config.json."""
    if not isinstance(ref, (str, os.PathLike)):
        raise ModelConfigError(f"model must be a name or a path, got {type(ref).__name__}")
    if isinstance(ref, str):
        if not ref.strip():
            raise UnknownNameError("model", ref, list(_raw_catalog()))
        name = resolve_catalog_name(ref)
        if name is not None:
            return _catalog_architecture(name)
    path = Path(os.path.expanduser(os.fspath(ref)))
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except (OSError, ValueError) as error:  # a name too long for the file system, a NUL byte
        shown = os.fspath(ref)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ModelConfigError(f"{shown!r} is neither a catalog model nor a readable path "
                               f"({getattr(error, 'strerror', None) or error}); run "
                               "`vramplan models` to list the catalog") from None
    if is_dir:
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ModelConfigError(f"{path}: folder has no config.json")
        return architecture_from_config(read_config_file(cfg), str(cfg))
    if is_file:
        return architecture_from_config(read_config_file(path), str(path))
    if isinstance(ref, str) and _looks_like_factory(ref):
        raise ModelConfigError(
            f"{ref!r} is a Python factory: the formula cannot read a model it has no config "
            "for; use --engine trace (it builds the model and traces the step)")
    if not isinstance(ref, str) or _looks_like_path(ref):
        raise ModelConfigError(f"{os.fspath(ref)}: no such file or folder")
    known = list(_raw_catalog()) + [m["hf_id"] for m in _raw_catalog().values() if m.get("hf_id")]
    if _looks_like_hf_id(ref):
        error = UnknownNameError("model", ref, known)
        close = error.args[0].removeprefix(f"unknown model {ref!r}.").strip()
        error.args = (f"unknown model {ref!r}: not in the catalog, and vramplan downloads "
                      "nothing; save its config.json in a folder and pass the folder "
                      f"(`vramplan estimate ./my-model/`). {close}",)
        raise error
    raise UnknownNameError("model", ref, known)
