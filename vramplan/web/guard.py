"""Request limits and error bodies for the web app.

Errors are always {"error": one line, "errors": [{"field": "job.batch_size", "message"}]}
so the page can show each message beside its field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi.responses import JSONResponse

_LOCATIONS = ("body", "query", "path")


def error_response(status: int, problems: Sequence[tuple[str, str]]) -> JSONResponse:
    items = [{"field": f, "message": m} for f, m in problems] or [
        {"field": "", "message": "bad request"}]
    summary = "; ".join(f"{i['field']}: {i['message']}" if i["field"] else i["message"]
                        for i in items)
    return JSONResponse({"error": summary[:2000], "errors": items[:50]}, status_code=status)


def validation_errors(errors: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
    """pydantic/FastAPI errors as (field, message): 'job.batch_size', 'must be ...'."""
    out = []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ())]
        if loc and loc[0] in _LOCATIONS:
            loc = loc[1:]
        message = str(error.get("msg", "invalid"))
        message = message.removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message = "unknown field"
        elif error.get("type") == "literal_error":
            message = "must be one of " + message.removeprefix("Input should be ")
        field = ".".join(loc)
        if not field and message.startswith("job.model: "):  # a whole-request check
            field, message = "job.model", message.removeprefix("job.model: ")
        got = error.get("input")
        if isinstance(got, (int, float, str)) and not isinstance(got, bool) and len(str(got)) < 60:
            message += f" (got {got!r})"
        out.append((field, message))
    return out


class RequestGuard:
    """ASGI middleware: 413 for a request body over max_bytes (by header, or by counting);
    415 for a POST whose body is not declared as JSON."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _send_error(send, 413, f"request body larger than {self.max_bytes} "
                                                "bytes")
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope["method"] == "POST" and kind != b"application/json":
            return await _send_error(send, 415, "send the request body as JSON "
                                                "(Content-Type: application/json)")
        seen = 0
        too_large = False

        async def counted():
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        started = False

        async def guarded_send(message):
            nonlocal started
            if too_large and not started:
                started = True
                await _send_error(send, 413, f"request body larger than {self.max_bytes} bytes")
                return
            if not too_large:
                started = started or message["type"] == "http.response.start"
                await send(message)

        await self.app(scope, counted, guarded_send)


async def _send_error(send, status: int, message: str) -> None:
    body = json.dumps({"error": message,
                       "errors": [{"field": "", "message": message}]}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
