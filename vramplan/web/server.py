"""Run the web app with uvicorn: localhost unless told otherwise."""

from __future__ import annotations

import ipaddress

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
