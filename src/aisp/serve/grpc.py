"""Open Inference Protocol v2 over gRPC: ``inference.GRPCInferenceService``.

Built on the generated stubs that ship in ``tritonclient`` (no hand-written protos), so
``tritonclient.grpc`` talks to it unmodified. Every ModelInfer goes through the model's dynamic
batcher (``ModelServer``). Implemented: ServerLive, ServerReady, ModelReady, ServerMetadata,
ModelMetadata, ModelConfig, ModelInfer (typed ``contents`` and ``raw_input_contents``),
ModelStreamInfer, ModelStatistics, RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload.
The others answer UNIMPLEMENTED. Requests are parsed and checked by ``oip_grpc``; every failure
is answered with the status its error carries (``status_of``: INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED, ...; INTERNAL, logged, for a fault of the server), never UNKNOWN, and a
stream answers a request that fails with its ``error_message`` and goes on.
``/aisp.v1.Pipelines/Events`` is a served pipeline's ingest stream (``PipelineStreams``).
Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent import futures
from typing import Any

import grpc
import msgspec
from google.protobuf.json_format import ParseDict
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from aisp.aio import LoopThread
from aisp.errors import AispError, BadRequest, Forbidden, ModelError, NotFound, Overloaded
from aisp.infer.repository import check_model_name
from aisp.schedule.ratelimit import Limiter
from aisp.serve.admission import PipelineAdmission, admit_infer
from aisp.serve.auth import Scope, Tokens, api_key
from aisp.serve.headers import TIER_KEY, parse_tier
from aisp.serve.http_models import MODEL_CONTROL_OFF
from aisp.serve.metrics import ServerMetrics
from aisp.serve.models import ModelServer
from aisp.serve.oip_grpc import encode_response, parse_request
from aisp.serve.pipelines import Chunk, InboxClosed, PipelineService

__all__ = ["EVENTS_METHOD", "GrpcServer", "InferenceServicer", "PipelineStreams", "status_of"]

EVENTS_METHOD = "/aisp.v1.Pipelines/Events"
"""The pipeline ingest stream: bidirectional, raw bytes messages (NDJSON lines each way)."""

log = logging.getLogger("aisp.serve")


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and details a failure is answered with; a server fault is logged."""
    if isinstance(exc, AispError):
        code = getattr(grpc.StatusCode, exc.grpc_code, grpc.StatusCode.INTERNAL)
        if code is grpc.StatusCode.INTERNAL:
            log.error("gRPC request failed: %s", exc, exc_info=exc)
        return code, str(exc)
    log.error("gRPC request failed: %s", exc, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal server error: {type(exc).__name__}"


Handler = Callable[[Any, Any, Any], Any]


def _answered(method: Handler) -> Handler:
    """A unary handler whose every failure is answered with its status (never UNKNOWN)."""

    @functools.wraps(method)
    def call(self: Any, request: Any, context: Any) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every failure is answered, typed or not
            code, details = status_of(exc)
        context.abort(code, details)

    return call


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The OIP v2 gRPC service over a ``ModelServer``; ``model_control`` allows repository
    loads and unloads (PERMISSION_DENIED otherwise)."""

    def __init__(
        self,
        server: ModelServer,
        *,
        name: str = "aisp",
        version: str = "0.1.0",
        metrics: ServerMetrics | None = None,
        limiter: Limiter | None = None,
        model_control: bool = False,
        stream_window: int = 256,
    ) -> None:
        self.models = server
        self.name, self.version = name, version
        self.metrics = metrics
        self.limiter = limiter
        self.model_control = model_control
        self.stream_window = stream_window

    def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 - the protocol's names
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ServerReadyResponse(ready=True)

    @_answered
    def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ModelReadyResponse(ready=self.models.ready(request.name, request.version or None))

    def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        extensions = ["model_repository", "schedule_policy", "model_configuration", "statistics"]
        return pb.ServerMetadataResponse(name=self.name, version=self.version, extensions=extensions)

    @_answered
    def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        meta = self.models.metadata(request.name, request.version or None)
        tensors = {
            k: [pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta[k]] for k in ("inputs", "outputs")
        }
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"], **tensors
        )

    @_answered
    def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        model = self.models.served(request.name, request.version or None)
        return pb.ModelConfigResponse(config=model.config.message)

    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        started = time.perf_counter()
        try:
            response = await self._infer(request, context)
            code = "OK"
        except Exception as exc:  # noqa: BLE001 - every failure is answered, typed or not
            status, details = status_of(exc)
            code = status.name
        finally:
            if self.metrics is not None:
                label = request.model_name if self.models.is_loaded(request.model_name) else "unknown"
                self.metrics.observe("grpc", label, code, time.perf_counter() - started)
        if code != "OK":
            await context.abort(status, details)
        return response

    async def ModelStreamInfer(  # noqa: N802
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        """One response per request, in order; a request that fails is answered with its
        ``error_message`` and the stream goes on. The requests of a stream are read ahead (up
        to ``stream_window``) and run concurrently, so they batch together like separate calls."""
        answers: asyncio.Queue[asyncio.Task[Any] | None] = asyncio.Queue(self.stream_window)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await answers.put(asyncio.ensure_future(self._stream_answer(request, context)))
            except Exception:  # noqa: BLE001, S110 - the client's side broke: answer what was read
                pass
            await answers.put(None)  # (not when cancelled: nobody reads the answers any more)

        reader = asyncio.ensure_future(read())
        try:
            while (answer := await answers.get()) is not None:
                yield await answer
        finally:
            reader.cancel()

    async def _stream_answer(self, request: Any, context: Any) -> Any:
        try:
            return pb.ModelStreamInferResponse(infer_response=await self._infer(request, context))
        except Exception as exc:  # noqa: BLE001 - that request fails, the stream does not
            return pb.ModelStreamInferResponse(error_message=status_of(exc)[1])

    @_answered
    def ModelStatistics(self, request: Any, context: Any) -> Any:  # noqa: N802
        stats = self.models.statistics(request.name or None, request.version or None)
        return ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    @_answered
    def RepositoryIndex(self, request: Any, context: Any) -> Any:  # noqa: N802
        entries = [pb.RepositoryIndexResponse.ModelIndex(**e) for e in self.models.index()]
        if request.ready:
            entries = [e for e in entries if e.state == "READY"]
        return pb.RepositoryIndexResponse(models=entries)

    @_answered
    def RepositoryModelLoad(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._control(request)
        version = None
        params = dict(request.parameters)
        if "version" in params:
            p = params.pop("version")
            text = str(getattr(p, p.WhichOneof("parameter_choice") or "string_param"))
            if not text.isdigit():
                raise BadRequest(f"parameter 'version' must be a version number, got {text[:40]!r}")
            version = int(text)
        if params:
            raise BadRequest(
                f"load parameters {sorted(params)} are not supported: models load from the repository"
            )
        try:
            self.models.load(request.model_name, version)
        except NotFound:
            raise
        except ModelError as exc:
            raise BadRequest(f"load failed for model {request.model_name!r}: {exc}") from exc
        return pb.RepositoryModelLoadResponse()

    @_answered
    def RepositoryModelUnload(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._control(request)
        self.models.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- helpers ------------------------------------------------------------------------------
    def _control(self, request: Any) -> None:
        check_model_name(request.model_name)
        if not self.model_control:
            raise Forbidden(MODEL_CONTROL_OFF)

    async def _infer(self, request: Any, context: Any) -> Any:
        name, version = request.model_name, request.model_version or None
        sig = self.models.signature(name, version)
        req = parse_request(request, sig)
        remaining = context.time_remaining() if context is not None else None
        metadata = dict(context.invocation_metadata() or ()) if context is not None else {}
        key = api_key(metadata.get("authorization"), context.peer()) if self.limiter is not None else ""
        admitted = admit_infer(
            self.models,
            self.limiter,
            req,
            sig,
            version=version,
            tier=parse_tier(metadata.get(TIER_KEY)),
            timeout_s=remaining if remaining is not None and remaining < 1e6 else None,
            api_key=key,
        )
        result = await self.models.infer_async(name, admitted.arrays, **admitted.options)
        return encode_response(pb, req, sig, result.version, result.outputs)


class PipelineStreams:
    """``/aisp.v1.Pipelines/Events``: the gRPC form of ``POST /v1/pipelines/{p}/events``.

    A bidirectional stream of raw bytes messages: each request message holds NDJSON events, and
    each response message the NDJSON results of one request message's events, in order (or, with
    metadata ``mode: fire``, an ack ``{"accepted", "rejected", "errors"}``). Metadata
    ``pipeline`` names the pipeline (optional when one is served), ``x-tier`` the tier; the
    call's deadline becomes the events' deadline. When the admission queue is full the first
    message waits ``admission_wait_s``, then the call ends with RESOURCE_EXHAUSTED; later
    messages wait for room (the stream stops reading). At most ``window_messages`` answers are
    pending per stream.
    """

    def __init__(
        self,
        pipelines: Mapping[str, PipelineService],
        *,
        admission_wait_s: float = 0.0,
        limiter: Limiter | None = None,
        window_messages: int = 64,
    ) -> None:
        self.pipelines = pipelines
        self.admissions = {
            name: PipelineAdmission(service, limiter=limiter, wait_s=admission_wait_s)
            for name, service in pipelines.items()
        }
        self.window_messages = window_messages

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_stream_rpc_method_handler(self.events)  # bytes in, bytes out
        return grpc.method_handlers_generic_handler("aisp.v1.Pipelines", {"Events": method})

    def _service(self, metadata: dict[str, Any]) -> PipelineService:
        name = metadata.get("pipeline")
        if name is None and len(self.pipelines) == 1:
            return next(iter(self.pipelines.values()))
        service = self.pipelines.get(name) if name is not None else None
        if service is None:
            raise NotFound(f"no pipeline {name!r}; serving {sorted(self.pipelines)}")
        return service

    def events(self, request_iterator: Iterator[bytes], context: Any) -> Iterator[bytes]:
        """The stream (see the class docstring); whatever fails is answered with its status."""
        try:
            yield from self._events(request_iterator, context)
        except grpc.RpcError:
            return  # the client went away
        except Exception as exc:  # noqa: BLE001 - every failure is answered, typed or not
            code, details = status_of(exc)
            context.abort(code, details)

    def _events(self, request_iterator: Iterator[bytes], context: Any) -> Iterator[bytes]:
        metadata = dict(context.invocation_metadata() or ())
        service = self._service(metadata)
        mode = metadata.get("mode", "results")
        if mode not in ("results", "fire"):
            raise BadRequest(f"mode must be 'results' or 'fire', got {str(mode)[:40]!r}")
        tier = parse_tier(metadata.get(TIER_KEY))
        remaining = context.time_remaining()
        deadline_ns = (
            time.monotonic_ns() + int(remaining * 1e9) if remaining is not None and remaining < 1e6 else None
        )
        key = api_key(metadata.get("authorization"), context.peer())
        parent = service.trace_parent(metadata.get("traceparent"), metadata.get("tracestate"))
        answers: queue.Queue[Any] = queue.Queue(self.window_messages)
        stop = threading.Event()
        admission = self.admissions[service.name]

        def read() -> None:
            line = 1
            try:
                for message in request_iterator:
                    lines = [x for x in bytes(message).split(b"\n") if x]  # as over HTTP
                    if not lines:
                        continue
                    first = line == 1
                    try:
                        batch, chunk, errors = service.prepare(
                            lines,
                            deadline_ns=deadline_ns,
                            tier=tier,
                            track=mode == "results",
                            first_line=line,
                            trace_parent=parent,
                        )
                        admitted = admission.admit(batch, chunk, key=key, tier=tier, first=first, stop=stop)
                    except (InboxClosed, Overloaded):
                        raise  # shutting down, or a refused first message: the call ends with it
                    except AispError as exc:  # this message fails; the stream goes on
                        answers.put(_failed_message(len(lines), line, exc, fire=mode == "fire"))
                        line += len(lines)
                        continue
                    if not admitted:
                        return  # the call ended while this message waited for room
                    line += len(lines)
                    if chunk is not None:
                        answers.put(chunk)
                    else:
                        ack = {
                            "accepted": len(lines) - len(errors),
                            "rejected": len(errors),
                            "errors": errors,
                        }
                        answers.put(msgspec.json.encode(ack) + b"\n")
            except Exception as exc:  # noqa: BLE001 - handed to the stream, which answers it
                answers.put(exc)
            finally:
                answers.put(None)

        reader = threading.Thread(target=read, name="aisp-grpc-events", daemon=True)
        reader.start()
        try:
            while (item := answers.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Chunk):
                    item.done.wait()
                    yield item.lines(0, item.n)
                elif isinstance(item, bytes):
                    yield item
        finally:
            stop.set()
            while reader.is_alive():  # unblock a reader waiting for room in the answer queue
                try:
                    item = answers.get(timeout=0.05)
                except queue.Empty:
                    continue
                if isinstance(item, Chunk):
                    service.tracker.discard(item)


def _failed_message(n: int, first_line: int, exc: AispError, *, fire: bool) -> bytes:
    """The answer to a message none of whose ``n`` events could be taken."""
    encode = msgspec.json.encode
    if fire:
        errors = [{"line": first_line + i, "reason": str(exc)} for i in range(n)]
        return encode({"accepted": 0, "rejected": n, "errors": errors}) + b"\n"
    return b"".join(encode({"error": str(exc), "line": first_line + i}) + b"\n" for i in range(n))


OPEN_METHODS = ("/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady")
ADMIN_METHODS = ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")


class _AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Bearer tokens in the ``authorization`` metadata; health is open, the repository is admin."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        method = details.method
        if method in OPEN_METHODS:
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        scope: Scope = "admin" if method.rsplit("/", 1)[-1] in ADMIN_METHODS else "infer"
        status = self.tokens.check(metadata.get("authorization"), scope)
        if status == 200:
            return await continuation(details)
        code = grpc.StatusCode.UNAUTHENTICATED if status == 401 else grpc.StatusCode.PERMISSION_DENIED
        message = "unauthorized" if status == 401 else "forbidden"

        async def refuse(request: Any, context: Any) -> Any:
            await context.abort(code, message)

        handler = await continuation(details)
        if handler is not None and handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


class GrpcServer:
    """A gRPC server for a ``ModelServer`` on ``host:port`` (port 0 picks a free one).

    It runs on ``grpc.aio`` in an event loop of its own thread: ModelInfer and ModelStreamInfer
    are coroutines that gather into the models' batchers like the HTTP server's requests, with
    no thread per call waiting for the GIL behind the others; the other methods, and the
    pipeline ingest stream, run in a pool of ``workers`` threads."""

    def __init__(
        self,
        models: ModelServer | None,
        *,
        host: str = "127.0.0.1",
        port: int = 8001,
        workers: int = 32,
        tokens: Tokens | None = None,
        tls: tuple[bytes, bytes] | None = None,
        metrics: ServerMetrics | None = None,
        limiter: Limiter | None = None,
        pipelines: Mapping[str, PipelineService] | None = None,
        admission_wait_ms: float = 0.0,
        model_control: bool = False,
    ) -> None:
        """``tls``: (certificate chain PEM, private key PEM) to serve over TLS. ``models`` may
        be None when only ``pipelines`` are served. ``model_control``: allow repository loads
        and unloads."""
        self.host = host
        self._aio = LoopThread("aisp-grpc-loop")
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aisp-grpc")
        interceptors = [_AuthInterceptor(tokens)] if tokens is not None and tokens.enabled else []

        async def build() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server(
                migration_thread_pool=self._pool,
                interceptors=interceptors,
                options=[
                    ("grpc.max_receive_message_length", 64 << 20),
                    ("grpc.max_send_message_length", 64 << 20),
                ],
            )
            if models is not None:
                servicer = InferenceServicer(
                    models, metrics=metrics, limiter=limiter, model_control=model_control
                )
                pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
            if pipelines:
                streams = PipelineStreams(
                    pipelines, admission_wait_s=admission_wait_ms / 1000, limiter=limiter
                )
                server.add_generic_rpc_handlers((streams.handler(),))
            if tls is None:
                bound = server.add_insecure_port(f"{host}:{port}")
            else:
                creds = grpc.ssl_server_credentials([(tls[1], tls[0])])
                bound = server.add_secure_port(f"{host}:{port}", creds)
            return server, bound

        self._server, self.port = self._aio.run(build())
        self._started = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self._aio.run(self._server.start())
        self._started = True

    def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new calls, let the ones in progress finish for up to ``grace_s``, then end."""
        if self._started:
            self._aio.run(self._server.stop(grace_s))
        self._aio.close()
        self._pool.shutdown(wait=False)
