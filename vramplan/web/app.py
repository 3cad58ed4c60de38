"""The local web app: a JSON API under /api/v1/ and one page, over the library only.

    >>> from vramplan.web import create_app
    >>> app = create_app()      # uvicorn.run(app, host="127.0.0.1", port=8000)

Every answer comes from the engine registry, vramplan.search and vramplan.views; this
module only turns requests into Jobs and results into JSON or HTML. Errors are JSON
({"error": ..., "errors": [{"field", "message"}]}) with a 4xx code, never a traceback.
"""

from __future__ import annotations

import threading
from importlib import resources
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vramplan.engines.memory_report import MemoryReport
from vramplan.engines.registry import run_engine
from vramplan.errors import UnknownNameError, VramplanError
from vramplan.job import Job, choices
from vramplan.web import schemas
from vramplan.web.guard import RequestGuard, error_response, validation_errors
from vramplan.web.traces import QueueFull, TraceQueue

API = "/api/v1"
MAX_CONCURRENT_PLANS = 2  # plans running at once (each takes up to seconds of CPU)
Format = Literal["json", "html"]


def create_app(*, max_queued_traces: int = 3, trace_grace_s: float = 30.0) -> FastAPI:
    """The app. `max_queued_traces`: traces running or waiting before 429."""
    # FastAPI's own /docs pages load Swagger UI from a CDN: ours is one offline page
    app = FastAPI(title="vramplan", version="1", docs_url=None, redoc_url=None,
                  description="How much GPU memory a training job needs, and where it fits. "
                              "Every request holds a Job, as in a vramplan job file.")
    traces = TraceQueue(max_pending=max_queued_traces, grace_s=trace_grace_s)
    planners = threading.BoundedSemaphore(MAX_CONCURRENT_PLANS)
    app.state.traces = traces
    app.add_middleware(RequestGuard, max_bytes=schemas.MAX_REQUEST_BYTES)
    app.router.add_event_handler("shutdown", traces.close)
    _add_error_handlers(app)
    errors = {code: {"model": schemas.ErrorResponse} for code in (413, 415, 422)}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> HTMLResponse:
        text = (resources.files("vramplan.web") / "page.html").read_text(encoding="utf-8")
        return HTMLResponse(text, headers={"Content-Security-Policy": _CSP,
                                           "X-Content-Type-Options": "nosniff"})

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    def docs() -> HTMLResponse:
        from vramplan.web.docs import api_docs_html
        return _html(api_docs_html(app.openapi()))

    @app.get(f"{API}/models")
    def models(q: str = Query("", max_length=100, description="part of the name or HF id"),
               limit: int = Query(50, ge=1, le=500)) -> list[dict[str, Any]]:
        """Catalog models whose name or HF id contains q (search as you type)."""
        from vramplan.models import list_models

        return [{"name": e.name, "family": e.family, "params": e.params, "hf_id": e.hf_id,
                 "description": e.description}
                for e in list_models(name_contains=q or None)][:limit]

    @app.get(f"{API}/gpus")
    def gpus() -> list[dict[str, Any]]:
        """The GPU catalog: memory, usable memory, bandwidth, dense TFLOP/s, price."""
        from vramplan.hardware import list_gpus

        return [{"name": g.name, "vendor": g.vendor, "memory_bytes": g.memory_bytes,
                 "usable_bytes": g.usable_bytes, "bandwidth_bytes_s": g.bandwidth_bytes_s,
                 "tflops": g.tflops, "price_per_hour": g.price_per_hour,
                 "price_date": g.price_date} for g in list_gpus()]

    @app.get(f"{API}/choices")
    def job_choices() -> dict[str, list[str]]:
        """The allowed values of each of the Job's choices, its default first ("precision",
        "parallel.strategy"): what the page's selects offer."""
        return choices()

    @app.get(f"{API}/allow")
    def allow() -> dict[str, str]:
        """The plan's `allow` names (changes to the maths of training) and what each accepts."""
        from vramplan.planning.options import allow_choices

        return allow_choices()

    @app.get(f"{API}/categories")
    def categories() -> dict[str, str]:
        """The report's memory categories, in order, and what each holds (the words the
        terminal and the HTML report print beside them)."""
        from vramplan.engines.memory_report import CATEGORIES, CATEGORY_HELP

        return {name: CATEGORY_HELP[name] for name in CATEGORIES}

    @app.post(f"{API}/estimate", responses=errors)
    def estimate(body: schemas.EstimateRequest, format: Format = "json") -> Response:
        """The formula engine's MemoryReport (instant), with the command that reproduces it;
        format=html returns the self-contained HTML report instead."""
        report = _estimate(body)
        command = _command(body.job, body.config)
        if format == "html":
            return _html(_report_page(report, command))
        charts = _report_charts(report) if body.charts else None
        return JSONResponse({"report": report.to_json_dict(), "command": command,
                             "charts": charts})

    @app.post(f"{API}/trace", status_code=202, responses={**errors, 429: {
        "model": schemas.ErrorResponse}})
    def trace(body: schemas.TraceRequest) -> schemas.TraceStatus:
        """Queue the exact trace (a worker process runs one at a time); poll its id."""
        try:
            task = traces.submit(body.job.model_dump(mode="json"), body.config,
                                 body.time_limit_s)
        except QueueFull as full:
            raise _TooMany(str(full)) from None
        return _trace_status(task, len(traces.pending()) - 1, charts=False)

    @app.get(f"{API}/trace/{{task_id}}", responses={404: {"model": schemas.ErrorResponse}})
    def trace_status(task_id: str, format: Format = "json", charts: bool = False) -> Response:
        """A queued trace: its state, and when done its report (format=html: the page)."""
        found = traces.get(task_id)
        if found is None:
            raise StarletteHTTPException(404, f"no trace {task_id[:40]!r} (finished traces are "
                                              "kept for a while, then forgotten)")
        task, ahead = found
        if format == "html":
            if task.result is None:
                raise StarletteHTTPException(409, "the trace has no report yet")
            report = MemoryReport.model_validate(_report_fields(task.result))
            return _html(_report_page(report, _command(Job.model_validate(task.job), None)))
        return JSONResponse(_trace_status(task, ahead, charts).model_dump())

    @app.post(f"{API}/search", responses=errors)
    def search(body: schemas.SearchRequest, format: Format = "json") -> Response:
        """Largest batch size or sequence length that fits (formula engine)."""
        import vramplan

        job = body.job
        budget = body.budget_bytes or _usable_of(job)
        oracle = _oracle(body.config)
        find = vramplan.max_batch_size if body.parameter == "batch_size" else vramplan.max_seq_len
        options = {} if body.parameter == "batch_size" else {"granularity": body.granularity}
        maximum = body.maximum
        if body.parameter == "seq_len" and maximum is None:
            maximum = _max_positions(job, body.config)
        result = find(job, oracle, budget, margin=body.margin, maximum=maximum, **options)
        data = result.to_dict()
        if format == "html":
            from vramplan.views.html import search_html
            return _html(search_html(data, job=job.model_dump(mode="json"), command=_command(
                job, body.config, "search " + body.parameter.replace("_", "-"))))
        return JSONResponse(data)

    @app.post(f"{API}/sweep", responses=errors)
    def sweep(body: schemas.SweepRequest, format: Format = "json") -> Response:
        """Peak memory over batch sizes x sequence lengths (formula), with each named GPU's
        limit (usable memory x (1 - margin)) and which points fit it."""
        import vramplan
        from vramplan.fit import limit_bytes, usable_bytes
        from vramplan.hardware import get_gpu

        limits = {}
        for index, name in enumerate(body.gpus):
            try:
                gpu = get_gpu(name)
            except UnknownNameError as error:  # beside the sweep's GPU list, not job.gpu
                return error_response(422, [(f"gpus.{index}", str(error))])
            limits[gpu.name] = limit_bytes(usable_bytes(gpu), body.margin)
        rows = vramplan.sweep(body.job, _oracle(body.config), body.batch_sizes, body.seq_lens)
        for row in rows:
            row["fits_gpu"] = {g: row["device_total"] is not None and row["device_total"] <= v
                               for g, v in limits.items()}
        if format == "html":
            from vramplan.views.html import sweep_html
            return _html(sweep_html(rows, job=body.job.model_dump(mode="json"), limits=limits,
                                    command=_command(body.job, body.config, "sweep")))
        chart = None
        if body.charts:
            from vramplan.views import charts
            chart = charts.figure_svg(*charts.sweep_heatmap_figure(rows, limits))
        return JSONResponse({"rows": rows, "limits": limits, "chart": chart})

    @app.post(f"{API}/plan", responses={**errors, 429: {"model": schemas.ErrorResponse}})
    def plan(body: schemas.PlanRequest, format: Format = "json") -> Response:
        """The planner: GPU types x counts x techniques that fit, with time and cost, the
        cost/time Pareto front and the cheapest, fastest and recommended picks."""
        from vramplan.planning.planner import plan as make_plan

        if body.config is not None:
            raise VramplanError("the planner reads catalog models only: pick one from "
                                "/api/v1/models (an uploaded config works with estimate, "
                                "trace, search and sweep)")
        if not planners.acquire(blocking=False):  # a big plan takes seconds of CPU
            raise _TooMany(f"{MAX_CONCURRENT_PLANS} plans are running; try again shortly")
        try:
            result = _plan(make_plan, body)
        finally:
            planners.release()
        if format == "html":
            from vramplan.views.html import plan_html
            return _html(plan_html(result, job=body.job, command=_command(
                body.job, None, "plan", _plan_words(body))))
        chart = None
        if body.charts and result.candidates:
            from vramplan.views import charts
            chart = charts.figure_svg(*charts.plan_figure(result))
        return JSONResponse({"plan": result.model_dump(mode="json"), "chart": chart})

    @app.post(f"{API}/framework-config", responses=errors)
    def framework_config(body: schemas.FrameworkConfigRequest) -> dict[str, Any]:
        """A training framework's own config read into a Job (post the job to /estimate),
        with what was mapped, ignored and not understood. Reads no file it names."""
        from pathlib import PurePath

        from vramplan.frameworks.configs import read_config_text

        read = read_config_text(body.text, path=PurePath(body.name), format=body.format,
                                overrides=body.overrides, model=body.model, local_files=False)
        return {"job": read.job().model_dump(mode="json"), "format": read.format,
                "notes": list(read.notes), "mapped": list(read.mapped),
                "ignored": list(read.ignored), "not_understood": list(read.not_understood)}

    @app.post(f"{API}/export", responses=errors)
    def export(body: schemas.ExportRequest) -> schemas.ExportResponse:
        """The job as a command line and as a YAML job file."""
        from vramplan.views.command import job_yaml, settings_without_flag

        return schemas.ExportResponse(
            command=_command(body.job, body.config, body.command),
            yaml=job_yaml(body.job), settings_without_flag=settings_without_flag(body.job))

    return app


# --- helpers: requests -> library calls ------------------------------------------------------

_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "img-src data: blob:; connect-src 'self'; form-action 'none'; base-uri 'none'")


class _TooMany(Exception):
    pass


def _formula(job: Job, config: dict | None) -> MemoryReport:
    if config is None:
        return run_engine(job, "formula")
    try:
        return run_engine(job, "formula", model_config=config)
    except (ArithmeticError, ValueError, TypeError, KeyError, AttributeError) as error:
        # an uploaded config with shapes the formula cannot use (e.g. 0 attention heads)
        raise VramplanError(f"the uploaded config.json cannot be estimated: "
                            f"{type(error).__name__}: {str(error)[:200]}") from None


def _estimate(body: schemas.EstimateRequest) -> MemoryReport:
    """The one estimate (vramplan.planning.estimate), as the CLI and the API give it."""
    from vramplan.planning.estimate import compose

    amount = dict(tokens=body.tokens, samples=body.samples, epochs=body.epochs,
                  dataset_samples=body.dataset_samples, price_per_hour=body.price_per_hour,
                  margin=body.margin)
    if body.config is None:
        return compose(body.job, **amount)
    try:
        return compose(body.job, model_config=body.config, **amount)
    except (ArithmeticError, ValueError, TypeError, KeyError, AttributeError) as error:
        raise VramplanError(f"the uploaded config.json cannot be estimated: "
                            f"{type(error).__name__}: {str(error)[:200]}") from None


def _oracle(config: dict | None):
    return lambda job: _formula(job, config)


def _plan(make_plan, body: schemas.PlanRequest):
    return make_plan(body.job, body.options())


def _plan_words(body: schemas.PlanRequest) -> tuple[str, ...]:
    """The `vramplan plan` options of a plan request."""
    from vramplan.planning.options import plan_words
    return plan_words(body.options())


def _usable_of(job: Job) -> int:
    if not job.gpu:
        raise VramplanError("say what to fit in: set job.gpu (its usable memory) or "
                            "budget_bytes")
    from vramplan.hardware import get_gpu
    return get_gpu(job.gpu).usable_bytes


def _max_positions(job: Job, config: dict | None) -> int | None:
    from vramplan.models import architecture_from_config, load_architecture

    arch = (architecture_from_config(config, job.model) if config is not None
            else load_architecture(job.model))
    return arch.max_positions


def _command(job: Job, config: dict | None, command: str = "estimate",
             extra: tuple[str, ...] = ()) -> str:
    from vramplan.views.command import cli_command

    if config is not None:  # the uploaded file, saved beside the command
        job = job.model_copy(update={"model": "config.json"})
    return cli_command(job, command, extra)


def _report_charts(report: MemoryReport) -> dict[str, str]:
    from vramplan.views import charts

    return {name: charts.figure_svg(fig, tips)
            for name, (fig, tips) in charts.report_figures(report).items()}


def _report_page(report: MemoryReport, command: str) -> str:
    from vramplan.views.html import report_html
    return report_html(report, command=command)


def _report_fields(data: dict) -> dict:
    return {k: v for k, v in data.items()
            if k not in ("peak_allocated", "peak_reserved", "device_total")}


def _trace_status(task, ahead: int, charts: bool) -> schemas.TraceStatus:
    import time

    if task.finished is not None:
        state = "done" if task.result is not None else "error"
    else:
        state = "running" if ahead == 0 else "queued"
    end = task.finished or time.monotonic()
    figures = None
    if charts and task.result is not None:
        figures = _report_charts(MemoryReport.model_validate(_report_fields(task.result)))
    return schemas.TraceStatus(
        id=task.id, status=state, position=ahead,
        elapsed_s=round(end - task.started, 2) if task.started else 0.0,
        time_limit_s=task.time_limit_s, error=task.error, report=task.result, charts=figures)


def _html(text: str) -> HTMLResponse:
    return HTMLResponse(text, headers={"Content-Security-Policy": _CSP.replace(
        "script-src 'unsafe-inline'", "script-src 'none'")})


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        body = getattr(request.scope.get("route"), "body_field", None)
        model = body.field_info.annotation if body is not None else None
        return error_response(422, validation_errors(error.errors(), model))

    @app.exception_handler(UnknownNameError)
    async def unknown(request: Request, error: UnknownNameError) -> JSONResponse:
        field = {"gpu": "job.gpu", "model": "job.model"}.get(error.kind, "")
        return error_response(422, [(field, str(error))])

    @app.exception_handler(VramplanError)
    async def refused(request: Request, error: VramplanError) -> JSONResponse:
        field = getattr(error, "field", "")
        return error_response(422, [("job." + field if field else "", str(error))])

    @app.exception_handler(_TooMany)
    async def too_many(request: Request, error: _TooMany) -> JSONResponse:
        return error_response(429, [("", str(error))])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, [("", str(error.detail))])

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        # Never a traceback to the client. An engine that fails on valid input is a bug.
        return error_response(500, [("", f"internal error ({type(error).__name__}); "
                                         "please report the request that caused it")])
