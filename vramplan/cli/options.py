"""What every command shares: the console, the job flags (generated from the Job's own
types), `--job` and `--set`, output files, and the exit codes.

Exit codes a script can rely on:
    0  it fits (or no GPU was asked about)       1  it does not fit the chosen --gpu
    2  bad input (one line on stderr)          130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import os
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml
from rich.console import Console

from vramplan.errors import JobError
from vramplan.fields import JOB_FIELDS
from vramplan.job import (
    Float8,
    Job,
    Offload,
    Parallel,
    Peft,
    Runtime,
    job_from_dict,
    load_job_file,
    merge_overrides,
)

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

console = Console()


def _finite(data: Any) -> Any:
    """inf and NaN have no JSON spelling (json.dumps would write Infinity): they become null."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def json_text(data: Any) -> str:
    """Standard JSON (RFC 8259) for --json and --out, whatever the numbers inside."""
    return json.dumps(_finite(data), indent=2, allow_nan=False) + "\n"


def print_json(data: Any) -> None:
    sys.stdout.write(json_text(data))


# --- the job flags -----------------------------------------------------------------------------
# flag name -> (where the value goes in the Job dict, extra option names, help), from the one
# table of Job fields (vramplan/fields.py). The value's type (and a Literal's choices) comes
# from the Job field it sets.

_MODELS = {(): Job, ("peft",): Peft, ("parallel",): Parallel, ("offload",): Offload,
           ("runtime",): Runtime, ("fp8",): Float8}

_JOB_FLAGS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    f.name: (f.path, f.short, f.help) for f in JOB_FIELDS}
_TEXT_FLAGS = {f.name for f in JOB_FIELDS if f.text}  # parsed by the Job from text


def _field_type(path: tuple[str, ...]) -> Any:
    """The CLI type of a Job field: its annotation without None (Literal choices kept)."""
    annotation = _MODELS[path[:-1]].model_fields[path[-1]].annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union or type(annotation).__name__ == "UnionType":
        annotation = args[0] if len(args) == 1 else annotation
    return annotation


def _option(name: str) -> tuple[Any, Any]:
    path, extra, help_text = _JOB_FLAGS[name]
    kind = str if name in _TEXT_FLAGS else _field_type(path)
    flag = "--" + name.replace("_", "-")
    names = [flag, *extra]
    if kind is bool:
        names = [f"{flag}/--no-{flag[2:]}"]
    return Optional[kind], typer.Option(*names, help=help_text, show_default=False)


def _set_value(text: str) -> tuple[list[str], Any]:
    """'peft.dropout=0.1' -> (['peft', 'dropout'], 0.1); values read as YAML scalars."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise JobError(f"--set takes KEY=VALUE, e.g. --set peft.dropout=0.1 (got {text!r})")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return key.strip().split("."), parsed


# Job sections (sub-models) by name, and whether null is one of their values (peft: none)
_SECTIONS = {path[0]: Job.model_fields[path[0]].default is None for path in _MODELS if path}


def _whole_section(text: str, key: str, value: Any) -> bool:
    """`--set SECTION=VALUE`: True for null on a section that may be null (peft=null: no
    adapters); a mapping merges like a job file's; anything else is refused by name."""
    if key not in _SECTIONS or isinstance(value, dict):
        return False
    if value is None and _SECTIONS[key]:
        return True
    fields = ", ".join(sorted(_MODELS[(key,)].model_fields))
    null = f", or --set {key}=null for none" if _SECTIONS[key] else ""
    raise JobError(f"--set {text!r}: {key} is a section of the job, not a value: set its "
                   f"fields, e.g. --set {key}.FIELD=VALUE ({fields}){null}")


def build_job(model: str | None, job_file: Path | None, flags: dict[str, Any],
              sets: list[str] | None = None, config: Path | None = None,
              config_format: str | None = None, overrides: list[str] | None = None) -> Job:
    """CLI flags and --set > job file (or a framework's config, --config) > defaults,
    validated into a Job."""
    if config is not None:
        if job_file is not None:
            raise JobError("--config and --job both describe the job: give one of them")
        from vramplan.frameworks.configs import read_config

        read = read_config(config, format=config_format, overrides=overrides or (),
                           model=model, framework=flags.get("framework"))
        _LAST_CONFIG[:] = [read]
        base, job_file = read.data, config
    elif overrides:
        raise JobError(f"unexpected arguments {' '.join(overrides)[:80]!r}: key=value "
                       "overrides go with --config (use --set for a Job field)")
    else:
        base = load_job_file(job_file) if job_file else {}
    overrides: dict[str, Any] = {"model": model}
    cleared: set[str] = set()  # sections --set to null
    for text in sets or ():
        path = _set_value(text)[0]
        if len(path) == 1 and _whole_section(text, path[0], _set_value(text)[1]):
            cleared.add(path[0])
            continue
        *parents, leaf = path
        target = overrides
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise JobError(f"--set {text!r}: {part!r} is not a section of the job")
        target[leaf] = _set_value(text)[1]
    for name, value in flags.items():
        if value is None:
            continue
        *parents, leaf = _JOB_FLAGS[name][0]
        target = overrides
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = tuple(v.strip() for v in value.split(",")) if name == "lora_targets" \
            else value
    for key in cleared & set(overrides):
        raise JobError(f"--set {key}=null (none) conflicts with the {key} options also given: "
                       "drop one of them")
    if "peft" in overrides and "method" not in overrides["peft"] and not base.get("peft"):
        overrides["peft"]["method"] = "lora"  # --lora-rank alone means LoRA
    origin = str(job_file) if job_file else "options"
    merged = merge_overrides(base, overrides)
    merged.update(dict.fromkeys(cleared))  # over the job file's section too
    return job_from_dict(merged, origin=origin)


# The framework config (--config) the running command's job was read from: the command
# shows its notes and writes fixes back in its format. Set by job_command for each call.
_LAST_CONFIG: list[Any] = []


def last_config() -> Any:
    """The ConfigRead of this command's --config, or None."""
    return _LAST_CONFIG[0] if _LAST_CONFIG else None


def config_notes() -> list[str]:
    """What the --config file left out or did not understand (the report's notes)."""
    read = last_config()
    return list(read.notes) if read is not None else []


def job_command(func):
    """Give a command the MODEL argument, --job, --set and every job flag; it gets `job`."""
    hints = typing.get_type_hints(func, include_extras=True)
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name])
           for p in inspect.signature(func).parameters.values() if p.name != "job"]
    keyword = inspect.Parameter.KEYWORD_ONLY
    added = [
        inspect.Parameter("model", keyword, default=None, annotation=Annotated[
            Optional[str], typer.Argument(
                help="catalog name, HF id, config.json, model folder or package.module:"
                     "factory (default: the job file's, else llama-3.1-8b)",
                show_default=False)]),
        inspect.Parameter("job_file", keyword, default=None, annotation=Annotated[
            Optional[Path], typer.Option("--job", help="YAML/TOML/JSON job file; flags "
                                         "override it")]),
        inspect.Parameter("overrides", keyword, default=None, annotation=Annotated[
            Optional[list[str]], typer.Argument(
                help="with --config: the framework's own overrides (torchtune key=value; "
                "after --, torchtitan --section.key=value)", show_default=False)]),
        inspect.Parameter("config", keyword, default=None, annotation=Annotated[
            Optional[Path], typer.Option("--config", help="the framework's own config: "
                                         "torchtune / torchtitan / HF TrainingArguments / "
                                         "accelerate / DeepSpeed / Axolotl / LLaMA-Factory "
                                         "(docs/frameworks.md)")]),
        inspect.Parameter("config_format", keyword, default=None, annotation=Annotated[
            Optional[str], typer.Option("--format", help="the --config file's format "
                                        "(default: detected from its content)")]),
        inspect.Parameter("sets", keyword, default=None, annotation=Annotated[
            Optional[list[str]], typer.Option(
                "--set", help="any Job field, e.g. --set peft.dropout=0.1 --set "
                "parallel.gpus_per_node=4 (repeatable)")]),
    ] + [inspect.Parameter(name, keyword, default=None, annotation=Annotated[_option(name)])
         for name in _JOB_FLAGS]  # Annotated[(type, option)] == Annotated[type, option]

    @functools.wraps(func)
    def wrapper(**kwargs):
        flags = {name: kwargs.pop(name) for name in _JOB_FLAGS}
        # (a caller may leave out the --config options: the CLI root's default command)
        model, overrides = kwargs.pop("model"), list(kwargs.pop("overrides", None) or ())
        config = kwargs.pop("config", None)
        if config is not None and model is not None and ("=" in model or
                                                         model.startswith("-")):
            model, overrides = None, [model, *overrides]  # `--config F batch_size=2`
        _LAST_CONFIG.clear()
        job = build_job(model, kwargs.pop("job_file"), flags, kwargs.pop("sets"), config,
                        kwargs.pop("config_format", None), overrides)
        return func(job=job, **kwargs)

    wrapper.__signature__ = inspect.Signature(added + own)
    return wrapper


# --- options shared by several commands ------------------------------------------------------

AsJson = Annotated[bool, typer.Option("--json", help="print the result as JSON")]
Out = Annotated[Optional[Path], typer.Option(
    "--out", help="also write the result to this file (JSON; CSV for a .csv sweep)")]
HtmlOut = Annotated[Optional[Path], typer.Option(
    "--html", help="also write a self-contained HTML report (one offline file, no JavaScript)")]


def _check_margin(value: float) -> float:
    from vramplan.fit import check_margin
    try:
        return check_margin(value)
    except JobError as error:
        raise typer.BadParameter(str(error)) from None


# One margin option for every command, with vramplan.fit's range
MarginOpt = Annotated[float, typer.Option(
    "--margin", callback=_check_margin, help="safety margin, 0 to 0.5: it fits when it needs "
    "at most usable x (1 - margin); the same margin everywhere")]
EngineName = Annotated[str, typer.Option(
    help="formula (instant), trace (exact, no GPU) or measure (real steps on this machine)")]


def require_charts(*paths: Path | None) -> None:
    """--html and --plot draw with matplotlib (the `plot` extra): say so in one line before
    any work, in place of a ModuleNotFoundError at the end."""
    import importlib.util

    if any(p is not None for p in paths) and importlib.util.find_spec("matplotlib") is None:
        raise JobError("--html and --plot draw their charts with matplotlib, which this "
                       "install lacks: pip install 'vramplan[plot]' (make run installs it)")


def check_writable(*paths: Path | None) -> None:
    """Refuse an output path that cannot be written before any work is done."""
    for path in paths:
        if path is None:
            continue
        parent = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            raise JobError(f"cannot write {str(path)!r}: it is a folder; give a file name")
        if not parent.is_dir():
            raise JobError(f"cannot write {str(path)!r}: folder {str(parent)!r} does not exist")
        if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise JobError(f"cannot write {str(path)!r}: permission denied; choose another "
                           "path")


def write_or_print(path: Path, text: str) -> bool:
    """Write a finished result; if that fails now (disk full ...), print it instead so the
    result is never lost. Returns whether the file was written."""
    try:
        path.write_text(text)
        return True
    except OSError as error:
        sys.stderr.write(f"error: could not write {path} ({error.strerror or error}); the "
                         "result follows on stdout\n")
        sys.stdout.write(text)
        return False


def write_html(path: Path, text: str) -> None:
    """Write an HTML report made by vramplan.views.html (quietly: --json output stays JSON)."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise JobError(f"could not write {str(path)!r} ({error.strerror or error})") from None


@contextlib.contextmanager
def progress(message: str, *, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """A spinner with `message` while a long operation runs (trace, search, plan, measure);
    yields a function that updates its text. Silent with --json or when stdout is not a
    terminal, so piped output stays clean."""
    if quiet or not console.is_terminal:
        yield lambda text: None
        return
    with console.status(message) as status:
        yield lambda text: status.update(f"{message}: {text}")


def counting(oracle: Callable[[Job], Any], update: Callable[[str], None], field: str):
    """The oracle, reporting each trial's value to a progress display."""
    trials = 0

    def ask(job: Job) -> Any:
        nonlocal trials
        trials += 1
        update(f"trial {trials}, {field.replace('_', ' ')} {getattr(job, field)}")
        return oracle(job)
    return ask
