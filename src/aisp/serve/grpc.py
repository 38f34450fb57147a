"""Open Inference Protocol v2 over gRPC: ``inference.GRPCInferenceService``.

Built on the generated stubs that ship in ``tritonclient`` (no hand-written protos), so
``tritonclient.grpc`` talks to it unmodified. Every ModelInfer goes through the model's dynamic
batcher (``ModelServer``). Implemented: ServerLive, ServerReady, ModelReady, ServerMetadata,
ModelMetadata, ModelConfig, ModelInfer (typed ``contents`` and ``raw_input_contents``),
ModelStreamInfer, ModelStatistics, RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload.
The others answer UNIMPLEMENTED. ``/aisp.v1.Pipelines/Events`` is a served pipeline's ingest
stream (``PipelineStreams``). Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent import futures
from typing import Any

import grpc
import msgspec
import numpy as np
import numpy.typing as npt
from google.protobuf.json_format import ParseDict
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from aisp.errors import AispError, ModelError
from aisp.schedule.ratelimit import Limiter
from aisp.serve.auth import Scope, Tokens, api_key
from aisp.serve.metrics import ServerMetrics
from aisp.serve.models import NP_TO_OIP, OIP_TO_NP, ModelServer, RequestFailed
from aisp.serve.pipelines import Chunk, InboxClosed, PipelineService
from aisp.transform.operators import DEFAULT_TIERS

__all__ = ["EVENTS_METHOD", "GrpcServer", "InferenceServicer", "PipelineStreams"]

EVENTS_METHOD = "/aisp.v1.Pipelines/Events"
"""The pipeline ingest stream: bidirectional, raw bytes messages (NDJSON lines each way)."""
TIER_KEY = "x-tier"
"""Metadata key of a request's QoS tier name (gold, silver, bronze)."""

CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


class BadRequest(AispError):
    """The request is malformed: the message says exactly what is wrong."""


def decode_inputs(request: Any) -> dict[str, npt.NDArray[Any]]:
    """Arrays from a ModelInferRequest (raw contents, or typed ``contents``)."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    out = {}
    for i, t in enumerate(request.inputs):
        dtype = OIP_TO_NP.get(t.datatype)
        if dtype is None:
            raise BadRequest(f"input {t.name!r}: datatype {t.datatype!r} is not supported")
        shape = tuple(int(d) for d in t.shape)
        count = int(np.prod(shape)) if shape else 1
        if raw:
            data = raw[i]
            if len(data) != count * dtype.itemsize:
                raise BadRequest(
                    f"input {t.name!r}: {len(data)} bytes for shape {list(shape)} of {t.datatype}"
                    f" (expected {count * dtype.itemsize})"
                )
            arr = np.frombuffer(data, dtype=dtype)
        else:
            values = getattr(t.contents, CONTENTS_FIELD[t.datatype])
            if len(values) != count:
                raise BadRequest(f"input {t.name!r}: {len(values)} values for shape {list(shape)}")
            arr = np.asarray(values, dtype=dtype)
        out[t.name] = arr.reshape(shape)
    return out


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The OIP v2 gRPC service over a ``ModelServer``."""

    def __init__(
        self,
        server: ModelServer,
        *,
        name: str = "aisp",
        version: str = "0.1.0",
        metrics: ServerMetrics | None = None,
        limiter: Limiter | None = None,
    ) -> None:
        self.models = server
        self.name, self.version = name, version
        self.metrics = metrics
        self.limiter = limiter

    def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 - the protocol's names
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ServerReadyResponse(ready=True)

    def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ModelReadyResponse(ready=self.models.ready(request.name, request.version or None))

    def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        extensions = ["model_repository", "schedule_policy", "model_configuration", "statistics"]
        return pb.ServerMetadataResponse(name=self.name, version=self.version, extensions=extensions)

    def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            meta = self.models.metadata(request.name, request.version or None)
        except ModelError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        tensors = {
            k: [pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta[k]] for k in ("inputs", "outputs")
        }
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"], **tensors
        )

    def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        model = self._model(request.name, request.version, context)
        return pb.ModelConfigResponse(config=model.config.message)

    def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        started = time.perf_counter()
        code = "OK"
        try:
            return self._model_infer(request, context)
        except Exception:
            code = "ERROR"
            raise
        finally:
            if self.metrics is not None:
                label = request.model_name if self.models.is_loaded(request.model_name) else "unknown"
                self.metrics.observe("grpc", label, code, time.perf_counter() - started)

    def _model_infer(self, request: Any, context: Any) -> Any:
        try:
            return self._infer(request, context)
        except BadRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RequestFailed as exc:
            if exc.overloaded:
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
            elif exc.retriable:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                code = grpc.StatusCode.INTERNAL
            context.abort(code, str(exc))
        except ModelError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable")  # context.abort raises

    def ModelStreamInfer(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:  # noqa: N802
        for request in request_iterator:
            try:
                yield pb.ModelStreamInferResponse(infer_response=self._infer(request, context))
            except (BadRequest, RequestFailed, ModelError) as exc:
                yield pb.ModelStreamInferResponse(error_message=str(exc))

    def ModelStatistics(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            stats = self.models.statistics(request.name or None, request.version or None)
        except ModelError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    def RepositoryIndex(self, request: Any, context: Any) -> Any:  # noqa: N802
        entries = [pb.RepositoryIndexResponse.ModelIndex(**e) for e in self.models.index()]
        if request.ready:
            entries = [e for e in entries if e.state == "READY"]
        return pb.RepositoryIndexResponse(models=entries)

    def RepositoryModelLoad(self, request: Any, context: Any) -> Any:  # noqa: N802
        version = None
        if "version" in request.parameters:
            version = int(
                request.parameters["version"].int64_param or request.parameters["version"].string_param
            )
        try:
            self.models.load(request.model_name, version)
        except (ModelError, AispError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.RepositoryModelLoadResponse()

    def RepositoryModelUnload(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            self.models.unload(request.model_name)
        except ModelError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return pb.RepositoryModelUnloadResponse()

    # -- helpers ------------------------------------------------------------------------------
    def _model(self, name: str, version: str, context: Any) -> Any:
        try:
            return self.models.served(name, version or None)
        except ModelError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    def _infer(self, request: Any, context: Any) -> Any:
        inputs = decode_inputs(request)
        priority = int(request.parameters["priority"].int64_param) if "priority" in request.parameters else 0
        remaining = context.time_remaining() if context is not None else None
        metadata = dict(context.invocation_metadata() or ()) if context is not None else {}
        tier = parse_tier(metadata.get(TIER_KEY))
        if self.limiter is not None:
            rows = int(next(iter(inputs.values())).shape[0]) if inputs else 1
            level = tier if tier is not None else self.models.tier_of(request.model_name, priority)
            wait = self.limiter.admit(api_key(metadata.get("authorization"), context.peer()), level, rows)
            if wait:
                raise RequestFailed(f"rate limit: retry in {wait:.3f} s", reason="overloaded")
        result = self.models.infer(
            request.model_name,
            inputs,
            version=request.model_version or None,
            priority=priority,
            tier=tier,
            timeout_s=remaining if remaining is not None and remaining < 1e6 else None,
        )
        wanted = [o.name for o in request.outputs] or list(result.outputs)
        response = pb.ModelInferResponse(model_name=result.model, model_version=result.version, id=request.id)
        for name in wanted:
            if name not in result.outputs:
                raise BadRequest(f"model {result.model!r} has no output {name!r}")
            arr = np.ascontiguousarray(result.outputs[name])
            response.outputs.add(name=name, datatype=NP_TO_OIP[arr.dtype], shape=list(arr.shape))
            response.raw_output_contents.append(arr.tobytes())
        return response


def parse_tier(name: str | None, source: str = TIER_KEY) -> int | None:
    """The level of tier ``name`` (None: not given); an unknown name is a ``BadRequest`` naming
    where it came from (``source``: a header or metadata key)."""
    if name is None:
        return None
    if name not in DEFAULT_TIERS:
        raise BadRequest(f"{source} must be one of {sorted(DEFAULT_TIERS)}, got {name!r}")
    return DEFAULT_TIERS[name]


class _Refused(Exception):
    pass


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
        self.admission_wait_s = admission_wait_s
        self.limiter = limiter
        self.window_messages = window_messages

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_stream_rpc_method_handler(self.events)  # bytes in, bytes out
        return grpc.method_handlers_generic_handler("aisp.v1.Pipelines", {"Events": method})

    def _service(self, metadata: dict[str, Any], context: Any) -> PipelineService:
        name = metadata.get("pipeline")
        if name is None and len(self.pipelines) == 1:
            return next(iter(self.pipelines.values()))
        service = self.pipelines.get(name) if name is not None else None
        if service is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"no pipeline {name!r}; serving {sorted(self.pipelines)}"
            )
        assert service is not None
        return service

    def events(self, request_iterator: Iterator[bytes], context: Any) -> Iterator[bytes]:
        metadata = dict(context.invocation_metadata() or ())
        service = self._service(metadata, context)
        mode = metadata.get("mode", "results")
        if mode not in ("results", "fire"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"mode must be 'results' or 'fire', got {mode!r}")
        try:
            tier = parse_tier(metadata.get(TIER_KEY))
        except BadRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        remaining = context.time_remaining()
        deadline_ns = (
            time.monotonic_ns() + int(remaining * 1e9) if remaining is not None and remaining < 1e6 else None
        )
        key = api_key(metadata.get("authorization"), context.peer())
        parent = service.trace_parent(metadata.get("traceparent"), metadata.get("tracestate"))
        answers: queue.Queue[Any] = queue.Queue(self.window_messages)
        stop = threading.Event()

        def read() -> None:
            line = 1
            try:
                for message in request_iterator:
                    lines = [x for x in bytes(message).split(b"\n") if x.strip()]
                    if not lines:
                        continue
                    first = line == 1
                    if self.limiter is not None:
                        wait = self.limiter.admit(key, tier if tier is not None else 0, len(lines))
                        if wait and first:
                            service.refused(len(lines), rate_limited=True)
                            answers.put(_Refused(f"rate limit: retry in {wait:.3f} s"))
                            return
                        stop.wait(wait)
                    chunk, errors, admitted = service.submit(
                        lines,
                        deadline_ns=deadline_ns,
                        tier=tier,
                        track=mode == "results",
                        wait_s=self.admission_wait_s if first else None,
                        stop=stop,
                        first_line=line,
                        trace_parent=parent,
                    )
                    if not admitted:
                        if first:
                            service.refused(len(lines))
                            answers.put(_Refused(f"pipeline {service.name!r} is overloaded; retry later"))
                        return
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
            except (InboxClosed, grpc.RpcError) as exc:
                answers.put(exc)
            finally:
                answers.put(None)

        reader = threading.Thread(target=read, name="aisp-grpc-events", daemon=True)
        reader.start()
        try:
            while (item := answers.get()) is not None:
                if isinstance(item, _Refused):
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(item))
                elif isinstance(item, InboxClosed):
                    context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
                elif isinstance(item, Chunk):
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


OPEN_METHODS = ("/inference.GRPCInferenceService/ServerLive", "/inference.GRPCInferenceService/ServerReady")
ADMIN_METHODS = ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")


class _AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Bearer tokens in the ``authorization`` metadata; health is open, the repository is admin."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        method = details.method
        if method in OPEN_METHODS:
            return continuation(details)
        metadata = dict(details.invocation_metadata or ())
        scope: Scope = "admin" if method.rsplit("/", 1)[-1] in ADMIN_METHODS else "infer"
        status = self.tokens.check(metadata.get("authorization"), scope)
        if status == 200:
            return continuation(details)
        code = grpc.StatusCode.UNAUTHENTICATED if status == 401 else grpc.StatusCode.PERMISSION_DENIED
        message = "unauthorized" if status == 401 else "forbidden"

        def refuse(request: Any, context: Any) -> Any:
            context.abort(code, message)

        handler = continuation(details)
        if handler is not None and handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


class GrpcServer:
    """A gRPC server for a ``ModelServer`` on ``host:port`` (port 0 picks a free one)."""

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
    ) -> None:
        """``tls``: (certificate chain PEM, private key PEM) to serve over TLS. ``models`` may
        be None when only ``pipelines`` are served."""
        interceptors = [_AuthInterceptor(tokens)] if tokens is not None and tokens.enabled else []
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aisp-grpc"),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ],
        )
        if models is not None:
            pb_grpc.add_GRPCInferenceServiceServicer_to_server(
                InferenceServicer(models, metrics=metrics, limiter=limiter), self._server
            )
        if pipelines:
            streams = PipelineStreams(pipelines, admission_wait_s=admission_wait_ms / 1000, limiter=limiter)
            self._server.add_generic_rpc_handlers((streams.handler(),))
        if tls is None:
            self.port = self._server.add_insecure_port(f"{host}:{port}")
        else:
            creds = grpc.ssl_server_credentials([(tls[1], tls[0])])
            self.port = self._server.add_secure_port(f"{host}:{port}", creds)
        self.host = host

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self._server.start()

    def stop(self, grace_s: float = 5.0) -> None:
        self._server.stop(grace_s).wait()
