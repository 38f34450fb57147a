"""Open Inference Protocol v2 over gRPC: ``inference.GRPCInferenceService``.

Built on the generated stubs that ship in ``tritonclient`` (no hand-written protos), so
``tritonclient.grpc`` talks to it unmodified. Every ModelInfer goes through the model's dynamic
batcher (``ModelServer``). Implemented: ServerLive, ServerReady, ModelReady, ServerMetadata,
ModelMetadata, ModelConfig, ModelInfer (typed ``contents`` and ``raw_input_contents``),
ModelStreamInfer, ModelStatistics, RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload.
The others answer UNIMPLEMENTED. Requests are parsed and checked by ``oip.grpc_codec``; every failure
is answered with the status its error carries (``status_of``: INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED, ...; INTERNAL, logged, for a fault of the server), never UNKNOWN, and a
stream answers a request that fails with its ``error_message`` and goes on.
``/aisp.v1.Pipelines/Events`` is a served pipeline's ingest stream (``grpc.events``). The
system shared-memory extension's RPCs manage the regions of ``oip.shm``.
Binds 127.0.0.1 unless told otherwise.

Two transports serve the same servicer (``GRPC_TRANSPORTS``):

* ``native``: ``pygrpc_native.aio``, a grpcio-compatible server whose HTTP/2 and gRPC work
  (framing, flow control, deadlines) runs in Rust (tonic, hyper) outside the GIL and hands calls
  to the event loop in batches. Python's grpc.aio spends 235-257 us of CPU on each call's
  machinery here, which caps a Python gRPC server below what the HTTP server answers; the native
  front spends about 35 us. It serves unary methods itself; bidirectional streams
  (ModelStreamInfer, the pipeline ingest stream) go to a grpc.aio server behind it on a Unix
  socket. It has no TLS, and it reads a whole message before AISP can refuse it for its size.
* ``grpcio``: ``grpc.aio`` alone; TLS, and the streams without the hop.

``auto`` (the default) is ``native`` on a loopback address without TLS (``grpc_transport`` says
why not elsewhere).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent import futures
from typing import Any, Literal, get_args

import grpc
from google.protobuf.json_format import ParseDict
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from aisp.admission.ratelimit import Limiter
from aisp.admission.tiers import TIER_KEY, parse_tier
from aisp.aio import LoopThread
from aisp.errors import AispError, BadRequest, Forbidden, ModelError, NotFound
from aisp.infer.models.repository import check_model_name
from aisp.serve.admission import Admitted, admit_infer, collect_admitted, infer_admitted
from aisp.serve.auth import Tokens, api_key, is_loopback
from aisp.serve.grpc.events import EVENTS_METHOD, PipelineStreams, status_of
from aisp.serve.grpc.native import NativeFront, auth_refusal
from aisp.serve.metrics import ServerMetrics
from aisp.serve.models.control import MODEL_CONTROL_OFF
from aisp.serve.models.served import InferResult
from aisp.serve.models.server import ModelServer
from aisp.serve.oip.grpc_codec import encode_response, parse_request
from aisp.serve.oip.request import InferRequest, Signature
from aisp.serve.oip.shm import CUDA_SHM_UNSUPPORTED, NO_REGIONS, SharedMemoryRegions
from aisp.serve.pipelines.service import PipelineService

__all__ = [
    "EVENTS_METHOD",
    "GRPC_TRANSPORTS",
    "GrpcServer",
    "GrpcTransport",
    "InferenceServicer",
    "grpc_transport",
    "PipelineStreams",
    "status_of",
]

log = logging.getLogger("aisp.serve")


Handler = Callable[[Any, Any, Any], Any]

GrpcTransport = Literal["auto", "native", "grpcio"]
GRPC_TRANSPORTS: tuple[str, ...] = get_args(GrpcTransport)


def grpc_transport(asked: str, *, tls: bool, host: str = "127.0.0.1") -> Literal["native", "grpcio"]:
    """The transport a server runs on. ``auto`` is ``native`` on a loopback address without TLS,
    ``grpcio`` otherwise: the native front reads a whole message into memory before AISP can
    refuse it for its size (up to 4 GiB, where grpc.aio refuses past 64 MiB at the frame's
    header), so it is the default only where no other machine can reach it; ask for it by name
    where every client is trusted or a gateway caps message sizes."""
    if asked not in GRPC_TRANSPORTS:
        raise BadRequest(f"gRPC transport must be one of {', '.join(GRPC_TRANSPORTS)}, got {asked!r}")
    if asked == "native" and tls:
        raise BadRequest("the native gRPC transport has no TLS: serve TLS on the grpcio transport")
    if asked == "grpcio" or tls or (asked == "auto" and not is_loopback(host)):
        return "grpcio"
    return "native"


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
        shared_memory: SharedMemoryRegions = NO_REGIONS,
    ) -> None:
        self.models = server
        self.shm = shared_memory
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
        if self.shm.allowed:
            extensions.append("system_shared_memory")
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
        to ``stream_window``) and run concurrently, so they batch together like separate calls:
        each is admitted as it is read and joins the loop's gather with a callback
        (``ModelServer.collect`` into the loop's gather: no task per request); the answers go out in order."""
        loop = asyncio.get_running_loop()
        metadata = dict(context.invocation_metadata() or ())
        answers: asyncio.Queue[asyncio.Future[Any] | None] = asyncio.Queue(self.stream_window)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    answer = loop.create_future()
                    self._stream_submit(request, metadata, context, answer)
                    await answers.put(answer)
            except Exception:  # noqa: BLE001, S110 - the client's side broke: answer what was read
                pass
            await answers.put(None)  # (not when cancelled: nobody reads the answers any more)

        reader = asyncio.ensure_future(read())
        try:
            while (answer := await answers.get()) is not None:
                yield await answer
        finally:
            reader.cancel()

    def _stream_submit(
        self, request: Any, metadata: Mapping[str, Any], context: Any, answer: asyncio.Future[Any]
    ) -> None:
        """(Event loop) One request of a stream admitted and gathered; ``answer`` gets its
        ``ModelStreamInferResponse`` (the failure's ``error_message`` for one that fails)."""

        def failed(exc: Exception) -> None:
            if not answer.done():
                answer.set_result(pb.ModelStreamInferResponse(error_message=status_of(exc)[1]))

        def done(result: InferResult | AispError) -> None:
            if isinstance(result, Exception):
                failed(result)
                return
            try:
                response = pb.ModelStreamInferResponse(infer_response=self.encode(req, sig, result))
            except Exception as exc:  # noqa: BLE001 - an output that cannot be encoded, shared memory gone
                failed(exc)
                return
            if not answer.done():
                answer.set_result(response)

        try:
            req, sig, admitted = self.admit(request, metadata, context.peer, context.time_remaining())
            collect_admitted(self.models, None, request.model_name, admitted, done)
        except Exception as exc:  # noqa: BLE001 - that request fails, the stream does not
            failed(exc)

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

    @_answered
    def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        regions = self.shm.status(request.name or None)
        return pb.SystemSharedMemoryStatusResponse(
            regions={r["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(**r) for r in regions}
        )

    @_answered
    def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.shm.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_answered
    def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.shm.unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        if request.name:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"unable to find CUDA shared memory region: {request.name!r}"
            )
        return pb.CudaSharedMemoryStatusResponse()

    def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.UNIMPLEMENTED, CUDA_SHM_UNSUPPORTED)

    def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- helpers ------------------------------------------------------------------------------
    def _control(self, request: Any) -> None:
        check_model_name(request.model_name)
        if not self.model_control:
            raise Forbidden(MODEL_CONTROL_OFF)

    async def _infer(self, request: Any, context: Any) -> Any:
        metadata = dict(context.invocation_metadata() or ()) if context is not None else {}
        remaining = context.time_remaining() if context is not None else None
        req, sig, admitted = self.admit(
            request, metadata, context.peer if context is not None else _no_peer, remaining
        )
        result = await infer_admitted(self.models, request.model_name, admitted)
        return self.encode(req, sig, result)

    def admit(
        self,
        request: Any,
        metadata: Mapping[str, Any],
        peer: Callable[[], str],
        remaining_s: float | None,
    ) -> tuple[InferRequest, Signature, Admitted]:
        """A ``ModelInferRequest`` parsed, checked and admitted (or why not, raised), from the
        call's metadata, its peer (asked only when keys are rate-limited) and the time left
        before its deadline."""
        name, version = request.model_name, request.model_version or None
        sig = self.models.signature(name, version)
        req = parse_request(request, sig, self.shm)
        key = api_key(metadata.get("authorization"), peer()) if self.limiter is not None else ""
        admitted = admit_infer(
            self.models,
            self.limiter,
            req,
            sig,
            version=version,
            tier=parse_tier(metadata.get(TIER_KEY)),
            timeout_s=remaining_s if remaining_s is not None and remaining_s < 1e6 else None,
            api_key=key,
        )
        return req, sig, admitted

    def encode(self, req: InferRequest, sig: Signature, result: InferResult) -> Any:
        """The ``ModelInferResponse`` of an answered request."""
        return encode_response(pb, req, sig, result.version, result.outputs, self.shm)


class _AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Bearer tokens in the ``authorization`` metadata (``native.auth_refusal``: health is
    open; the repository and shared-memory extensions are admin)."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        metadata = dict(details.invocation_metadata or ())
        refused = auth_refusal(self.tokens, details.method, metadata.get("authorization"))
        if refused is None:
            return await continuation(details)
        code, message = refused

        async def refuse(request: Any, context: Any) -> Any:
            await context.abort(code, message)

        handler = await continuation(details)
        if handler is not None and handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


class GrpcServer:
    """A gRPC server for a ``ModelServer`` on ``host:port`` (port 0 picks a free one).

    It runs in a uvloop event loop of its own thread, on ``transport`` (see the module's doc):
    ModelInfer and ModelStreamInfer are coroutines that gather into the models' batchers like
    the HTTP server's requests, with no thread per call waiting for the GIL behind the others;
    the other methods, and the pipeline ingest stream, run in a pool of ``workers`` threads."""

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
        shared_memory: SharedMemoryRegions = NO_REGIONS,
        transport: GrpcTransport = "auto",
    ) -> None:
        """``tls``: (certificate chain PEM, private key PEM) to serve over TLS. ``models`` may
        be None when only ``pipelines`` are served. ``model_control``: allow repository loads
        and unloads. ``shared_memory``: the system shared-memory regions (shared with the HTTP
        server). ``transport``: ``auto``, ``native`` or ``grpcio`` (BadRequest for ``native``
        with TLS)."""
        self.host = host
        self.transport = grpc_transport(transport, tls=tls is not None, host=host)
        self._aio = LoopThread("aisp-grpc-loop", fast=True)
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aisp-grpc")
        self._front: NativeFront | None = None
        self._socket_dir: str | None = None
        interceptors = [_AuthInterceptor(tokens)] if tokens is not None and tokens.enabled else []
        servicer = None
        if models is not None:
            servicer = InferenceServicer(
                models,
                metrics=metrics,
                limiter=limiter,
                model_control=model_control,
                shared_memory=shared_memory,
            )
        max_message = 64 << 20

        async def build() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server(
                migration_thread_pool=self._pool,
                interceptors=interceptors,
                options=[
                    ("grpc.max_receive_message_length", max_message),
                    ("grpc.max_send_message_length", max_message),
                ],
            )
            if servicer is not None:
                pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
            if pipelines:
                streams = PipelineStreams(
                    pipelines, admission_wait_s=admission_wait_ms / 1000, limiter=limiter
                )
                server.add_generic_rpc_handlers((streams.handler(),))
            if self.transport == "native":  # the streams, behind the native front
                self._socket_dir = tempfile.mkdtemp(prefix="aisp-grpc-")
                bound = server.add_insecure_port(f"unix:{self._socket_dir}/streams.sock")
            elif tls is None:
                bound = server.add_insecure_port(f"{host}:{port}")
            else:
                creds = grpc.ssl_server_credentials([(tls[1], tls[0])])
                bound = server.add_secure_port(f"{host}:{port}", creds)
            return server, bound

        self._server, self.port = self._aio.run(build())
        if self.transport == "native":
            try:
                self._front = NativeFront(
                    servicer,
                    host=host,
                    port=port,
                    fallback=f"{self._socket_dir}/streams.sock",
                    pool=self._pool,
                    tokens=tokens,
                    metrics=metrics,
                    max_message=max_message,
                )
            except OSError:
                self._close_loop()
                raise
            self.port = self._front.port
        self._started = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        self._aio.run(self._server.start())
        if self._front is not None:
            self._front.start()
        self._started = True

    def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new calls, let the ones in progress finish for up to ``grace_s``, then end."""
        if self._started:
            if self._front is not None:
                self._front.stop(grace_s)
            self._aio.run(self._server.stop(grace_s))
        self._close_loop()

    def _close_loop(self) -> None:
        self._aio.close()
        self._pool.shutdown(wait=False)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)


def _no_peer() -> str:
    return ""
