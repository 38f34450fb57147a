"""The OIP v2 model routes over HTTP/REST, the model repository extension and statistics.

Routes (``/versions/{v}`` optional wherever a model is named): ``GET /v2/models/{m}``,
``GET .../ready``, ``GET .../config``, ``GET .../stats``, ``POST .../infer``,
``GET /v2/models/stats``, ``POST /v2/repository/index``, ``POST /v2/repository/models/{m}/load``
and ``/unload``. Requests are parsed and checked by ``oip.http_codec`` against the model's signature;
every error is JSON ``{"error": ...}`` with the status its type carries (``http.errors``).
Loading and unloading (Triton's model control) are refused unless ``model_control`` is on.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

import msgspec
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from aisp.admission.ratelimit import Limiter
from aisp.admission.tiers import TIER_HEADER, parse_tier
from aisp.errors import BadRequest, ConfigError, Forbidden, ModelError, NotFound, PayloadTooLarge
from aisp.infer.models.repository import check_model_name
from aisp.infer.models.rollout import RolloutPolicy
from aisp.serve.admission import admit_infer, infer_admitted
from aisp.serve.auth import api_key
from aisp.serve.headers import DEADLINE_HEADER, parse_deadline_ms
from aisp.serve.http.errors import error_response, guarded
from aisp.serve.metrics import ServerMetrics
from aisp.serve.models.control import MODEL_CONTROL_OFF
from aisp.serve.models.server import ModelServer
from aisp.serve.oip.http_codec import HEADER_LENGTH, encode_response, parse_request
from aisp.serve.oip.shm import CUDA_SHM_UNSUPPORTED, NO_REGIONS, SharedMemoryRegions

__all__ = ["InferFastPath", "ModelRoutes", "config_json"]

_INT64 = {FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64}
_SMALL_BODY = 4 << 20  # repository requests carry a few parameters
_JSON = (b"content-type", b"application/json")


class _IndexRequest(msgspec.Struct):
    ready: bool = False


class _LoadRequest(msgspec.Struct):
    parameters: dict[str, Any] | None = None


class _RegisterRequest(msgspec.Struct, forbid_unknown_fields=True):
    key: str
    byte_size: int
    offset: int = 0


def config_json(message: Any) -> dict[str, Any]:
    """A model's config as Triton renders it: proto field names, fields at their defaults
    included, enums by name, and 64-bit integers as JSON numbers (not protobuf's strings)."""
    out: dict[str, Any] = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _numbers(message.DESCRIPTOR, out)
    return out


def _numbers(descriptor: Any, d: dict[str, Any]) -> None:
    for f in descriptor.fields:
        value = d.get(f.name)
        if value is None:
            continue
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            for k in value:
                if vf.message_type is not None:
                    _numbers(vf.message_type, value[k])
                elif vf.cpp_type in _INT64:
                    value[k] = int(value[k])
        elif f.message_type is not None:
            for item in value if f.is_repeated else [value]:
                _numbers(f.message_type, item)
        elif f.cpp_type in _INT64:
            d[f.name] = [int(x) for x in value] if f.is_repeated else int(value)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes (chunked bodies too)."""
    return await _receive_body(request.receive, request.headers.get("content-length"), limit)


_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([0-9]+))?/infer")
_HEADER_LENGTH, _TIER, _DEADLINE = (h.lower().encode() for h in (HEADER_LENGTH, TIER_HEADER, DEADLINE_HEADER))
_INFER_HEADERS = frozenset((b"content-length", b"authorization", _HEADER_LENGTH, _TIER, _DEADLINE))
"""The headers the infer route reads (ASGI servers give lower-case names)."""


class InferFastPath:
    """ASGI: ``POST /v2/models/{m}[/versions/{v}]/infer`` answered by ``ModelRoutes.infer_asgi``
    before the framework (its router, request and response objects cost more per request than
    a small model's share of a batch); every other request goes on to ``app``."""

    _KNOWN_PATHS = 1024

    def __init__(self, app: Any, routes: ModelRoutes) -> None:
        self.app, self.routes = app, routes
        self._paths: dict[str, tuple[str, str | None] | None] = {}  # path -> (model, version)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            target = self._paths[path] if path in self._paths else self._match(path)
            if target is not None:
                await self.routes.infer_asgi(scope, receive, send, *target)
                return
        await self.app(scope, receive, send)

    def _match(self, path: str) -> tuple[str, str | None] | None:
        """The (model, version) an infer path names, or None; the first paths seen are kept."""
        m = _INFER_PATH.fullmatch(path)
        version = m and m.group(2)
        target = None if m is None else (m.group(1), version and str(int(version)))
        if len(self._paths) < self._KNOWN_PATHS:
            self._paths[path] = target
        return target


async def _receive_body(
    receive: Receive, declared: str | None, limit: int, *, first: Mapping[str, Any] | None = None
) -> bytes:
    """The body from the ASGI ``receive`` channel (``first``: its first message, if already
    received; ``declared``: its Content-Length), refused with 413 as soon as it passes ``limit``
    bytes (chunked bodies too)."""
    _check_declared(declared, limit)
    chunks, size = [], 0
    while True:
        message, first = (first, None) if first is not None else (await receive(), None)
        if message["type"] == "http.disconnect":
            raise BadRequest("the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _check_declared(declared: str | None, limit: int) -> None:
    """A body declared (Content-Length) longer than ``limit`` is refused (413) before it is read."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")


def _version(request: Request) -> str | None:
    version = request.path_params.get("version")
    return None if version is None else str(version)


class ModelRoutes:
    """OIP v2 model routes (``routes``), model repository extension and statistics over one
    ``ModelServer``."""

    def __init__(
        self,
        models: ModelServer,
        metrics: ServerMetrics,
        limiter: Limiter | None,
        max_body_bytes: int,
        *,
        model_control: bool,
        shared_memory: SharedMemoryRegions = NO_REGIONS,
    ) -> None:
        self.models, self.metrics, self.limiter = models, metrics, limiter
        self.max_body_bytes, self.model_control = max_body_bytes, model_control
        self.shm = shared_memory

    def routes(self) -> list[Route]:
        routes = [Route("/v2/models/stats", guarded(self.statistics))]
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version:int}"):
            routes += [
                Route(
                    f"{prefix}/infer", _RoutedInfer(self), methods=["POST"]
                ),  # first: matched on every request
                Route(prefix, guarded(self.metadata)),
                Route(f"{prefix}/ready", guarded(self.ready)),
                Route(f"{prefix}/config", guarded(self.config)),
                Route(f"{prefix}/stats", guarded(self.statistics)),
            ]
        shm = "/v2/systemsharedmemory"
        return [
            *routes,
            Route(f"{shm}/status", guarded(self.shm_status)),
            Route(f"{shm}/region/{{region:path}}/status", guarded(self.shm_status)),
            Route(f"{shm}/region/{{region:path}}/register", guarded(self.shm_register), methods=["POST"]),
            Route(f"{shm}/unregister", guarded(self.shm_unregister), methods=["POST"]),
            Route(f"{shm}/region/{{region:path}}/unregister", guarded(self.shm_unregister), methods=["POST"]),
            Route("/v2/cudasharedmemory/status", guarded(_cuda_status)),
            Route("/v2/cudasharedmemory/region/{region:path}/status", guarded(_cuda_status)),
            Route(
                "/v2/cudasharedmemory/region/{region:path}/register",
                guarded(_cuda_register),
                methods=["POST"],
            ),
            Route("/v2/cudasharedmemory/unregister", guarded(_cuda_unregister), methods=["POST"]),
            Route(
                "/v2/cudasharedmemory/region/{region:path}/unregister",
                guarded(_cuda_unregister),
                methods=["POST"],
            ),
            Route("/v2/repository/index", guarded(self.repository_index), methods=["POST"]),
            # {model:path}: a name with separators must reach the name check (400), not miss the route
            Route("/v2/repository/models/{model:path}/load", guarded(self.load), methods=["POST"]),
            Route("/v2/repository/models/{model:path}/unload", guarded(self.unload), methods=["POST"]),
            Route("/v2/models/{model}/rollout", guarded(self.rollout), methods=["GET", "POST", "DELETE"]),
        ]

    async def metadata(self, request: Request) -> Response:
        return JSONResponse(self.models.metadata(request.path_params["model"], _version(request)))

    async def ready(self, request: Request) -> Response:
        model = request.path_params["model"]
        if not self.models.ready(model, _version(request)):
            raise NotFound(f"Request for unknown model: {model!r} is not found")
        return Response(status_code=200)

    async def config(self, request: Request) -> Response:
        cfg = self.models.served(request.path_params["model"], _version(request)).config
        return JSONResponse(config_json(cfg.message))

    async def infer_asgi(
        self, scope: Scope, receive: Receive, send: Send, name: str, version: str | None
    ) -> None:
        """The infer route as one plain ASGI call: no router, request or response objects."""
        started = time.perf_counter()
        models, limiter = self.models, self.limiter
        try:
            sig = models.signature(name, version)  # an unknown model is a 404 before the body is read
            headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in _INFER_HEADERS}
            _check_declared(headers.get(b"content-length"), self.max_body_bytes)
            message = await receive()  # a small body comes whole in the first message
            body = message.get("body", b"")
            if (
                message.get("more_body", False)
                or message["type"] != "http.request"
                or len(body) > self.max_body_bytes
            ):
                declared = headers.get(b"content-length")
                body = await _receive_body(receive, declared, self.max_body_bytes, first=message)
            req = parse_request(body, headers.get(_HEADER_LENGTH), sig, self.shm)
            if limiter is not None:
                client = scope.get("client")
                key = api_key(headers.get(b"authorization"), client[0] if client else "unknown")
            else:
                key = ""
            tier = parse_tier(headers.get(_TIER), TIER_HEADER)
            ms = parse_deadline_ms(headers.get(_DEADLINE))
            a = admit_infer(
                models,
                limiter,
                req,
                sig,
                version=version,
                tier=tier,
                timeout_s=None if ms is None else ms / 1000,
                api_key=key,
            )
            result = await infer_admitted(models, name, a)
            body, extra = encode_response(req, sig, result.version, result.outputs, self.shm)
        except Exception as exc:  # noqa: BLE001 - every failure is answered, typed or not
            response = error_response(exc)
            self._observe(name, response.status_code, started)
            await response(scope, receive, send)
            return
        if len(extra) == 1 and extra.get("content-type") == "application/json":
            raw = [_JSON, (b"content-length", b"%d" % len(body))]
        else:
            raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
            raw.append((b"content-length", b"%d" % len(body)))
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": body})
        self.metrics.observe("http", name, "200", time.perf_counter() - started)

    def _observe(self, name: str, status: int, started: float) -> None:
        label = name if self.models.is_loaded(name) else "unknown"
        self.metrics.observe("http", label, str(status), time.perf_counter() - started)

    async def statistics(self, request: Request) -> Response:
        stats = self.models.statistics(request.path_params.get("model"), _version(request))
        return JSONResponse({"model_stats": stats})

    async def shm_status(self, request: Request) -> Response:
        return JSONResponse(self.shm.status(request.path_params.get("region")))

    async def shm_register(self, request: Request) -> Response:
        body = await _read_body(request, _SMALL_BODY)
        r = _decode(body, _RegisterRequest, "shared memory register request")
        self.shm.register(request.path_params["region"], r.key, r.offset, r.byte_size)
        return Response(status_code=200)

    async def shm_unregister(self, request: Request) -> Response:
        self.shm.unregister(request.path_params.get("region"))
        return Response(status_code=200)

    async def repository_index(self, request: Request) -> Response:
        body = await _read_body(request, _SMALL_BODY)
        ready = _decode(body, _IndexRequest, "repository index request").ready if body.strip() else False
        index = self.models.index()
        return JSONResponse([e for e in index if e["state"] == "READY"] if ready else index)

    def _control(self, request: Request, body: bytes, allowed: frozenset[str] = frozenset()) -> str:
        """The model a load or unload names, once the name, the mode and the body are checked."""
        name = request.path_params["model"]
        check_model_name(name)
        if not self.model_control:
            raise Forbidden(MODEL_CONTROL_OFF)
        params = _decode(body, _LoadRequest, "request").parameters if body.strip() else None
        unknown = sorted(set(params or ()) - allowed)
        if unknown:
            raise BadRequest(f"parameters {unknown} are not supported: models load from the repository")
        return str(name)

    async def load(self, request: Request) -> Response:
        """Load a model; ``{"parameters": {"version": N}}`` loads version N beside the ones its
        version policy serves (instead of them when it serves one: a hot swap)."""
        body = await _read_body(request, _SMALL_BODY)
        name = self._control(request, body, frozenset({"version"}))
        params = _decode(body, _LoadRequest, "request").parameters or {} if body.strip() else {}
        version = params.get("version")
        if version is not None and not (
            (isinstance(version, int) and not isinstance(version, bool) and version >= 0)
            or (isinstance(version, str) and version.isdigit())
        ):
            raise BadRequest(f"parameter 'version' must be a version number, got {str(version)[:40]!r}")
        try:
            await run_in_threadpool(self.models.load, name, None if version is None else int(version))
        except NotFound:
            raise
        except ModelError as exc:
            raise BadRequest(f"load failed for model {name!r}: {exc}") from exc
        return Response(status_code=200)

    async def rollout(self, request: Request) -> Response:
        """``GET``: the model's rollout status and decisions; ``POST`` (model control) with a
        rollout policy (``aisp.infer.models.rollout.RolloutPolicy`` as JSON) starts one; ``DELETE``
        rolls the one under way back."""
        name = request.path_params["model"]
        if request.method == "GET":
            return JSONResponse(self.models.rollout(name))
        body = await _read_body(request, _SMALL_BODY)
        if not self.model_control:
            raise Forbidden(MODEL_CONTROL_OFF)
        if request.method == "DELETE":
            return JSONResponse(self.models.abort_rollout(name))
        try:
            policy = RolloutPolicy.parse(msgspec.json.decode(body))
        except msgspec.DecodeError as exc:
            raise BadRequest(f"the body is not JSON: {exc}") from None
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        try:
            status = await run_in_threadpool(self.models.start_rollout, name, policy)
        except ModelError as exc:
            raise BadRequest(
                f"rollout of model {name!r} failed to load version {policy.version}: {exc}"
            ) from exc
        return JSONResponse(status)

    async def unload(self, request: Request) -> Response:
        body = await _read_body(request, _SMALL_BODY)
        self.models.unload(self._control(request, body, frozenset({"unload_dependents"})))  # there are none
        return Response(status_code=200)


class _RoutedInfer:
    """The infer route's ASGI endpoint in the router: what ``InferFastPath`` did not answer
    first (an app built without it)."""

    def __init__(self, routes: ModelRoutes) -> None:
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        version = scope["path_params"].get("version")
        name = scope["path_params"]["model"]
        await self.routes.infer_asgi(scope, receive, send, name, None if version is None else str(version))


async def _cuda_status(request: Request) -> Response:
    region = request.path_params.get("region")
    if region is not None:
        raise NotFound(f"unable to find CUDA shared memory region: {region!r}")
    return JSONResponse([])


async def _cuda_register(request: Request) -> Response:
    raise BadRequest(CUDA_SHM_UNSUPPORTED)


async def _cuda_unregister(request: Request) -> Response:
    return Response(status_code=200)


def _decode(body: bytes, type_: Any, what: str) -> Any:
    try:
        return msgspec.json.decode(body, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequest(f"invalid {what}: {str(exc).replace('$', 'request', 1)}") from None
    except RecursionError:
        raise BadRequest(f"invalid {what}: JSON nested too deeply") from None
