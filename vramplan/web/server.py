"""Run the web app with uvicorn: localhost unless told otherwise."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from contextlib import contextmanager

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def is_local(host: str) -> bool:
    """True for loopback addresses and 'localhost'."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_url(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, max_queued_traces: int = 3,
          log_level: str = "warning") -> None:
    """Serve until interrupted. The caller prints server_url() and, when not is_local(host),
    a warning that anyone who can reach the address can use the app."""
    import uvicorn

    from vramplan.web.app import create_app

    uvicorn.run(create_app(max_queued_traces=max_queued_traces), host=host, port=port,
                log_level=log_level, server_header=False)


@contextmanager
def running_server(host: str = DEFAULT_HOST, port: int = 0, **app_options):
    """The app on uvicorn in a background thread (tests, benchmarks, screenshots); yields
    its URL. port 0 picks a free port."""
    import uvicorn

    from vramplan.web.app import create_app

    if port == 0:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    app = create_app(**app_options)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the web app did not start on {host}:{port}")
            time.sleep(0.05)
        yield server_url(host, port)
    finally:
        server.should_exit = True
        thread.join(10)
        app.state.traces.close()
