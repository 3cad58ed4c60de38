"""`vramplan headroom`: how far a job can grow on a GPU before it stops fitting.

    vramplan headroom llama-3.2-1b -b 2 --peft lora --gpu L4
    vramplan headroom llama-3.1-8b --gpu H100-SXM --what-if seq_len=8192,model=llama-3.1-70b
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from vramplan.cli.options import (
    AsJson,
    Out,
    check_writable,
    console,
    job_command,
    json_text,
    print_json,
    write_or_print,
)
from vramplan.engines.runtime import SAFETY_MARGIN
from vramplan.errors import JobError
from vramplan.job import Job

GiB = 2**30


@job_command
def headroom(
    job: Job,
    what_if: Annotated[Optional[str], typer.Option(
        "--what-if", help="Job changes to compare, e.g. seq_len=8192,model=llama-3.1-70b")]
    = None,
    tokens: Annotated[Optional[str], typer.Option(
        help="tokens to train on (what-if time and cost), e.g. 2B")] = None,
    margin: Annotated[float, typer.Option(help="memory to keep free, fraction")] = SAFETY_MARGIN,
    as_json: AsJson = False,
    out: Out = None,
) -> None:
    """Room to grow on --gpu: the largest batch size, sequence length and LoRA rank that
    still fit, the larger models of the same family that fit; --what-if compares memory,
    time and cost before and after any change.

    Example: vramplan headroom llama-3.2-1b -b 2 --gpu L4
    """
    from vramplan.hardware import get_gpu
    from vramplan.planning.amount import TrainingAmount, parse_count
    from vramplan.planning.headroom import headroom as room_for
    from vramplan.planning.headroom import what_if as compare

    if not job.gpu:
        raise JobError("headroom needs the GPU to grow on: add --gpu, e.g. --gpu L4")
    check_writable(out)
    gpu = get_gpu(job.gpu)
    if what_if:
        amount = TrainingAmount(tokens=parse_count(tokens)) if tokens else None
        result = compare(job, gpu, what_if, amount)
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
    from vramplan.report.plan_view import duration, money

    console.print(f"On {result.gpu}, changing {result.changes}:")
    for label, side in (("before", result.before), ("after", result.after)):
        if side.required_bytes is None:
            console.print(f"  {label}: {side.error}")
            continue
        console.print(f"  {label}: {side.required_bytes / GiB:.1f} GiB "
                      f"({'fits' if side.fits else 'does not fit'}), "
                      f"{side.tokens_per_s or 0:,.0f} tokens/s, "
                      f"{duration(side.training_time_s)}, {money(side.cost_usd)}")


def register(app: typer.Typer) -> None:
    app.command("headroom")(headroom)
