"""The job as something a person can rerun: a `vramplan` command line and a YAML job file.

    >>> cli_command(Job(model="gpt2", batch_size=4))
    'vramplan estimate gpt2 --batch-size 4'

Only settings that differ from the defaults are written. Settings without a flag of their
own (LoRA dropout, gpus_per_node, ...) are written as `--set KEY=VALUE`;
`settings_without_flag` names them. The YAML holds them all.
"""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from vramplan.fields import JOB_FIELDS, flag_words
from vramplan.job import Job

# Job field path -> the CLI flag that sets it (the one table of Job fields, vramplan/fields.py)
FLAGS: dict[tuple[str, ...], str] = {f.path: f.written for f in JOB_FIELDS}


def _flatten(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def changed_settings(job: Job) -> dict[tuple[str, ...], Any]:
    """Field path -> value, for every setting that differs from a default Job's (model and
    the peft block count as changed whenever they are set)."""
    data = job.model_dump(mode="json")
    peft = data.pop("peft")
    defaults = _flatten({k: v for k, v in Job().model_dump(mode="json").items() if k != "peft"})
    changed = {path: value for path, value in _flatten(data).items()
               if path == ("model",) or defaults.get(path) != value}
    if peft is not None:
        peft_defaults = _flatten(Job(peft={"method": peft["method"]}).model_dump(mode="json"))
        for key, value in peft.items():
            if key == "method" or peft_defaults.get(("peft", key)) != value:
                changed[("peft", key)] = value
    return changed


def settings_without_flag(job: Job) -> list[str]:
    """Changed settings that have no flag of their own (the command uses --set for them)."""
    return [".".join(path) for path in changed_settings(job)
            if path != ("model",) and path not in FLAGS]


def cli_command(job: Job, command: str = "estimate", extra: tuple[str, ...] = ()) -> str:
    """The `vramplan` command line that builds this job."""
    words = ["vramplan", *command.split(), job.model]
    for path, value in changed_settings(job).items():
        if path == ("model",):
            continue
        if path not in FLAGS:
            words += ["--set", f"{'.'.join(path)}={_yaml_scalar(value)}"]
        else:
            words += flag_words(path, value)
    return " ".join(shlex.quote(w) for w in [*words, *extra])


def _yaml_scalar(value: Any) -> str:
    """A value as --set reads it back (a YAML scalar or flow list)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def job_yaml(job: Job) -> str:
    """The job as a YAML job file (`vramplan estimate --job FILE`): changed settings only."""
    nested: dict[str, Any] = {}
    for path, value in changed_settings(job).items():
        target = nested
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
    return yaml.safe_dump(nested, sort_keys=False)
