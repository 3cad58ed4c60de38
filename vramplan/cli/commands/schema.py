"""`vramplan schema`: the JSON Schema of the documents vramplan reads and writes."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from vramplan.cli.options import print_json


def schema(
    document: Annotated[Literal["report", "job"], typer.Argument(
        help="report (what --json prints) or job (a job file)")] = "report",
) -> None:
    """Print the JSON Schema generated from the pydantic models.

    Example: vramplan schema report > report.schema.json
    """
    from vramplan.schema import job_schema, report_schema

    print_json(report_schema() if document == "report" else job_schema())


def register(app: typer.Typer) -> None:
    app.command("schema")(schema)
