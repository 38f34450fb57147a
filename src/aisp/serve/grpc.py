"""Open Inference Protocol v2 over gRPC: ``inference.GRPCInferenceService``.

Built on the generated stubs that ship in ``tritonclient`` (no hand-written protos), so
``tritonclient.grpc`` talks to it unmodified. Every ModelInfer goes through the model's dynamic
batcher (``ModelServer``). Implemented: ServerLive, ServerReady, ModelReady, ServerMetadata,
ModelMetadata, ModelConfig, ModelInfer (typed ``contents`` and ``raw_input_contents``),
ModelStreamInfer, RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload. The others answer
UNIMPLEMENTED. Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from aisp.errors import AispError, ModelError
from aisp.serve.auth import Scope, Tokens
from aisp.serve.metrics import ServerMetrics
from aisp.serve.models import NP_TO_OIP, OIP_TO_NP, ModelServer, RequestFailed

__all__ = ["GrpcServer", "InferenceServicer"]

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
    ) -> None:
        self.models = server
        self.name, self.version = name, version
        self.metrics = metrics

    def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 - the protocol's names
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ServerReadyResponse(ready=True)

    def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ModelReadyResponse(ready=self.models.ready(request.name, request.version or None))

    def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        extensions = ["model_repository", "schedule_policy", "model_configuration"]
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
                label = request.model_name if request.model_name in self.models.models else "unknown"
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
        result = self.models.infer(
            request.model_name,
            inputs,
            version=request.model_version or None,
            priority=priority,
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
        models: ModelServer,
        *,
        host: str = "127.0.0.1",
        port: int = 8001,
        workers: int = 32,
        tokens: Tokens | None = None,
        tls: tuple[bytes, bytes] | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        """``tls``: (certificate chain PEM, private key PEM) to serve over TLS."""
        interceptors = [_AuthInterceptor(tokens)] if tokens is not None and tokens.enabled else []
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aisp-grpc"),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ],
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(models, metrics=metrics), self._server
        )
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
