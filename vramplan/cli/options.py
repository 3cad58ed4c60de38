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
# flag name -> (where the value goes in the Job dict, extra option names, help). The value's
# type (and a Literal's choices) comes from the Job field it sets.

_MODELS = {(): Job, ("peft",): Peft, ("parallel",): Parallel, ("offload",): Offload,
           ("runtime",): Runtime, ("fp8",): Float8}

_JOB_FLAGS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "task": (("task",), (), "the training task (default: the model's own)"),
    "batch_size": (("batch_size",), ("-b",), "micro-batch per GPU"),
    "grad_accum": (("grad_accum",), (), "micro-batches per optimizer step"),
    "seq_len": (("seq_len",), ("-s",), "tokens per sample"),
    "target_len": (("target_len",), (), "decoder tokens (seq2seq, speech)"),
    "image_size": (("image_size",), (), "image side in pixels (vision)"),
    "audio_seconds": (("audio_seconds",), (), "clip length (speech)"),
    "precision": (("precision",), ("-p",), "weights and compute dtypes"),
    "fp8_recipe": (("fp8", "recipe"), (), "with -p fp8: torchao's tensorwise (default), "
                   "rowwise, rowwise_with_gw_hp, or mxfp8 (Blackwell)"),
    "fp8_all_gather": (("fp8", "fsdp_float8_all_gather"), (), "with -p fp8 and fsdp: "
                       "all-gather the block linears' weights in float8 (tensorwise)"),
    "optimizer": (("optimizer",), ("-o",), "the optimizer"),
    "optimizer_impl": (("optimizer_impl",), (), "torch's optimizer implementation"),
    "framework": (("framework",), ("-f",), "whose defaults fill what the job leaves unset "
                  "(vramplan/frameworks/profiles.toml; docs/frameworks.md)"),
    "checkpointing": (("checkpointing",), (), "full recomputes each block; selective keeps "
                      "every matmul output; selective:torchtitan-op recomputes every second "
                      "matmul; selective:every-2nd-layer checkpoints every second block"),
    "attention": (("attention",), (), "sdpa: flash / memory-efficient kernels"),
    "loss": (("loss",), (), "chunked never holds all logits at once"),
    "peft": (("peft", "method"), (), "LoRA adapters, or QLoRA (LoRA on a 4-bit base)"),
    "lora_rank": (("peft", "rank"), (), "LoRA rank"),
    "lora_alpha": (("peft", "alpha"), (), "LoRA alpha"),
    "lora_targets": (("peft", "target_modules"), (),
                     "comma-separated module names, or all-linear (default q_proj,k_proj,"
                     "v_proj,o_proj; GPT-2: c_attn, BERT: query,value, T5: q,v)"),
    "lora_dtype": (("peft", "adapter_dtype"), (), "dtype of LoRA adapters and their states: "
                   "fp32 (peft) or model (torchtune); default fp32, bf16 in a bf16-pure job"),
    "optimizer_in_backward": (("optimizer_in_backward",), (), "step inside backward"),
    "keep_grads": (("keep_grads_between_steps",), (), "zero_grad(set_to_none=False): "
                   "gradients stay allocated into the next forward"),
    "compile": (("compile",), (), "torch.compile each transformer block and the loss"),
    "activation_offload": (("activation_offload",), (), "offload saved activations"),
    "num_gpus": (("parallel", "num_gpus"), ("-n",), "GPUs in the job"),
    "strategy": (("parallel", "strategy"), (), "data-parallel strategy"),
    "tensor_parallel": (("parallel", "tensor_parallel"), ("--tp",), "tensor-parallel degree"),
    "context_parallel": (("parallel", "context_parallel"), ("--cp",),
                         "context-parallel degree"),
    "pipeline_parallel": (("parallel", "pipeline_parallel"), ("--pp",),
                          "pipeline-parallel stages (the blocks split between them)"),
    "pipeline_schedule": (("parallel", "pipeline_schedule"), ("--pp-schedule",),
                          "1f1b, or interleaved (--set parallel.pipeline_chunks=N chunks "
                          "per GPU, default 2)"),
    "offload_optimizer": (("offload", "optimizer"), (), "optimizer states in CPU memory"),
    "offload_params": (("offload", "params"), (), "parameters in CPU memory (zero3/fsdp)"),
    "gpu": (("gpu",), ("-g",), "the GPU to check (default: every catalog GPU)"),
    "cuda_context": (("runtime", "cuda_context_bytes"), (),
                     "memory outside torch's allocator, e.g. 1.2GiB (measure shows it as "
                     "context overhead; default 1390 MiB, an H200's)"),
    "allocator_overhead": (("runtime", "allocator_overhead"), (),
                           "formula: reserved / allocated - 1, e.g. 0.1 (default: planned by "
                           "checkpointing)"),
}
_TEXT_FLAGS = {"lora_targets", "cuda_context"}  # parsed by the Job from text


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


def build_job(model: str | None, job_file: Path | None, flags: dict[str, Any],
              sets: list[str] | None = None) -> Job:
    """CLI flags and --set > job file > defaults, validated into a Job."""
    base = load_job_file(job_file) if job_file else {}
    overrides: dict[str, Any] = {"model": model}
    for text in sets or ():
        *parents, leaf = _set_value(text)[0]
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
    if "peft" in overrides and "method" not in overrides["peft"] and not base.get("peft"):
        overrides["peft"]["method"] = "lora"  # --lora-rank alone means LoRA
    origin = str(job_file) if job_file else "options"
    return job_from_dict(merge_overrides(base, overrides), origin=origin)


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
        inspect.Parameter("sets", keyword, default=None, annotation=Annotated[
            Optional[list[str]], typer.Option(
                "--set", help="any Job field, e.g. --set peft.dropout=0.1 --set "
                "parallel.gpus_per_node=4 (repeatable)")]),
    ] + [inspect.Parameter(name, keyword, default=None, annotation=Annotated[_option(name)])
         for name in _JOB_FLAGS]  # Annotated[(type, option)] == Annotated[type, option]

    @functools.wraps(func)
    def wrapper(**kwargs):
        flags = {name: kwargs.pop(name) for name in _JOB_FLAGS}
        job = build_job(kwargs.pop("model"), kwargs.pop("job_file"), flags, kwargs.pop("sets"))
        return func(job=job, **kwargs)

    wrapper.__signature__ = inspect.Signature(added + own)
    return wrapper


# --- options shared by several commands ------------------------------------------------------

AsJson = Annotated[bool, typer.Option("--json", help="print the result as JSON")]
Out = Annotated[Optional[Path], typer.Option(
    "--out", help="also write the result to this file (JSON; CSV for a .csv sweep)")]
HtmlOut = Annotated[Optional[Path], typer.Option(
    "--html", help="also write a self-contained HTML report (one offline file, no JavaScript)")]
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
    """Write an HTML report made by vramplan.report.html (quietly: --json output stays JSON)."""
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
