"""The HTTP server app: Open Inference Protocol v2 (with Triton's extensions), served
pipelines, ``/metrics`` and the dashboard, behind optional bearer-token auth.

Routes: ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2``, ``GET /metrics``; the
model routes of ``http.models``; for served pipelines ``GET /v1/pipelines``,
``POST /v1/pipelines/{p}/events`` and the WebSocket ``/v1/pipelines/{p}/ws`` (``http.events``)
and the dashboard. Every error, unmatched
routes and methods included, is JSON ``{"error": ...}`` with its status (``http.errors``).
Nothing from a request is ever unpickled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import Receive, Scope, Send

from aisp.admission.ratelimit import Limiter, RateLimits
from aisp.admission.tiers import TIER_HEADER
from aisp.errors import AispError, BadRequest, ConfigError, Forbidden, GraphError, NotFound
from aisp.serve.auth import Scope as TokenScope
from aisp.serve.auth import Tokens
from aisp.serve.headers import DEADLINE_HEADER, Headers
from aisp.serve.http.errors import EXCEPTION_HANDLERS, guarded
from aisp.serve.http.events import NDJSON, Events, EventsSocket
from aisp.serve.http.models import InferFastPath, ModelRoutes
from aisp.serve.metrics import CONTENT_TYPE, ServerMetrics
from aisp.serve.models.server import ModelServer
from aisp.serve.oip.http_codec import HEADER_LENGTH
from aisp.serve.oip.shm import NO_REGIONS, SharedMemoryRegions
from aisp.serve.pipelines.service import PipelineService

__all__ = ["DEADLINE_HEADER", "HEADER_LENGTH", "NDJSON", "TIER_HEADER", "create_app"]


_ADMIN_PATHS = ("/v2/repository", "/v2/systemsharedmemory", "/v2/cudasharedmemory")


class _Auth:
    """ASGI middleware: bearer tokens; health is open, the repository and shared-memory
    extensions need admin."""

    def __init__(self, app: Any, tokens: Tokens) -> None:
        self.app, self.tokens = app, tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] not in ("http", "websocket")
            or not self.tokens.enabled
            or scope["path"].startswith("/v2/health/")
        ):
            await self.app(scope, receive, send)
            return
        changes_policy = (
            scope["path"].endswith(("/anomaly", "/rollout", "/graph")) and scope.get("method") != "GET"
        )
        needed: TokenScope = "admin" if scope["path"].startswith(_ADMIN_PATHS) or changes_policy else "infer"
        status = self.tokens.check(Headers.of(scope).get("authorization"), needed)
        if status == 200:
            await self.app(scope, receive, send)
            return
        message = "unauthorized" if status == 401 else "forbidden"
        if scope["type"] == "websocket":  # accepted, then closed with the reason (a refused
            await receive()  # handshake could say no more than 403)
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": 4000 + status, "reason": message})
            return
        extra = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        await JSONResponse({"error": message}, status, extra)(scope, receive, send)


def create_app(
    models: ModelServer | None,
    *,
    pipelines: Mapping[str, PipelineService] | None = None,
    admission_wait_ms: float = 0.0,
    name: str = "aisp",
    version: str = "0.1.0",
    max_body_bytes: int = 64 << 20,
    tokens: Tokens | None = None,
    metrics: ServerMetrics | None = None,
    limits: RateLimits | None = None,
    limiter: Limiter | None = None,
    model_control: bool = False,
    shared_memory: SharedMemoryRegions = NO_REGIONS,
) -> Any:
    """The OIP v2 REST app over ``models`` (an ASGI app: run it with any ASGI server).

    Bodies over ``max_body_bytes`` get a 413; a full model queue a 429 with ``Retry-After``;
    with ``tokens`` every route but health needs a bearer token (401/403); ``limits`` are
    token-bucket rate limits in rows/s per API key and per tier (429 with ``Retry-After``); pass
    ``limiter`` instead to share its buckets with another transport.
    ``GET /metrics`` serves Prometheus metrics (a fresh ``ServerMetrics`` unless one is given).
    ``pipelines`` are served at ``POST /v1/pipelines/{name}/events`` (see ``Events``) and
    listed at ``GET /v1/pipelines``; ``models`` may then be None (no model routes).
    ``model_control``: allow loading and unloading models (Triton's explicit model control);
    without it those routes answer 403. ``shared_memory``: the system shared-memory regions
    (Triton's extension) clients may register and name in requests.
    """
    metrics = metrics or ServerMetrics(models)
    if limiter is None and limits is not None and limits.enabled:
        limiter = Limiter(limits)

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": True})

    async def server_metadata(request: Request) -> Response:
        extensions = [
            "binary_tensor_data",
            "model_repository",
            "schedule_policy",
            "model_configuration",
            "statistics",
        ]
        if shared_memory.allowed:
            extensions.append("system_shared_memory")
        return JSONResponse({"name": name, "version": version, "extensions": extensions})

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    routes: list[BaseRoute] = [
        Route("/metrics", metrics_endpoint),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
    ]
    model_api = None
    if models is not None:
        model_api = ModelRoutes(
            models, metrics, limiter, max_body_bytes, model_control=model_control, shared_memory=shared_memory
        )
        routes += model_api.routes()
    served_pipelines = dict(pipelines or {})
    if served_pipelines:

        async def pipeline_index(request: Request) -> Response:
            return JSONResponse(
                [
                    {"name": n, "queued_rows": p.inbox.rows, "events_in": p.stats.events_in}
                    for n, p in sorted(served_pipelines.items())
                ]
            )

        events = Events(served_pipelines, limiter=limiter, admission_wait_s=admission_wait_ms / 1000)
        routes += [
            Route("/v1/pipelines", pipeline_index),
            Route("/v1/pipelines/{pipeline}/events", events, methods=["POST"]),
            WebSocketRoute("/v1/pipelines/{pipeline}/ws", EventsSocket(events)),
            Route(
                "/v1/pipelines/{pipeline}/anomaly",
                _anomaly_endpoint(served_pipelines),
                methods=["GET", "PUT"],
            ),
            Route(
                "/v1/pipelines/{pipeline}/rollout",
                _rollout_endpoint(served_pipelines),
                methods=["GET", "DELETE"],
            ),
            Route(
                "/v1/pipelines/{pipeline}/graph",
                _graph_endpoint(served_pipelines, model_control),
                methods=["GET", "POST"],
            ),
        ]
    if served_pipelines or models is not None:
        routes += _dashboard_routes(served_pipelines, models.rollouts if models is not None else None)
    app: Any = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    if model_api is not None:
        app = InferFastPath(app, model_api)
    return _Auth(app, tokens) if tokens is not None and tokens.enabled else app


def _served(pipelines: Mapping[str, PipelineService], request: Request) -> PipelineService:
    """The served pipeline a request's path names (``NotFound`` otherwise)."""
    name = request.path_params["pipeline"]
    service = pipelines.get(name)
    if service is None:
        raise NotFound(f"no pipeline {name!r}; serving {sorted(pipelines)}")
    return service


def _anomaly_endpoint(pipelines: Mapping[str, PipelineService]) -> Any:
    """``GET /v1/pipelines/{p}/anomaly``: the anomaly control's status (policy, admitted rate,
    triggers, last window); ``PUT`` (admin) with a JSON object of policy settings changes them,
    or installs a policy on a pipeline without one."""

    @guarded
    async def anomaly(request: Request) -> Response:
        service = _served(pipelines, request)
        name = service.name
        if request.method == "PUT":
            try:
                changes = msgspec.json.decode(await request.body())
            except msgspec.DecodeError as exc:
                raise BadRequest(f"the body is not JSON: {exc}") from None
            if not isinstance(changes, dict):
                raise BadRequest("the body must be a JSON object of anomaly policy settings")
            try:
                service.set_anomaly(changes)
            except ConfigError as exc:
                raise BadRequest(str(exc)) from None
        if service.control is None:
            raise NotFound(f"pipeline {name!r} has no anomaly policy (PUT one)")
        return JSONResponse(service.control.status())

    return anomaly


def _rollout_endpoint(pipelines: Mapping[str, PipelineService]) -> Any:
    """``GET /v1/pipelines/{p}/rollout``: the status of each rollout step of the running graph
    (``Stream.infer_rollout``: state, share, every decision with its evidence), by step id;
    ``DELETE`` (admin) rolls back now the rollout of ``?step=ID``, else every one under way."""

    @guarded
    async def rollout(request: Request) -> Response:
        service = _served(pipelines, request)
        rollouts = service.executor.graph.rollouts
        if not rollouts:
            raise NotFound(f"pipeline {service.name!r} has no rollout step")
        if request.method == "DELETE":
            step = request.query_params.get("step")
            if step is not None and step not in rollouts:
                raise NotFound(
                    f"pipeline {service.name!r} has no rollout step {step!r}; it has {sorted(rollouts)}"
                )
            for sid, r in rollouts.items():
                if step in (None, sid):
                    r.abort("rolled back by an operator")
        return JSONResponse({sid: r.status() for sid, r in sorted(rollouts.items())})

    return rollout


def _graph_endpoint(pipelines: Mapping[str, PipelineService], control: bool) -> Any:
    """``GET /v1/pipelines/{p}/graph``: the running graph's version, steps, latency bound and
    the updates so far; ``POST`` (admin, model control on) replaces it by the served file
    reloaded, or by ``{"path": FILE}`` (``aisp.serve.pipelines.topology``): the update's report, or the
    reason it failed (the running graph stays): 403 for a file outside the directories updates
    may load from, 400 for one that fails to load in any way (``SystemExit`` included)."""
    from starlette.concurrency import run_in_threadpool

    @guarded
    async def graph(request: Request) -> Response:
        service = _served(pipelines, request)
        if request.method == "GET":
            return JSONResponse(service.graph_status())
        if not control:
            raise Forbidden("topology updates are off; start the server with --allow-model-control")
        body = await request.body()
        try:
            path = msgspec.json.decode(body, type=_GraphUpdate).path if body.strip() else None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadRequest(f'the body must be {{"path": "PIPELINE.py"}} or empty: {exc}') from None
        try:
            report = await run_in_threadpool(lambda: service.update(path=path))
        except (ConfigError, GraphError) as exc:
            raise BadRequest(f"topology update refused, the running graph stays: {exc}") from None
        except AispError:
            raise
        except Exception as exc:  # noqa: BLE001 - the new pipeline file failed to load: its own error
            raise BadRequest(f"the new pipeline failed to load, the running graph stays: {exc!r}") from None
        return JSONResponse(report)

    return graph


class _GraphUpdate(msgspec.Struct, forbid_unknown_fields=True):
    path: str | None = None


def _dashboard_routes(
    pipelines: Mapping[str, PipelineService], models: Callable[[], Mapping[str, Any]] | None
) -> list[Route]:
    """The live dashboard of the served pipelines: ``/dashboard`` (the page),
    ``/dashboard/state`` (JSON) and ``/dashboard/events`` (server-sent events), each for
    ``?pipeline=NAME`` (default: the first by name), with the served ``models``' rollouts; of
    those alone without pipelines."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import StreamingResponse

    from aisp.observe.dashboard import DashboardState, ModelsState, page

    states: dict[str, DashboardState | ModelsState] = {
        n: DashboardState(p.view, admission=p.admission, models=models) for n, p in pipelines.items()
    }
    if not states:
        states[""] = ModelsState(models or dict)

    def pick(request: Request) -> DashboardState | ModelsState:
        state = states.get(request.query_params.get("pipeline") or min(states))
        if state is None:
            raise NotFound(f"no pipeline {request.query_params.get('pipeline')!r}; serving {sorted(states)}")
        return state

    async def dashboard_page(request: Request) -> Response:
        return Response(page(), media_type="text/html; charset=utf-8")

    @guarded
    async def dashboard_state(request: Request) -> Response:
        state = pick(request)
        history = request.query_params.get("history") == "1"
        return JSONResponse(await run_in_threadpool(state.with_history if history else state.update))

    @guarded
    async def dashboard_events(request: Request) -> Response:
        state = pick(request)

        async def stream() -> AsyncIterator[bytes]:
            while not await request.is_disconnected():
                body = msgspec.json.encode(await run_in_threadpool(state.update))
                yield b"data: " + body + b"\n\n"
                await asyncio.sleep(1.0)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    return [
        Route("/dashboard", dashboard_page),
        Route("/dashboard/state", dashboard_state),
        Route("/dashboard/events", dashboard_events),
    ]
