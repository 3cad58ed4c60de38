"""read_config: a framework's own config file (+ its launcher's overrides) -> Job data.

    >>> read = read_config("recipes/configs/llama3_2/1B_lora_single_device.yaml",
    ...                    overrides=["batch_size=2"])
    >>> read.format, read.job().batch_size, read.notes[:1]

Precedence: vramplan's own flags > the file's overrides > the file > the framework's code
defaults for keys the file leaves out (a `cfg.get(key, default)`) > its profile
(`--framework`, profiles.toml) > the Job's defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramplan.frameworks.configs import (
    accelerate,
    axolotl,
    deepspeed,
    hf,
    llamafactory,
    torchtitan,
    torchtune,
)
from vramplan.frameworks.configs.core import (
    MAX_CONFIG_BYTES,
    ConfigError,
    Mapping,
    parse_text,
    read_text,
    summary_notes,
)
from vramplan.job import Job, job_from_dict, merge_overrides

# detection order: the most specific content first (a torchtune recipe also has batch_size)
_MODULES = {m.NAME: m for m in (torchtune, torchtitan, deepspeed, accelerate, llamafactory,
                                axolotl, hf)}
FORMATS = tuple(_MODULES)
_ALIASES = {"hf": "hf-trainer", "trl": "hf-trainer", "peft": "hf-trainer",
            "training-arguments": "hf-trainer", "llamafactory": "llama-factory"}


@dataclass(frozen=True)
class ConfigRead:
    """A framework config as read: its content, the Job data it gives, and what was not
    used (in `notes`, which the report carries)."""

    format: str
    path: Path
    syntax: str                     # yaml, json or toml: how a patched copy is written
    text: str                       # the file as it was (the writers patch it)
    content: dict[str, Any]         # after the overrides
    data: dict[str, Any]            # Job data (framework included)
    mapped: tuple[str, ...]
    ignored: tuple[str, ...]
    not_understood: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    def job(self, **changes: Any) -> Job:
        """The Job (vramplan's own fields in `changes` win)."""
        return job_from_dict(merge_overrides(self.data, changes), origin=str(self.path))


def detect_format(content: dict[str, Any], syntax: str) -> str | None:
    for name, module in _MODULES.items():
        if module.detect(content, syntax):
            return name
    return None


def read_config(path: str | os.PathLike, *, format: str | None = None,
                overrides: list[str] | tuple[str, ...] = (), model: str | None = None,
                framework: str | None = None) -> ConfigRead:
    """Read a torchtune / torchtitan / HF TrainingArguments (+ peft) / accelerate /
    DeepSpeed / Axolotl / LLaMA-Factory file into Job data; `model` replaces the file's
    model (a local config folder for a Hub id the catalog does not know), `framework` the
    profile of its format."""
    path = Path(os.path.expanduser(os.fspath(path)))
    return read_config_text(read_text(path), path=path, format=format, overrides=overrides,
                            model=model, framework=framework)


def read_config_text(text: str, *, path: Path = Path("config.yaml"), format: str | None = None,
                     overrides: list[str] | tuple[str, ...] = (), model: str | None = None,
                     framework: str | None = None, local_files: bool = True) -> ConfigRead:
    """read_config on a file's text (the web app's upload); `path` names it (its suffix
    says TOML). With local_files=False nothing is read from disk: no DeepSpeed JSON the
    config names, no local model folder (only catalog models)."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path.name}: {len(text):,} characters is too large for a "
                          f"training config (at most {MAX_CONFIG_BYTES:,})")
    content, syntax = parse_text(text, path)
    if format is None:
        format = detect_format(content, syntax)
        if format is None:
            raise ConfigError(
                f"{path}: not a config of any format vramplan reads ({', '.join(FORMATS)}); "
                "name it with --format, or pass a vramplan job file with --job")
    format = _ALIASES.get(format, format)
    if format not in _MODULES:
        raise ConfigError(f"unknown config format {format!r}; allowed: {', '.join(FORMATS)}")
    module = _MODULES[format]
    content = module.apply_overrides(content, list(overrides))
    ctx = Context(path=path, model=model, local_files=local_files)
    mapping = module.read(content, ctx)
    data = mapping.job_data()
    if model is not None:
        data["model"] = model
    data["framework"] = framework or mapping.table.framework
    notes = [f"read from {path.name} ({mapping.table.title} config; keys mapped as "
             f"{mapping.table.source} reads them)"] + summary_notes(mapping)
    if "model" not in data:
        notes.insert(1, f"{path.name} names no model: the default model is used unless one "
                        "is given (the MODEL argument)")
    return ConfigRead(format=format, path=path, syntax=syntax, text=text, content=content,
                      data=data, mapped=tuple(mapping.mapped), ignored=tuple(mapping.ignored),
                      not_understood=tuple(mapping.not_understood), notes=tuple(notes))


@dataclass
class Context:
    """What a format's reader may need beyond the content: where the file is (to find a
    DeepSpeed JSON it names), and the model given on the command line."""

    path: Path
    model: str | None = None
    local_files: bool = True  # False over HTTP: catalog models only, no files it names

    def resolve_model(self, ref: Any, key: str, mapping: Mapping) -> str | None:
        """A catalog name or a local config folder for the model the file names; a Hub id
        the catalog does not know is refused with how to pass a folder."""
        if self.model is not None:
            return None  # the command line names it
        from vramplan.models.catalog import resolve_catalog_name

        if not isinstance(ref, str) or not ref.strip():
            raise ConfigError(f"{mapping.table.title} config key {key!r}: expected a model "
                              f"name, got {ref!r} (see {mapping.table.docs})")
        # a re-upload under another owner (NousResearch/Meta-Llama-3.1-8B) has the shapes of
        # the catalog's model of that name
        name = resolve_catalog_name(ref) or resolve_catalog_name(ref.rstrip("/").rpartition("/")[2])
        if name is not None:
            return name
        for base in (Path.cwd(), self.path.parent) if self.local_files else ():
            folder = base / os.path.expanduser(ref)
            if (folder / "config.json").is_file():
                return str(folder)
        how = ("save its config.json in a folder and pass the folder as the model "
               f"(`vramplan estimate ./my-model/ --config {self.path.name}`)"
               if self.local_files else "name a catalog model (the request's `model`)")
        raise ConfigError(f"{self.path.name}: model {ref!r} ({key}) is not in the catalog, "
                          f"and vramplan downloads nothing: {how}")

    def sibling(self, ref: str) -> Path | None:
        """A file the config names (a DeepSpeed JSON), relative to the working directory or
        to the config's folder (never over HTTP)."""
        for base in (Path.cwd(), self.path.parent) if self.local_files else ():
            candidate = base / os.path.expanduser(ref)
            if candidate.is_file():
                return candidate
        return None
