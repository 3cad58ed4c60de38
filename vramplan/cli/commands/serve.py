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
    _check_port(host, port)  # the URL is printed only once it can be served
    console.print(f"vramplan web app on {server_url(host, port)}  (API: "
                  f"{server_url(host, port)}docs; Ctrl-C stops it)")
    if not is_local(host):
        console.print(f"[bold yellow]warning[/]: --host {host} is not localhost: anyone who "
                      "can reach this machine can use the app (it reads no files and runs no "
                      "user code, but traces use its CPU)")
    run(host, port, max_queued_traces=max_queued_traces)


def _check_port(host: str, port: int) -> None:
    """Bind and release the address, so a port in use (or a host that is not this
    machine's) is one line before any URL is shown, not a uvicorn log after it."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as error:
        raise VramplanError(f"cannot listen on {host}:{port} ({error.strerror or error}); "
                            "choose another --port, or stop what uses it") from None


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
