"""Errors that vramplan raises on purpose.

    VramplanError            base: every message says what was wrong and what to do
    ├── JobError             a job that is invalid or impossible (bad numbers, bad combinations);
    │                        also a ValueError. Job(...), Peft(...), Job.model_validate(...) raise
    │                        it in place of pydantic's ValidationError, with the same problems
    ├── UnknownNameError     a model, GPU, optimizer ... name that is not in a catalog
    ├── JobFileError         a job file that is missing, unreadable or malformed
    ├── ModelConfigError     a model config that cannot be read or is not supported
    └── EngineError          an engine could not produce a report (unsupported op, time limit)
        └── BudgetExceeded   a measured step needed more than its byte budget (counts as OOM)

The CLI turns any of them into a one-line message and exit code 2. A message is capped at
MAX_MESSAGE characters, so a huge input cannot make a huge error.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

MAX_MESSAGE = 2000


# Values are quoted in messages up to this length: a 50 MB job file must not give a 50 MB
# message.
MAX_QUOTED = 80


def validation_message(errors: Iterable[dict[str, Any]], root: type | None = None,
                       examples: dict[str, object] | None = None) -> str:
    """pydantic's errors (ValidationError.errors()) of a `root` model as one line: each
    field, its problem, what was given and, where `examples` has the field, a good value.
    The one wording of a bad field for the Job, the plan options, the training amount and
    the web API (which shows each (field, problem) of `describe` beside its field)."""
    parts = []
    for error in errors:
        where, what = describe(error, root, examples)
        # an unknown key's problem names the key itself, so it takes no "field: " prefix
        names_itself = not where or error["type"] == "extra_forbidden"
        parts.append(what if names_itself else f"{where}: {what}")
    return "; ".join(parts)


def describe(error: dict[str, Any], root: type | None = None,
             examples: dict[str, object] | None = None) -> tuple[str, str]:
    """One of pydantic's errors as (field, problem): the dotted field below `root`; an
    unknown key's close match and the keys allowed there; a bad value's problem, the value
    (quoted up to MAX_QUOTED characters) and, from `examples`, a good one."""
    where = ".".join(str(p) for p in error["loc"])
    if len(where) > MAX_QUOTED:
        where = where[:MAX_QUOTED - 3] + "..."
    if error["type"] == "extra_forbidden":
        parent = _model_at(error["loc"][:-1], root) if root else None
        known = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(error["loc"][-1]), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        allowed = f"; allowed: {', '.join(known)}" if known else ""
        return where, f"unknown key {where!r}{hint}{allowed}"
    message = error["msg"]
    if error["type"] == "literal_error":
        message = "must be one of " + message.removeprefix("Input should be ")
    message = message.removeprefix("Value error, ")
    got = error.get("input")
    if where and got is not None and not isinstance(got, dict):
        quoted = repr(got)
        if len(quoted) > MAX_QUOTED:
            quoted = quoted[:MAX_QUOTED - 3] + "..."
        message += f" (got {quoted})"
    if where in (examples or {}):
        message += f"; e.g. {examples[where]}"
    return where, message


def _model_at(path: tuple, root: type) -> type | None:
    """The pydantic model of the field at `path` below `root` (None if it is not one)."""
    model = root
    for part in path:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        inner = [a for a in getattr(annotation, "__args__", (annotation,))
                 if isinstance(a, type) and hasattr(a, "model_fields")]
        if not inner:
            return None
        model = inner[0]
    return model


class VramplanError(Exception):
    """Base class of the errors vramplan raises on purpose."""

    def __init__(self, *args: object):
        if args and isinstance(args[0], str) and len(args[0]) > MAX_MESSAGE:
            cut = len(args[0]) - MAX_MESSAGE
            args = (f"{args[0][:MAX_MESSAGE]}... ({cut:,} more characters)", *args[1:])
        super().__init__(*args)


class JobError(VramplanError, ValueError):
    """The job is invalid: a number out of range or an impossible combination. `field`,
    where one field is to blame, is its path in the Job ("parallel.pipeline_chunks"): the
    web page shows the message beside it."""

    def __init__(self, message: str, *, field: str = ""):
        super().__init__(message)
        self.field = field


class UnknownNameError(VramplanError, KeyError):
    """A name that is not in a catalog; the message suggests the closest names."""

    def __init__(self, kind: str, name: str, known: Iterable[str]):
        self.kind, self.name = kind, name
        known = list(known)
        close = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=3, cutoff=0.5)
        by_lower = {k.lower(): k for k in known}
        hint = f" Did you mean {', '.join(repr(by_lower[c]) for c in close)}?" if close else ""
        listing = f" Run `vramplan {kind}s` to list them." if kind in ("model", "gpu") else (
            f" Allowed: {', '.join(sorted(known))}.")
        super().__init__(f"unknown {kind} {name!r}.{hint}{listing}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class JobFileError(VramplanError):
    """A job file that is missing, unreadable or malformed."""


class ModelConfigError(VramplanError):
    """A model config file or folder that cannot be read or is not supported."""


class EngineError(VramplanError):
    """An engine could not produce a report."""


class BudgetExceeded(EngineError):
    """A step allocated more than the byte budget it was given (counts as out of memory)."""
