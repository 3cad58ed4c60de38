"""The typer app: every command module registers itself here; main() turns errors into
one line on stderr and the exit codes documented in options.py."""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated, Optional

import typer

try:  # typer vendors click from 0.2x on; older versions use click itself
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, UsageError

from vramplan import __version__
from vramplan.cli.commands import (
    calibrate,
    catalog,
    check,
    estimate,
    headroom,
    measure,
    plan,
    schema,
    search,
    serve,
)
from vramplan.cli.options import _JOB_FLAGS, EXIT_BAD_INPUT, EXIT_INTERRUPTED, console
from vramplan.errors import VramplanError

app = typer.Typer(
    help="How much GPU memory does a training job need, and where does it fit?\n\n"
         "Exit codes: 0 fits (or no GPU asked), 1 does not fit the chosen GPU, 2 bad input, "
         "130 interrupted.",
    no_args_is_help=False, add_completion=True, pretty_exceptions_enable=False,
    rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"],
                                             "max_content_width": 80},
)
for module in (estimate, catalog, search, measure, schema, plan, headroom, serve, calibrate,
               check):
    module.register(app)


def _version(value: bool) -> None:
    if value:
        console.print(f"vramplan {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _default(
    ctx: typer.Context,
    version: Annotated[Optional[bool], typer.Option(
        "--version", callback=_version, is_eager=True, help="print the version and exit")]
    = None,
) -> None:
    """With no command, estimate the built-in default job: a QLoRA fine-tune of
    Llama-3.1-8B (vramplan/jobs/default.yaml)."""
    if ctx.invoked_subcommand is None:
        from vramplan.api import default_job_path

        ctx.invoke(estimate.estimate, model=None, job_file=default_job_path(), sets=None,
                   engine="formula", as_json=False, out=None, unit="GiB", time_limit=300.0,
                   **{name: None for name in _JOB_FLAGS})


def _quiet_libraries() -> None:
    """Libraries' import-time chatter (torchao's optional CUDA kernels it cannot load, torch's
    pytree and compile notices, bitsandbytes' optional CPU kernel package, which vramplan
    never uses: its CPU path runs the stand-ins) is not about the user's job: the CLI shows
    its own lines."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # config chatter, not ours
    for name in ("torchao", "torch.utils._pytree", "torch._dynamo", "torch._inductor",
                 "bitsandbytes"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> None:
    """Run the command line; errors vramplan raises on purpose, and usage errors, print one
    line on stderr and exit 2."""
    _quiet_libraries()
    try:
        code = app(args=argv, standalone_mode=False)
    except VramplanError as error:
        _fail(str(error))
    except UsageError as error:
        hint = f" (see: {error.ctx.command_path} --help)" if error.ctx else ""
        _fail(error.format_message().replace("Value error, ", "") + hint)
    except ClickException as error:
        _fail(error.format_message().replace("\n", " "))
    except (KeyboardInterrupt, typer.Abort):
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:  # typer returns Ctrl-C as a bare 130; commands that keep a
        # partial result say so themselves and leave by SystemExit
        sys.stderr.write("interrupted (Ctrl-C)\n")
    raise SystemExit(code if isinstance(code, int) else 0)


def _fail(message: str) -> None:
    text = " ".join(message.split())
    if len(text) > 2000:  # a huge input echoed back stays readable
        text = text[:2000] + " ..."
    sys.stderr.write(f"error: {text}\n")
    raise SystemExit(EXIT_BAD_INPUT)
