"""Open Inference Protocol v2 over HTTP/REST, with Triton's binary tensor data extension.

Routes (``{v}`` optional everywhere a model is named): ``GET /v2/health/live``,
``GET /v2/health/ready``, ``GET /v2``, ``GET /v2/models/{m}[/versions/{v}]``,
``GET .../ready``, ``GET .../config``, ``POST .../infer``, ``POST /v2/repository/index``,
``POST /v2/repository/models/{m}/load`` and ``/unload``. Infer bodies are JSON tensors, or the
binary form ``tritonclient`` sends by default: a JSON header whose length is given by the
``Inference-Header-Content-Length`` header, then each binary tensor's bytes in input order
(``parameters.binary_data_size``). Outputs are answered in binary when the request asks for it.
Every infer goes through the model's dynamic batcher. Bad requests get a 400 with a precise
reason; nothing from a request is ever unpickled.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aisp.errors import AispError, ModelError
from aisp.schedule.ratelimit import Limiter, RateLimits
from aisp.serve.auth import Scope, Tokens, api_key
from aisp.serve.grpc import BadRequest, parse_tier
from aisp.serve.metrics import CONTENT_TYPE, ServerMetrics
from aisp.serve.models import NP_TO_OIP, OIP_TO_NP, ModelServer, RequestFailed
from aisp.serve.pipelines import Chunk, InboxClosed, PipelineService

__all__ = ["DEADLINE_HEADER", "HEADER_LENGTH", "NDJSON", "TIER_HEADER", "create_app"]

HEADER_LENGTH = "Inference-Header-Content-Length"
DEADLINE_HEADER = "X-Request-Deadline-Ms"
"""Milliseconds the client will wait: rows still queued after that are dropped, the request 504s."""
TIER_HEADER = "X-Tier"
"""QoS tier name of a request (gold, silver, bronze); the OIP ``priority`` parameter otherwise."""
NDJSON = "application/x-ndjson"
_json = msgspec.json.Decoder()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def decode_request(
    body: bytes, header_length: str | None
) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
    """The JSON part of an infer request and its input arrays (JSON or binary tensors)."""
    try:
        if header_length is not None:
            n = int(header_length)
            if not 0 <= n <= len(body):
                raise BadRequest(f"{HEADER_LENGTH} is {n}, but the body has {len(body)} bytes")
            req, blob = _json.decode(body[:n]), memoryview(body)[n:]
        else:
            req, blob = _json.decode(body), memoryview(b"")
    except (msgspec.DecodeError, ValueError) as exc:
        raise BadRequest(f"request is not valid JSON: {exc}") from exc
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list) or not req["inputs"]:
        raise BadRequest("request needs a non-empty 'inputs' list")
    arrays: dict[str, npt.NDArray[Any]] = {}
    offset = 0
    for t in req["inputs"]:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise BadRequest("every input needs a 'name'")
        name, datatype, shape = t["name"], t.get("datatype"), t.get("shape")
        dtype = OIP_TO_NP.get(datatype) if isinstance(datatype, str) else None
        if dtype is None:
            raise BadRequest(f"input {name!r}: datatype {datatype!r} is not supported")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise BadRequest(f"input {name!r}: shape must be a list of non-negative integers, got {shape!r}")
        count = int(np.prod(shape)) if shape else 1
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if size != count * dtype.itemsize or offset + size > len(blob):
                raise BadRequest(
                    f"input {name!r}: binary_data_size {size} does not fit shape {shape} of {datatype}"
                    f" ({count * dtype.itemsize} bytes) or the {len(blob) - offset} bytes left"
                )
            arr = np.frombuffer(blob[offset : offset + size], dtype=dtype)
            offset += size
        else:
            data = t.get("data")
            try:
                arr = np.asarray(data, dtype=dtype).reshape(-1)
            except (TypeError, ValueError) as exc:
                raise BadRequest(f"input {name!r}: data is not a list of {datatype} values") from exc
            if arr.size != count:
                raise BadRequest(f"input {name!r}: {arr.size} values for shape {shape}")
        arrays[name] = arr.reshape(shape)
    return req, arrays


def encode_response(req: dict[str, Any], result: Any) -> Response:
    wanted = req.get("outputs") or [{"name": n} for n in result.outputs]
    binary_default = bool((req.get("parameters") or {}).get("binary_data_output", False))
    outputs, blobs = [], []
    for o in wanted:
        name = o.get("name") if isinstance(o, dict) else None
        if name not in result.outputs:
            raise BadRequest(f"model {result.model!r} has no output {name!r}")
        arr = np.ascontiguousarray(result.outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": NP_TO_OIP[arr.dtype], "shape": list(arr.shape)}
        if (o.get("parameters") or {}).get("binary_data", binary_default):
            raw = arr.tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.reshape(-1).tolist()
        outputs.append(entry)
    body = {"model_name": result.model, "model_version": result.version, "outputs": outputs}
    if "id" in req:
        body["id"] = req["id"]
    header = msgspec.json.encode(body)
    if not blobs:
        return Response(header, media_type="application/json")
    return Response(
        b"".join([header, *blobs]),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(header))},
    )


def _api_key(request: Request) -> str:
    return api_key(request.headers.get("authorization"), request.client.host if request.client else "unknown")


def _deadline_s(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        raise BadRequest(f"{DEADLINE_HEADER} must be a number of milliseconds, got {value!r}") from None
    if not ms > 0:
        raise BadRequest(f"{DEADLINE_HEADER} must be > 0, got {value!r}")
    return ms / 1000


async def _read_limited(request: Request, limit: int) -> bytes | None:
    """The body, or None once it passes ``limit`` bytes (also for chunked bodies without a length)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _body_lines(receive: Any, chunk_rows: int, max_line_bytes: int) -> AsyncIterator[list[bytes]]:
    """Non-empty lines of a (possibly chunked, unbounded) request body, at most ``chunk_rows``
    at a time, as they arrive. A line longer than ``max_line_bytes`` raises ``BadRequest``."""
    tail = b""
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected")
        more = message.get("more_body", False)
        data = message.get("body", b"")
        if not data and more:
            continue
        parts = (tail + data).split(b"\n") if tail else data.split(b"\n")
        tail = parts.pop() if more else b""
        if len(tail) > max_line_bytes:
            raise BadRequest(f"a line is longer than {max_line_bytes} bytes")
        lines = [p for p in parts if p]  # blank lines are skipped; whitespace-only ones fail to parse
        for i in range(0, len(lines), chunk_rows):
            yield lines[i : i + chunk_rows]


class _Events:
    """``POST /v1/pipelines/{pipeline}/events``: NDJSON in, one NDJSON result per event out.

    A raw ASGI endpoint, so the response streams while the (possibly unbounded, chunked) body is
    still being read: results go back in request order as the pipeline finishes them. With
    ``?mode=fire`` the events are only acknowledged, in bulk, once admitted (202 with counts).
    When the pipeline's admission queue is full the first chunk waits ``admission_wait_s``,
    then the request gets a 429 with ``Retry-After``; later chunks of a stream wait for room
    (the stream stops reading). A request keeps at most ``window_events`` events unanswered.
    """

    def __init__(
        self,
        pipelines: Mapping[str, PipelineService],
        *,
        limiter: Limiter | None,
        admission_wait_s: float,
        window_events: int = 65536,
        max_line_bytes: int = 1 << 20,
    ) -> None:
        self.pipelines = pipelines
        self.limiter = limiter
        self.admission_wait_s = admission_wait_s
        self.window_events = window_events
        self.max_line_bytes = max_line_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        service = self.pipelines.get(scope["path_params"]["pipeline"])
        if service is None:
            names = sorted(self.pipelines)
            await _error(404, f"no pipeline {scope['path_params']['pipeline']!r}; serving {names}")(
                scope, receive, send
            )
            return
        mode = request.query_params.get("mode", "results")
        if mode not in ("results", "fire"):
            await _error(400, f"mode must be 'results' or 'fire', got {mode!r}")(scope, receive, send)
            return
        try:
            timeout_s = _deadline_s(request.headers.get(DEADLINE_HEADER))
            tier = parse_tier(request.headers.get(TIER_HEADER), TIER_HEADER)
        except BadRequest as exc:
            await _error(400, str(exc))(scope, receive, send)
            return
        deadline_ns = None if timeout_s is None else time.monotonic_ns() + int(timeout_s * 1e9)
        key = _api_key(request) if self.limiter is not None else ""
        stream = _body_lines(receive, service.chunk_rows, self.max_line_bytes)
        parent = service.trace_parent(request.headers.get("traceparent"), request.headers.get("tracestate"))
        opts = {"deadline_ns": deadline_ns, "tier": tier, "trace_parent": parent}
        try:
            if mode == "fire":
                reply = await self._fire(service, stream, key, opts)
                await reply(scope, receive, send)
            else:
                await self._results(service, stream, key, opts, send)
        except BadRequest as exc:
            await _error(413 if "longer than" in str(exc) else 400, str(exc))(scope, receive, send)
        except _Refused as exc:
            await JSONResponse({"error": exc.message}, 429, {"Retry-After": exc.retry_after})(
                scope, receive, send
            )
        except InboxClosed as exc:
            await _error(503, str(exc))(scope, receive, send)
        except ConnectionResetError:
            return

    async def _admit(
        self,
        service: PipelineService,
        batch: Any,
        chunk: Chunk | None,
        key: str,
        tier: int | None,
        first: bool,
    ) -> None:
        """Rate limits, then room in the inbox: refused (first chunk) or waited for (the rest)."""
        rows = 0 if batch is None else batch.num_rows
        if self.limiter is not None and rows:
            wait = self.limiter.admit(key, tier if tier is not None else 0, rows)
            if wait and first:
                service.refused(rows, rate_limited=True)
                raise _Refused(f"rate limit: retry in {wait:.3f} s", self.limiter.retry_after(wait))
            if wait:
                await asyncio.sleep(wait)
        deadline = time.monotonic() + self.admission_wait_s
        pause = 0.0002
        while not service.offer(batch, chunk):
            if first and time.monotonic() >= deadline:
                service.refused(rows)
                message = f"pipeline {service.name!r} is overloaded: its admission queue is full; retry later"
                raise _Refused(message, "1")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.005)

    async def _fire(
        self, service: PipelineService, stream: AsyncIterator[list[bytes]], key: str, opts: dict[str, Any]
    ) -> Response:
        accepted, line = 0, 1
        errors: list[dict[str, Any]] = []
        async for lines in stream:
            decoded = await service.decode_async(lines)
            batch, _, bad = service.prepare(lines, decoded=decoded, track=False, first_line=line, **opts)
            await self._admit(service, batch, None, key, opts["tier"], first=line == 1)
            line += len(lines)
            accepted += len(lines) - len(bad)
            errors += bad[: max(0, 100 - len(errors))]
        return JSONResponse(
            {"accepted": accepted, "rejected": line - 1 - accepted, "errors": errors}, status_code=202
        )

    async def _results(
        self,
        service: PipelineService,
        stream: AsyncIterator[list[bytes]],
        key: str,
        opts: dict[str, Any],
        send: Any,
    ) -> None:
        loop = asyncio.get_running_loop()
        wake, room = asyncio.Event(), asyncio.Event()
        pending: deque[Chunk] = deque()
        state = {"line": 1, "unanswered": 0, "reading": True}

        def notify() -> None:
            loop.call_soon_threadsafe(wake.set)

        async def admit_next(lines: list[bytes], first: bool) -> None:
            decoded = await service.decode_async(lines)
            batch, chunk, _ = service.prepare(
                lines, decoded=decoded, notify=notify, first_line=state["line"], **opts
            )
            assert chunk is not None
            await self._admit(service, batch, chunk, key, opts["tier"], first=first)
            state["line"] += len(lines)
            state["unanswered"] += chunk.n
            pending.append(chunk)
            wake.set()

        first = await anext(stream, None)
        if first is not None:
            await admit_next(first, True)  # may refuse: nothing has been sent yet
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", NDJSON.encode())]}
        )

        async def read_rest() -> None:
            try:
                async for lines in stream:
                    while state["unanswered"] >= self.window_events:
                        room.clear()
                        await room.wait()
                    await admit_next(lines, False)
            except (BadRequest, InboxClosed) as exc:  # answered in place: the status went out
                pending.append(_failed_chunk(str(exc)))
            except ConnectionResetError:
                pass
            finally:
                state["reading"] = False
                wake.set()

        reader = asyncio.create_task(read_rest())
        try:
            sent = 0
            while True:
                wake.clear()
                out = []
                while pending:
                    chunk = pending[0]
                    upto = chunk.prefix
                    if upto > sent:
                        out.append(chunk.lines(sent, upto))
                        sent = upto
                    if sent < chunk.n:
                        break
                    pending.popleft()
                    sent = 0
                    state["unanswered"] -= chunk.n
                    room.set()
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                elif not pending and not state["reading"]:
                    break
                else:
                    await wake.wait()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            reader.cancel()
            for chunk in pending:
                service.tracker.discard(chunk)


class _Refused(Exception):
    def __init__(self, message: str, retry_after: str) -> None:
        super().__init__(message)
        self.message, self.retry_after = message, retry_after


def _failed_chunk(reason: str) -> Chunk:
    chunk = Chunk(0, 1)
    chunk.results[0] = msgspec.json.encode({"error": reason})
    chunk.open[0] = 0
    chunk.prefix = 1
    return chunk


class _Auth:
    """ASGI middleware: bearer tokens; health is open, the repository extension needs admin."""

    def __init__(self, app: Any, tokens: Tokens) -> None:
        self.app, self.tokens = app, tokens

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.tokens.enabled or scope["path"].startswith("/v2/health/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        needed: Scope = "admin" if scope["path"].startswith("/v2/repository") else "infer"
        status = self.tokens.check(headers.get("authorization"), needed)
        if status == 200:
            await self.app(scope, receive, send)
            return
        extra = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        reply = JSONResponse({"error": "unauthorized" if status == 401 else "forbidden"}, status, extra)
        await reply(scope, receive, send)


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
) -> Any:
    """The OIP v2 REST app over ``models`` (an ASGI app: run it with any ASGI server).

    Bodies over ``max_body_bytes`` get a 413; a full model queue a 429 with ``Retry-After``;
    with ``tokens`` every route but health needs a bearer token (401/403); ``limits`` are
    token-bucket rate limits in rows/s per API key and per tier (429 with ``Retry-After``); pass
    ``limiter`` instead to share its buckets with another transport.
    ``GET /metrics`` serves Prometheus metrics (a fresh ``ServerMetrics`` unless one is given).
    ``pipelines`` are served at ``POST /v1/pipelines/{name}/events`` (see ``_Events``) and
    listed at ``GET /v1/pipelines``; ``models`` may then be None (no model routes).
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
        return JSONResponse({"name": name, "version": version, "extensions": extensions})

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    routes = [
        Route("/metrics", metrics_endpoint),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
    ]
    if models is not None:
        routes += _model_routes(models, metrics, limiter, max_body_bytes)
    served_pipelines = dict(pipelines or {})
    if served_pipelines:

        async def pipeline_index(request: Request) -> Response:
            return JSONResponse(
                [
                    {"name": n, "queued_rows": p.inbox.rows, "events_in": p.stats.events_in}
                    for n, p in sorted(served_pipelines.items())
                ]
            )

        events = _Events(served_pipelines, limiter=limiter, admission_wait_s=admission_wait_ms / 1000)
        routes += [
            Route("/v1/pipelines", pipeline_index),
            Route("/v1/pipelines/{pipeline}/events", events, methods=["POST"]),
            *_dashboard_routes(served_pipelines),
        ]
    app = Starlette(routes=routes)
    return _Auth(app, tokens) if tokens is not None and tokens.enabled else app


def _dashboard_routes(pipelines: Mapping[str, PipelineService]) -> list[Route]:
    """The live dashboard of the served pipelines: ``/dashboard`` (the page),
    ``/dashboard/state`` (JSON) and ``/dashboard/events`` (server-sent events), each for
    ``?pipeline=NAME`` (default: the first by name)."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import StreamingResponse

    from aisp.observe.dashboard import DashboardState, page

    states = {n: DashboardState(p.executor, admission=p.admission) for n, p in pipelines.items()}

    def pick(request: Request) -> DashboardState | None:
        return states.get(request.query_params.get("pipeline") or min(states))

    async def dashboard_page(request: Request) -> Response:
        return Response(page(), media_type="text/html; charset=utf-8")

    async def dashboard_state(request: Request) -> Response:
        state = pick(request)
        if state is None:
            return _error(
                404, f"no pipeline {request.query_params.get('pipeline')!r}; serving {sorted(states)}"
            )
        return JSONResponse(await run_in_threadpool(state.update))

    async def dashboard_events(request: Request) -> Response:
        state = pick(request)
        if state is None:
            return _error(
                404, f"no pipeline {request.query_params.get('pipeline')!r}; serving {sorted(states)}"
            )

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


def _model_routes(
    models: ModelServer, metrics: ServerMetrics, limiter: Limiter | None, max_body_bytes: int
) -> list[Route]:
    """OIP v2 model routes, model repository extension and statistics."""

    def served(request: Request) -> Any:
        p = request.path_params
        return models.served(p["model"], p.get("version") or None)

    async def model_metadata(request: Request) -> Response:
        p = request.path_params
        try:
            return JSONResponse(models.metadata(p["model"], p.get("version") or None))
        except ModelError as exc:
            return _error(404, str(exc))

    async def model_ready(request: Request) -> Response:
        p = request.path_params
        ok = models.ready(p["model"], p.get("version") or None)
        return Response(status_code=200 if ok else 400)

    async def model_config(request: Request) -> Response:
        try:
            cfg = served(request).config
        except ModelError as exc:
            return _error(404, str(exc))
        return JSONResponse(MessageToDict(cfg.message, preserving_proto_field_name=True))

    async def infer(request: Request) -> Response:
        started = time.perf_counter()
        response = await _infer(request)
        model = request.path_params["model"]
        label = model if models.is_loaded(model) else "unknown"
        metrics.observe("http", label, str(response.status_code), time.perf_counter() - started)
        return response

    async def _infer(request: Request) -> Response:
        p = request.path_params
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            return _error(413, f"request body of {declared} bytes exceeds the limit of {max_body_bytes}")
        body = await _read_limited(request, max_body_bytes)
        if body is None:
            return _error(413, f"request body exceeds the limit of {max_body_bytes} bytes")
        try:
            req, inputs = decode_request(body, request.headers.get(HEADER_LENGTH))
            priority = int((req.get("parameters") or {}).get("priority", 0))
            timeout_s = _deadline_s(request.headers.get(DEADLINE_HEADER))
            tier = parse_tier(request.headers.get(TIER_HEADER), TIER_HEADER)
            if limiter is not None:
                rows = int(next(iter(inputs.values())).shape[0]) if inputs else 1
                level = tier if tier is not None else models.tier_of(p["model"], priority)
                wait = limiter.admit(_api_key(request), level, rows)
                if wait:
                    message = f"rate limit: retry in {wait:.3f} s"
                    return JSONResponse({"error": message}, 429, {"Retry-After": limiter.retry_after(wait)})
            result = await models.infer_async(
                p["model"],
                inputs,
                version=p.get("version") or None,
                priority=priority,
                tier=tier,
                timeout_s=timeout_s,
            )
            return encode_response(req, result)
        except BadRequest as exc:
            return _error(400, str(exc))
        except RequestFailed as exc:
            if exc.overloaded:
                return JSONResponse({"error": str(exc)}, status_code=429, headers={"Retry-After": "1"})
            if exc.reason.startswith(("deadline", "timeout")):
                return _error(504, str(exc))
            return _error(503 if exc.retriable else 500, str(exc))
        except ModelError as exc:
            return _error(400, str(exc))

    async def statistics(request: Request) -> Response:
        p = request.path_params
        try:
            return JSONResponse({"model_stats": models.statistics(p.get("model"), p.get("version") or None)})
        except ModelError as exc:
            return _error(404, str(exc))

    async def repository_index(request: Request) -> Response:
        return JSONResponse(models.index())

    async def load(request: Request) -> Response:
        try:
            await run_in_threadpool(models.load, request.path_params["model"])
        except AispError as exc:
            return _error(400, str(exc))
        return Response(status_code=200)

    async def unload(request: Request) -> Response:
        try:
            models.unload(request.path_params["model"])
        except ModelError as exc:
            return _error(400, str(exc))
        return Response(status_code=200)

    routes = [
        Route("/v2/models/stats", statistics),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        Route("/v2/repository/models/{model}/load", load, methods=["POST"]),
        Route("/v2/repository/models/{model}/unload", unload, methods=["POST"]),
    ]
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [
            Route(prefix, model_metadata),
            Route(f"{prefix}/ready", model_ready),
            Route(f"{prefix}/config", model_config),
            Route(f"{prefix}/stats", statistics),
            Route(f"{prefix}/infer", infer, methods=["POST"]),
        ]
    return routes
