"""Reading the files users bring (job files, framework configs) within caps.

A job file is a few dozen lines and a training config a few hundred. The caps keep a
hostile or mistaken file from taking minutes or gigabytes: /dev/zero reports size 0 and
never ends, and a "billion laughs" YAML nests aliases to expand 1 KB into billions of nodes.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import yaml

MAX_FILE_BYTES = 1_000_000
MAX_YAML_ALIASES = 100
MAX_NODES = 100_000


class FileLimitError(ValueError):
    """A file over one of the caps (the caller names the file)."""


def yaml_problem(error: yaml.YAMLError) -> tuple[str, str]:
    """(" line N" or "", what is wrong) of a YAML error, for one-line messages."""
    mark = getattr(error, "problem_mark", None)
    return (f" line {mark.line + 1}" if mark else "",
            getattr(error, "problem", None) or str(error))


class BoundedYamlLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses more than MAX_YAML_ALIASES alias references."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent, index):  # noqa: ANN001 (PyYAML's signature)
        if self.check_event(yaml.events.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise FileLimitError(f"more than {MAX_YAML_ALIASES} YAML aliases (*name): "
                                     "write the values out")
        return super().compose_node(parent, index)


def read_capped_text(path: Path, what: str, error: type[Exception], hint: str) -> str:
    """The UTF-8 text of a `what` ("job file", "training config"), reading at most the cap;
    errors are `error` with one line that names the file (hint: what such a file holds)."""
    shown = str(path)[:200]
    try:
        if path.is_dir():
            raise error(f"{shown} is a folder; give a {what} (a file)")
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise error(f"{shown}: {size:,} bytes is too large for a {what} (at most "
                        f"{MAX_FILE_BYTES:,}); {hint}")
        with path.open("rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise error(f"{shown}: more than {MAX_FILE_BYTES:,} bytes is too large for a "
                        f"{what}; {hint}")
        return raw.decode("utf-8")
    except FileNotFoundError:
        raise error(f"{what} {shown!r} does not exist") from None
    except (OSError, ValueError) as problem:  # UnicodeDecodeError is a ValueError
        if isinstance(problem, error):
            raise
        raise error(f"cannot read {what} {shown!r}: {problem}") from None


def parse_mapping(text: str, path: Path, what: str, error: type[Exception], *,
                  json_without_suffix: bool = False) -> tuple[dict[str, Any], str]:
    """(content, syntax) of a TOML, JSON or YAML mapping: TOML by suffix, JSON by suffix (or,
    with json_without_suffix, when the text parses as JSON), else YAML under the caps."""
    try:
        if path.suffix == ".toml":
            data, syntax = tomllib.loads(text), "toml"
        elif json_without_suffix:
            data, syntax = _json_else_yaml(text)
        elif path.suffix == ".json":
            data, syntax = json.loads(text), "json"
        else:
            data, syntax = yaml.load(text, Loader=BoundedYamlLoader), "yaml"  # noqa: S506
    except yaml.YAMLError as problem:
        line, why = yaml_problem(problem)
        also = " or JSON" if json_without_suffix else ""
        raise error(f"{path}:{line} is not valid YAML{also}: {why}") from None
    except tomllib.TOMLDecodeError as problem:
        raise error(f"{path}: is not valid TOML: {problem}") from None
    except json.JSONDecodeError as problem:
        raise error(f"{path}: line {problem.lineno} is not valid JSON: {problem.msg}") from None
    except FileLimitError as problem:  # the alias cap
        raise error(f"{path}: {problem}") from None
    except RecursionError:
        raise error(f"{path}: nested too deeply to be a {what}") from None
    if data is None:
        data = {}
    _check_size(data, path, what, error)
    if not isinstance(data, dict):
        raise error(f"{path}: a {what} holds a mapping of keys, not a {type(data).__name__}")
    return data, syntax


def _json_else_yaml(text: str) -> tuple[Any, str]:
    try:
        return json.loads(text), "json"
    except json.JSONDecodeError:
        return yaml.load(text, Loader=BoundedYamlLoader), "yaml"  # noqa: S506 (a SafeLoader)


def _check_size(data: Any, path: Path, what: str, error: type[Exception]) -> None:
    """Count nodes as they expand (a shared alias counts each time), stopping at the cap."""
    stack, seen = [data], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise error(f"{path}: expands to more than {MAX_NODES:,} values; a {what} holds "
                        "far fewer")
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
