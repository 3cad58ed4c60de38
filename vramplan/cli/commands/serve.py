"""`vramplan serve`: the local web app (FastAPI on uvicorn), on localhost by default.

    vramplan serve                       # http://127.0.0.1:8000/
    vramplan serve --host 0.0.0.0        # reachable by others: prints a warning
"""

from __future__ import annotations

from typing import Annotated

import typer

from vramplan.cli.options import console
from vramplan.errors import VramplanError


def serve(
    host: Annotated[str, typer.Option(help="address to listen on; anything but localhost "
                                      "lets others on the network use the app")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port")] = 8000,
    max_queued_traces: Annotated[int, typer.Option(
        min=1, max=100, help="traces running or waiting before new ones get 429")] = 3,
) -> None:
    """Serve the web app: live estimates, traces, search, sweep, downloads, and a JSON API
    under /api/v1/ (OpenAPI page at /docs). Ctrl-C stops it.

    Example: vramplan serve --port 8080
    """
    try:
        from vramplan.web.server import is_local, server_url
        from vramplan.web.server import serve as run
    except ImportError as error:
        raise VramplanError(f"vramplan serve needs the web extra ({error.name} is missing): "
                            "pip install 'vramplan[web]'") from None
    console.print(f"vramplan web app on {server_url(host, port)}  (API: "
                  f"{server_url(host, port)}docs; Ctrl-C stops it)")
    if not is_local(host):
        console.print(f"[bold yellow]warning[/]: --host {host} is not localhost: anyone who "
                      "can reach this machine can use the app (it reads no files and runs no "
                      "user code, but traces use its CPU)")
    run(host, port, max_queued_traces=max_queued_traces)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
