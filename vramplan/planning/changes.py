"""What differs between two jobs, in words and as the CLI flags that make the change
(plan rows, make-it-fit fixes, search num-gpus), from the one table of Job fields
(vramplan/fields.py): every field with a flag is compared, in the table's order.

    >>> describe_changes(Job(), Job(checkpointing="full"))
    (['checkpointing none -> full'], '--checkpointing full')
"""

from __future__ import annotations

from typing import Any

from vramplan.fields import JOB_FIELDS, flag_words
from vramplan.job import Job, Peft


def _value(job: Job, path: tuple[str, ...]) -> Any:
    value: Any = job
    for part in path:
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def describe_changes(before: Job, after: Job) -> tuple[list[str], str]:
    """What differs between two jobs, in words and as CLI flags. Adapters added to a job
    without them show their method and rank, and whatever else differs from the
    method's defaults."""
    reference = before
    added = before.peft is None and after.peft is not None
    if added:
        defaults = Peft(method=after.peft.method).model_copy(update={"rank": 0, "method": None})
        reference = before.model_copy(update={"peft": defaults})
    changes, flags = [], []
    for row in JOB_FIELDS:
        old, new = _value(reference, row.path), _value(after, row.path)
        if old == new:
            continue
        name = ".".join(row.path)
        changes.append(f"{name} {_shown(new)}" if added and row.path[0] == "peft"
                       else f"{name} {_shown(old)} -> {_shown(new)}")
        flags += flag_words(row.path, new)
    return changes, " ".join(flags)


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return "-" if value is None else str(value)
