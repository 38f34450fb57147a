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

import hashlib
import time
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
from aisp.serve.auth import Scope, Tokens
from aisp.serve.grpc import BadRequest
from aisp.serve.metrics import CONTENT_TYPE, ServerMetrics
from aisp.serve.models import NP_TO_OIP, OIP_TO_NP, ModelServer, RequestFailed
from aisp.transform.operators import DEFAULT_TIERS

__all__ = ["DEADLINE_HEADER", "HEADER_LENGTH", "TIER_HEADER", "create_app"]

HEADER_LENGTH = "Inference-Header-Content-Length"
DEADLINE_HEADER = "X-Request-Deadline-Ms"
TIER_HEADER = "X-Tier"
"""QoS tier name of a request (gold, silver, bronze); the OIP ``priority`` parameter otherwise."""
"""Milliseconds the client will wait: rows still queued after that are dropped, the request 504s."""
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


def _tier(name: str | None) -> int | None:
    if name is None:
        return None
    if name not in DEFAULT_TIERS:
        raise BadRequest(f"{TIER_HEADER} must be one of {sorted(DEFAULT_TIERS)}, got {name!r}")
    return DEFAULT_TIERS[name]


def _api_key(request: Request) -> str:
    """Who a rate limit counts against: the bearer token's digest, or the client address."""
    auth = request.headers.get("authorization", "")
    if auth.startswith("Bearer "):
        return hashlib.sha256(auth[7:].strip().encode()).hexdigest()[:16]
    return request.client.host if request.client else "unknown"


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
    models: ModelServer,
    *,
    name: str = "aisp",
    version: str = "0.1.0",
    max_body_bytes: int = 64 << 20,
    tokens: Tokens | None = None,
    metrics: ServerMetrics | None = None,
    limits: RateLimits | None = None,
) -> Any:
    """The OIP v2 REST app over ``models`` (an ASGI app: run it with any ASGI server).

    Bodies over ``max_body_bytes`` get a 413; a full model queue a 429 with ``Retry-After``;
    with ``tokens`` every route but health needs a bearer token (401/403); ``limits`` are
    token-bucket rate limits in rows/s per API key and per tier (429 with ``Retry-After``). ``GET /metrics``
    serves Prometheus metrics (a fresh ``ServerMetrics`` unless one is given).
    """
    metrics = metrics or ServerMetrics(models)
    limiter = Limiter(limits) if limits is not None and limits.enabled else None

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        return JSONResponse({"ready": True})

    async def server_metadata(request: Request) -> Response:
        extensions = ["binary_tensor_data", "model_repository", "schedule_policy", "model_configuration"]
        return JSONResponse({"name": name, "version": version, "extensions": extensions})

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
        label = model if model in models.models else "unknown"
        metrics.observe("http", label, str(response.status_code), time.perf_counter() - started)
        return response

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

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
            tier = _tier(request.headers.get(TIER_HEADER))
            if limiter is not None:
                rows = int(next(iter(inputs.values())).shape[0]) if inputs else 1
                level = tier if tier is not None else models.tier_of(p["model"], priority)
                wait = limiter.admit(_api_key(request), level, rows)
                if wait:
                    message = f"rate limit: retry in {wait:.3f} s"
                    return JSONResponse({"error": message}, 429, {"Retry-After": limiter.retry_after(wait)})
            result = await run_in_threadpool(
                models.infer,
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
        Route("/metrics", metrics_endpoint),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        Route("/v2/repository/models/{model}/load", load, methods=["POST"]),
        Route("/v2/repository/models/{model}/unload", unload, methods=["POST"]),
    ]
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        routes += [
            Route(prefix, model_metadata),
            Route(f"{prefix}/ready", model_ready),
            Route(f"{prefix}/config", model_config),
            Route(f"{prefix}/infer", infer, methods=["POST"]),
        ]
    app = Starlette(routes=routes)
    return _Auth(app, tokens) if tokens is not None and tokens.enabled else app
