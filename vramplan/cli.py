"""The `vramplan` command: a thin shell. Parse flags -> Job -> engine -> view.

Every job flag is optional and overrides the job file (`--job`), which overrides defaults.
Errors vramplan raises on purpose print one line and exit with code 2.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import typing
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from vramplan.errors import VramplanError
from vramplan.job import Job, job_from_dict, load_job_file, merge_overrides
from vramplan.units import GiB, format_count, parse_bytes

app = typer.Typer(
    help="How much GPU memory does a training job need, and where does it fit?",
    no_args_is_help=False, add_completion=False, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console()

# --- the job flags, shared by every command that runs a job ------------------------------
# name -> (flag type, typer.Option, where the value goes in the Job dict)
_JOB_FLAGS: dict[str, tuple[Any, Any, tuple[str, ...]]] = {
    "task": (Optional[str], typer.Option(help="causal-lm, masked-lm, seq-classification, "
                                         "seq2seq, image-classification, speech-seq2seq"),
             ("task",)),
    "batch_size": (Optional[int], typer.Option("--batch-size", "-b", help="micro-batch per GPU"),
                   ("batch_size",)),
    "grad_accum": (Optional[int], typer.Option(help="micro-batches per optimizer step"),
                   ("grad_accum",)),
    "seq_len": (Optional[int], typer.Option("--seq-len", "-s", help="tokens per sample"),
                ("seq_len",)),
    "target_len": (Optional[int], typer.Option(help="decoder tokens (seq2seq, speech)"),
                   ("target_len",)),
    "image_size": (Optional[int], typer.Option(help="image side in pixels (vision)"),
                   ("image_size",)),
    "audio_seconds": (Optional[float], typer.Option(help="clip length (speech)"),
                      ("audio_seconds",)),
    "precision": (Optional[str], typer.Option("--precision", "-p",
                                              help="fp32, fp16-mixed, bf16-mixed, bf16-pure, fp8"),
                  ("precision",)),
    "optimizer": (Optional[str], typer.Option("--optimizer", "-o",
                                              help="sgd, sgd-momentum, adam, adamw, adamw-8bit, "
                                                   "paged-adamw-8bit, adafactor, lion"),
                  ("optimizer",)),
    "optimizer_impl": (Optional[str], typer.Option(help="foreach, fused, loop"),
                       ("optimizer_impl",)),
    "checkpointing": (Optional[str], typer.Option(help="none, selective (keep matmul outputs, recompute the rest), full"),
                      ("checkpointing",)),
    "attention": (Optional[str], typer.Option(help="eager, sdpa (flash)"), ("attention",)),
    "loss": (Optional[str], typer.Option(help="standard, chunked"), ("loss",)),
    "peft": (Optional[str], typer.Option(help="lora or qlora"), ("peft", "method")),
    "lora_rank": (Optional[int], typer.Option(help="LoRA rank"), ("peft", "rank")),
    "lora_alpha": (Optional[float], typer.Option(help="LoRA alpha"), ("peft", "alpha")),
    "lora_targets": (Optional[str], typer.Option(
        help="comma-separated module names, or all-linear (default q_proj,k_proj,v_proj,"
             "o_proj; GPT-2: c_attn, BERT: query,value, T5: q,v)"), ("peft", "target_modules")),
    "optimizer_in_backward": (Optional[bool], typer.Option(
        "--optimizer-in-backward/--no-optimizer-in-backward", help="step inside backward"),
        ("optimizer_in_backward",)),
    "activation_offload": (Optional[bool], typer.Option(
        "--activation-offload/--no-activation-offload", help="offload saved activations"),
        ("activation_offload",)),
    "num_gpus": (Optional[int], typer.Option("--num-gpus", "-n", help="GPUs in the job"),
                 ("parallel", "num_gpus")),
    "strategy": (Optional[str], typer.Option(help="none, ddp, zero1, zero2, zero3, fsdp, "
                                             "hybrid-shard"), ("parallel", "strategy")),
    "tensor_parallel": (Optional[int], typer.Option("--tp", help="tensor-parallel degree"),
                        ("parallel", "tensor_parallel")),
    "context_parallel": (Optional[int], typer.Option("--cp", help="context-parallel degree"),
                         ("parallel", "context_parallel")),
    "offload_optimizer": (Optional[bool], typer.Option(
        "--offload-optimizer/--no-offload-optimizer", help="optimizer states in CPU memory"),
        ("offload", "optimizer")),
    "offload_params": (Optional[bool], typer.Option(
        "--offload-params/--no-offload-params", help="parameters in CPU memory (zero3/fsdp)"),
        ("offload", "params")),
    "gpu": (Optional[str], typer.Option("--gpu", "-g", help="the GPU to check (default: all)"),
            ("gpu",)),
    "cuda_context": (Optional[str], typer.Option(
        help="memory outside torch's allocator, e.g. 1.2GiB (measure shows it as context "
             "overhead; default 1390 MiB, an H200's)"), ("runtime", "cuda_context_bytes")),
    "allocator_overhead": (Optional[float], typer.Option(
        help="formula: reserved / allocated - 1, e.g. 0.1 (default: planned by checkpointing)"),
        ("runtime", "allocator_overhead")),
}


def build_job(model: str | None, job_file: Path | None, flags: dict[str, Any]) -> Job:
    """CLI > job file > defaults, validated into a Job."""
    base = load_job_file(job_file) if job_file else {}
    overrides: dict[str, Any] = {"model": model}
    for name, value in flags.items():
        if value is None:
            continue
        *parents, leaf = _JOB_FLAGS[name][2]
        target = overrides
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = tuple(v.strip() for v in value.split(",")) if name == "lora_targets" else value
    if "peft" in overrides and "method" not in overrides["peft"] and not base.get("peft"):
        overrides["peft"]["method"] = "lora"  # --lora-rank alone means LoRA
    origin = str(job_file) if job_file else "options"
    return job_from_dict(merge_overrides(base, overrides), origin=origin)


def job_command(func):
    """Give a command the MODEL argument, --job and every job flag; it receives `job`."""
    hints = typing.get_type_hints(func, include_extras=True)  # annotations are strings here
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name])
           for p in inspect.signature(func).parameters.values() if p.name != "job"]
    added = [
        inspect.Parameter("model", inspect.Parameter.KEYWORD_ONLY, default=None,
                          annotation=Annotated[Optional[str], typer.Argument(
                              help="catalog name, HF id, config.json or model folder "
                                   "(default: the job file's, else llama-3.1-8b)",
                              show_default=False)]),
        inspect.Parameter("job_file", inspect.Parameter.KEYWORD_ONLY, default=None,
                          annotation=Annotated[Optional[Path], typer.Option(
                              "--job", help="YAML/TOML/JSON job file; flags override it")]),
    ] + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                           annotation=Annotated[kind, option])
         for name, (kind, option, _) in _JOB_FLAGS.items()]

    @functools.wraps(func)
    def wrapper(**kwargs):
        flags = {name: kwargs.pop(name) for name in _JOB_FLAGS}
        job = build_job(kwargs.pop("model"), kwargs.pop("job_file"), flags)
        return func(job=job, **kwargs)

    wrapper.__signature__ = inspect.Signature(added + own)
    return wrapper


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


# --- commands ------------------------------------------------------------------------------


@app.command()
@job_command
def estimate(
    job: Job,
    engine: Annotated[str, typer.Option(help="formula (instant) or trace (exact, needs torch)")]
    = "formula",
    as_json: Annotated[bool, typer.Option("--json", help="print the MemoryReport as JSON")] = False,
    unit: Annotated[str, typer.Option(help="GiB (binary) or GB (decimal)")] = "GiB",
    time_limit: Annotated[float, typer.Option(help="trace only: stop after this many seconds")]
    = 300.0,
) -> None:
    """Peak GPU memory of one training step, by category, and where it fits.

    Example: vramplan estimate llama-3.1-8b -b 4 -s 2048 --peft qlora --gpu L4
    """
    from vramplan.api import run_engine

    if unit not in ("GiB", "GB"):
        raise VramplanError(f"--unit must be GiB or GB (got {unit!r})")
    report = run_engine(job, engine, time_limit_s=time_limit)
    if as_json:
        print_json(report.to_json_dict())
        return
    from vramplan.report.terminal import print_report

    print_report(report, console, unit=unit, highlight_gpu=job.gpu)


@app.command("models")
def models_command(
    family: Annotated[Optional[str], typer.Option(help="e.g. llama, qwen, bert")] = None,
    contains: Annotated[Optional[str], typer.Option(help="part of the name")] = None,
    min_params: Annotated[Optional[str], typer.Option(help="e.g. 1B")] = None,
    max_params: Annotated[Optional[str], typer.Option(help="e.g. 10B")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List the model catalog."""
    from rich.table import Table

    from vramplan.models import list_models

    entries = list_models(family=family, name_contains=contains,
                          min_params=_count(min_params), max_params=_count(max_params))
    if as_json:
        print_json([{"name": e.name, "family": e.family, "params": e.params, "hf_id": e.hf_id,
                     "source": e.source} for e in entries])
        return
    table = Table(title=f"{len(entries)} models")
    for col in ("name", "family", "params", "hf_id", "description"):
        table.add_column(col, justify="right" if col == "params" else "left")
    for e in entries:
        table.add_row(e.name, e.family, format_count(e.params), e.hf_id, e.description)
    console.print(table)


@app.command("gpus")
def gpus_command(
    vendor: Annotated[Optional[str], typer.Option(help="nvidia or amd")] = None,
    min_memory: Annotated[Optional[str], typer.Option(help="e.g. 40GB or 48GiB")] = None,
    contains: Annotated[Optional[str], typer.Option(help="part of the name")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List the GPU catalog (memory, bandwidth, dense TFLOP/s, price)."""
    from rich.table import Table

    from vramplan.hardware import list_gpus

    gpus = list_gpus(vendor=vendor, name_contains=contains,
                     min_memory_bytes=parse_bytes(min_memory) if min_memory else None)
    if as_json:
        print_json([{"name": g.name, "vendor": g.vendor, "memory_bytes": g.memory_bytes,
                     "usable_bytes": g.usable_bytes, "bandwidth_bytes_s": g.bandwidth_bytes_s,
                     "tflops": g.tflops, "price_per_hour": g.price_per_hour,
                     "price_date": g.price_date} for g in gpus])
        return
    table = Table(title=f"{len(gpus)} GPUs (dense TFLOP/s; prices are on-demand USD per hour)")
    for col in ("name", "memory", "usable GiB", "type", "TB/s", "bf16", "fp8", "link",
                "$/h", "price date"):
        table.add_column(col, justify="left" if col in ("name", "type", "link") else "right")
    for g in gpus:
        table.add_row(
            g.name, f"{g.memory_bytes / GiB:.0f} GiB", f"{g.usable_bytes / GiB:.1f}",
            g.memory_type, f"{g.bandwidth_bytes_s / 1e12:.2f}",
            _tf(g.tflops.get("bf16")), _tf(g.tflops.get("fp8")), g.interconnect,
            f"{g.price_per_hour:.2f}" if g.price_per_hour else "-", g.price_date)
    console.print(table)


def _tf(value: float | None) -> str:
    return f"{value:g}" if value else "-"


def _count(text: str | None) -> int | None:
    """'7B' -> 7e9, '350M' -> 3.5e8."""
    if text is None:
        return None
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
    try:
        if text[-1].upper() in scale:
            return int(float(text[:-1]) * scale[text[-1].upper()])
        return int(text)
    except ValueError:
        raise VramplanError(f"cannot read {text!r} as a parameter count: write e.g. 7B or "
                            "350M") from None


@app.callback(invoke_without_command=True)
def _default(ctx: typer.Context) -> None:
    """With no command, estimate the built-in default job: a QLoRA fine-tune of
    Llama-3.1-8B (vramplan/jobs/default.yaml)."""
    if ctx.invoked_subcommand is None:
        from vramplan.api import default_job_path

        ctx.invoke(estimate, model=None, job_file=default_job_path(), engine="formula",
                   as_json=False, unit="GiB", time_limit=300.0,
                   **{name: None for name in _JOB_FLAGS})


def main() -> None:
    try:
        app()
    except VramplanError as error:
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None


# Commands that live in their own modules (they import the helpers above).
from vramplan.commands import measure as _measure_commands  # noqa: E402
from vramplan.commands import search as _search_commands  # noqa: E402

_search_commands.register(app)
_measure_commands.register(app)
