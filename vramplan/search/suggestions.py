"""What to try when nothing fits, by the category that fills memory: the techniques
table the planner uses (vramplan.planning.techniques), less what the job already does."""

from __future__ import annotations

from typing import Any

from vramplan.frameworks import framework_allows
from vramplan.job import Job
from vramplan.planning.techniques import Technique, for_category

# Beyond the table: what no job change fixes
_LAST_RESORT = {
    "weights": "a GPU with more memory",
    "allocator_overhead": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (fragmentation)",
    "runtime_context": "a GPU with more memory: the CUDA context alone does not fit",
    "inputs": "a shorter sequence or smaller images",
}


def suggestions_for(job: Job, category: str) -> list[str]:
    """One line per technique that shrinks `category` and that the job does not use yet:
    what it saves, the flags to paste, and what it costs in time."""
    lines = [f"{t.name} ({t.flags}): {t.memory}; time: {t.time}"
             for t in for_category(category)
             if not _in_use(job, t) and _framework_supports(job, t.changes)]
    return lines + ([_LAST_RESORT[category]] if category in _LAST_RESORT else [])


def _in_use(job: Job, technique: Technique) -> bool:
    """Does the job already do what the technique changes? Placeholders ("N", "smaller")
    count as not in use, except where the job shows it (accumulation, GPUs)."""
    if technique.name == "gradient accumulation":
        return job.batch_size == 1
    return _matches(job.model_dump(), technique.changes)


def _matches(current: dict[str, Any], changes: dict[str, Any]) -> bool:
    for key, wanted in changes.items():
        have = current.get(key)
        if isinstance(wanted, dict):
            if not isinstance(have, dict) or not _matches(have, wanted):
                return False
        elif wanted in ("N", "smaller", "larger") or have != wanted:
            return False
    return True


def _framework_supports(job: Job, changes: dict[str, Any], prefix: str = "") -> bool:
    """The job's framework can make these changes (torchtitan has no 8-bit optimizer and
    no QLoRA, torchtune no ZeRO; vramplan/frameworks/profiles.toml)."""
    for key, wanted in changes.items():
        dotted = f"{prefix}{key}"
        if isinstance(wanted, dict):
            if not _framework_supports(job, wanted, dotted + "."):
                return False
        elif not framework_allows(job.framework, dotted, wanted):
            return False
    return True
