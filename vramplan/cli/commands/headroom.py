"""`vramplan headroom`: how far a job can grow on a GPU before it stops fitting.

    vramplan headroom llama-3.2-1b -b 2 --peft lora --gpu L4
    vramplan headroom llama-3.1-8b --gpu H100-SXM --what-if seq_len=8192,model=llama-3.1-70b
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from vramplan.cli.options import (
    EXIT_DOES_NOT_FIT,
    AsJson,
    MarginOpt,
    Out,
    check_writable,
    console,
    job_command,
    json_text,
    last_config,
    print_json,
    write_or_print,
)
from vramplan.errors import JobError
from vramplan.fit import SAFETY_MARGIN
from vramplan.job import Job

GiB = 2**30


@job_command
def headroom(
    job: Job,
    what_if: Annotated[Optional[list[str]], typer.Option(
        "--what-if", help="Job changes to compare, e.g. seq_len=8192,model=llama-3.1-70b; "
        "repeat it to compare several variants side by side")] = None,
    tokens: Annotated[Optional[str], typer.Option(
        help="tokens to train on (what-if time and cost), e.g. 2B")] = None,
    margin: MarginOpt = SAFETY_MARGIN,
    as_json: AsJson = False,
    out: Out = None,
) -> None:
    """Room to grow on --gpu: the largest batch size, sequence length and LoRA rank that
    still fit, the larger models of the same family that fit; --what-if compares memory,
    time and cost before and after any change.

    Exit code 1 when the job itself does not fit --gpu (with the margin).

    Example: vramplan headroom llama-3.2-1b -b 2 --gpu L4
    Example: vramplan headroom llama-3.1-8b --gpu H100-SXM --what-if seq_len=8192
    --what-if peft.method=lora,batch_size=8
    """
    from vramplan.hardware import get_gpu
    from vramplan.planning.amount import TrainingAmount, parse_count
    from vramplan.planning.headroom import compare
    from vramplan.planning.headroom import headroom as room_for

    if not job.gpu:
        raise JobError("headroom needs the GPU to grow on: add --gpu, e.g. --gpu L4")
    check_writable(out)
    gpu = get_gpu(job.gpu)
    if what_if:
        amount = TrainingAmount(tokens=parse_count(tokens)) if tokens else None
        result = compare(job, gpu, what_if, amount, margin)
    else:
        result = room_for(job, gpu, margin)
    data = result.model_dump(mode="json")
    if as_json:
        print_json(data)
    elif what_if:
        _print_what_if(result)
    else:
        _print_headroom(result)
    if out:
        write_or_print(out, json_text(data))
    if not (result.before.fits if what_if else result.fits):
        raise typer.Exit(EXIT_DOES_NOT_FIT)


def _print_headroom(room) -> None:
    console.print(f"On {room.gpu}: needs {room.required_bytes / GiB:.1f} of "
                  f"{room.usable_bytes / GiB:.1f} GiB ({'fits' if room.fits else 'does not fit'})")
    for knob in room.knobs:
        largest = "nothing fits" if knob.largest is None else f"{knob.largest:,}" + (
            " (search limit)" if knob.at_search_limit else "")
        console.print(f"  {knob.name}: {knob.current:,} now, up to {largest}")
    for model in room.larger_models:
        console.print(f"  {model.model}: {model.required_bytes / GiB:.1f} GiB, "
                      f"{'fits' if model.fits else 'does not fit'}")


def _print_what_if(result) -> None:
    """One column per variant: memory, fit, speed, time and cost."""
    from rich.table import Table

    from vramplan.views.plan_view import duration, money

    table = Table(title=f"what if, on {result.gpu} (fits: needs <= usable x "
                        f"(1 - {result.margin:g}))")
    table.add_column("")
    sides = [("the job", result.before)] + [
        (_words(v.changes), v.side) for v in result.variants]
    for label, _ in sides:
        table.add_column(label, justify="right", overflow="fold")
    rows = {"GPU": [], "needs GiB": [], "fits": [], "tokens/s": [], "step s": [],
            "training time": [], "cost": []}
    for _, side in sides:
        known = side.required_bytes is not None
        rows["GPU"].append(side.gpu)
        rows["needs GiB"].append(f"{side.required_bytes / GiB:.1f}" if known else "-")
        rows["fits"].append(("yes" if side.fits else "no") if known else "refused")
        rows["tokens/s"].append(f"{side.tokens_per_s:,.0f}" if side.tokens_per_s else "-")
        rows["step s"].append(f"{side.step_time_s:.3f}" if side.step_time_s else "-")
        rows["training time"].append(duration(side.training_time_s))
        rows["cost"].append(money(side.cost_usd))
    for name, cells in rows.items():
        table.add_row(name, *cells)
    console.print(table)
    for label, side in sides:
        if side.error:
            console.print(f"  {label}: {side.error}", soft_wrap=True)
    read = last_config()
    if read is not None:  # each variant in the user's own file
        from vramplan.frameworks.configs.write import config_changes, override_line

        for v in result.variants:
            if v.side.required_bytes is None:
                continue
            changes, missing = config_changes(read, result.before.job, v.side.job)
            line = override_line(read, changes) if changes else ""
            rest = f" (no key in the file for {', '.join(missing)})" if missing else ""
            console.print(f"  {_words(v.changes)} in {read.path.name}: "
                          f"{line or 'nothing to change'}{rest}", soft_wrap=True)


def _words(changes: dict, prefix: str = "") -> str:
    """The changes as the user wrote them: KEY=VALUE pairs, lists in brackets."""
    def text(value) -> str:
        return f"[{','.join(map(str, value))}]" if isinstance(value, list) else str(value)
    return ",".join(_words(v, f"{prefix}{k}.") if isinstance(v, dict)
                    else f"{prefix}{k}={text(v)}" for k, v in changes.items())


def register(app: typer.Typer) -> None:
    app.command("headroom")(headroom)
