"""Framework profiles: load profiles.toml and apply a profile's defaults to a job's data.

A profile sets Job fields the job leaves unset (explicit fields win) and says which values
of some fields the framework supports. Torch-free, and free of vramplan.job (job.py calls
into here while it validates, so this module must not import it).

    >>> from vramplan.frameworks import get_profile
    >>> get_profile("torchtitan").settings["checkpointing"].value
    'selective:torchtitan-op'
"""

from __future__ import annotations

import tomllib
from functools import lru_cache
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from vramplan.errors import UnknownNameError, VramplanError


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Setting(_Frozen):
    """One default of a framework and where in its code it comes from."""

    value: Any
    source: str
    # a different default for some jobs: {"peft.method=qlora": "full"} (the first match wins)
    value_when: dict[str, Any] = {}

    @field_validator("value", mode="before")
    @classmethod
    def _lists_as_tuples(cls, value: Any) -> Any:
        """A TOML array is a tuple field's value (peft.target_modules): hashable, as the
        Job holds it."""
        return tuple(value) if isinstance(value, list) else value


class Allowed(_Frozen):
    """The values of one Job field the framework supports."""

    values: tuple[Any, ...]
    source: str


class Profile(_Frozen):
    name: str
    description: str
    settings: dict[str, Setting] = {}  # dotted Job field -> its default in this framework
    allowed: dict[str, Allowed] = {}   # dotted Job field -> the values it supports


class ProfileFileError(VramplanError):
    """profiles.toml is malformed (a packaging bug, not a user error)."""


@lru_cache(maxsize=1)
def load_profiles() -> dict[str, Profile]:
    text = resources.files("vramplan.frameworks").joinpath("profiles.toml").read_text()
    try:
        raw = tomllib.loads(text)["profiles"]
        return {name: Profile(name=name, **body) for name, body in raw.items()}
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValidationError) as error:
        raise ProfileFileError(f"vramplan/frameworks/profiles.toml is malformed: {error}") from None


def framework_names() -> tuple[str, ...]:
    return tuple(load_profiles())


def get_profile(name: str) -> Profile:
    try:
        return load_profiles()[name]
    except KeyError:
        raise UnknownNameError("framework", name, load_profiles()) from None


def apply_profile(data: dict[str, Any]) -> dict[str, Any]:
    """The job data with its framework's defaults filled in where the data sets nothing.

    `data` is what a Job is validated from (keyword arguments, a job file, CLI flags);
    nested parts may be dicts or already-built models. Unknown frameworks are left for the
    Job's own validation to report.
    """
    profile = load_profiles().get(data.get("framework", "plain"))
    if profile is None:
        return data
    data = dict(data)
    # fp8.* settings last: they apply only to a job whose precision (its own or the
    # profile's) is fp8
    ordered = sorted(profile.settings.items(), key=lambda item: item[0].startswith("fp8."))
    for dotted, setting in ordered:
        if dotted.startswith("fp8.") and data.get("precision") != "fp8":
            continue
        value = next((v for condition, v in setting.value_when.items()
                      if _matches(data, condition)), setting.value)
        _set_default(data, dotted.split("."), value)
    return data


def redecide_conditional(framework: str, before: BaseModel, changes: dict[str, Any],
                         data: dict[str, Any]) -> dict[str, Any]:
    """`data` (the fields of the built job `before` with `changes`) without the values of the
    profile's conditional settings (value_when) that `before` had from its profile and the
    change left as they were: the profile decides them again for the changed job. (A
    Trainer job switched to QLoRA gets peft's full checkpointing; one switched from DDP to
    FSDP, FSDP's no_sync.) A top-level field the change names is its own, never decided
    again; a nested one is, when it kept its value (callers pass whole parts: parallel=)."""
    profile = load_profiles().get(framework)
    for dotted, setting in (profile.settings.items() if profile else ()):
        if not setting.value_when or dotted in changes:
            continue
        path = dotted.split(".")
        decided = next((v for condition, v in setting.value_when.items()
                        if _matches(before, condition)), setting.value)
        if _value_at(before, path) == decided == _value_at(data, path):
            data = _without(data, path)
    return data


def _value_at(data: Any, path: list[str], defaults: dict[str, Any] | None = None) -> Any:
    """The value at `path` in job data whose parts are dicts or built models (None where
    it is missing; `defaults`: a dict part's value for a key it leaves out)."""
    for key in path:
        data = getattr(data, key, None) if isinstance(data, BaseModel) else (
            data.get(key, (defaults or {}).get(key)) if isinstance(data, dict) else None)
    return data


def _without(data: dict[str, Any], path: list[str]) -> dict[str, Any]:
    """A copy of `data` without the nested key at `path` (nested models become dicts)."""
    data = dict(data)
    if len(path) == 1:
        data.pop(path[0], None)
        return data
    part = data.get(path[0])
    part = part.model_dump() if isinstance(part, BaseModel) else part
    if isinstance(part, dict):
        data[path[0]] = _without(part, path[1:])
    return data


def _matches(data: dict[str, Any], condition: str) -> bool:
    """'peft.method=qlora' (or 'parallel.pipeline_parallel!=1') against job data whose parts
    are dicts or built models."""
    differs = "!=" in condition
    dotted, _, wanted = condition.partition("!=" if differs else "=")
    # the defaults of the fields conditions name (Peft's method, Parallel's strategy, stages
    # and GPUs), for parts the data leaves out
    defaults = {"method": "lora", "strategy": "none", "pipeline_parallel": 1, "num_gpus": 1}
    path = dotted.split(".")
    value = _value_at(data, path, defaults)
    if value is None:  # the whole part is left out (no `parallel` at all)
        value = defaults.get(path[-1])
    return (str(value) == wanted) != differs


def _set_default(data: dict[str, Any], path: list[str], value: Any) -> None:
    key = path[0]
    if len(path) == 1:
        data.setdefault(key, value)
        return
    part = data.get(key)
    if part is None and key not in ("parallel", "fp8"):
        return  # e.g. peft.adapter_dtype on a job without peft
    if part is None:
        part = {}
    if isinstance(part, BaseModel):
        if path[1] not in part.model_fields_set:
            data[key] = part.model_copy(update={path[1]: value})
        return
    if isinstance(part, dict):
        part = dict(part)
        _set_default(part, path[1:], value)
        data[key] = part


def framework_allows(framework: str, dotted: str, value: Any) -> bool:
    """Whether `framework` supports `value` for the Job field `dotted` (search's advice
    uses it to suggest only what the job's framework can do)."""
    profile = load_profiles().get(framework)
    allowed = profile.allowed.get(dotted) if profile else None
    return allowed is None or value in allowed.values


def profile_problems(framework: str, fields: dict[str, Any]) -> list[str]:
    """What the job asks that its framework does not support, one line each.

    `fields` maps dotted Job fields to the job's values (None: the part is absent)."""
    profile = load_profiles().get(framework)
    if profile is None:
        return []
    problems = []
    for dotted, allowed in profile.allowed.items():
        value = fields.get(dotted)
        if value is not None and value not in allowed.values:
            problems.append(f"{framework} does not support {dotted}={value!r}: it supports "
                            f"{', '.join(map(str, allowed.values))} ({allowed.source})")
    return problems
