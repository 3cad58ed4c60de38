"""Request limits and error bodies for the web app.

Errors are always {"error": one line, "errors": [{"field": "job.batch_size", "message"}]}
so the page can show each message beside its field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi.responses import JSONResponse

from vramplan.errors import describe
from vramplan.job import Job

_LOCATIONS = ("body", "query", "path")


def error_response(status: int, problems: Sequence[tuple[str, str]]) -> JSONResponse:
    items = [{"field": f, "message": m} for f, m in problems] or [
        {"field": "", "message": "bad request"}]
    summary = "; ".join(f"{i['field']}: {i['message']}" if i["field"] else i["message"]
                        for i in items)
    return JSONResponse({"error": summary[:2000], "errors": items[:50]}, status_code=status)


def validation_errors(errors: Iterable[dict[str, Any]],
                      request_model: type | None = None) -> list[tuple[str, str]]:
    """pydantic/FastAPI errors as (field, message), worded as the CLI words a job file's
    (errors.describe): 'job.batch_size', 'Input should be greater than ... (got 0)'. An
    unknown key names the keys allowed where it stands: the Job's, or `request_model`'s
    (the route's request body) beside the job."""
    out = []
    for error in errors:
        loc = tuple(error.get("loc", ()))
        if loc and loc[0] in _LOCATIONS:
            loc = loc[1:]
        in_job = loc[:1] == ("job",)  # a Job's own fields: its keys for an unknown one
        field, message = describe({**error, "loc": loc[1:] if in_job else loc},
                                  Job if in_job else request_model)
        if in_job:
            field = f"job.{field}" if field else "job"
        if not field and message.startswith("job.model: "):  # a whole-request check
            field, message = "job.model", message.removeprefix("job.model: ")
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
