"""The native gRPC transport: ``pygrpc_native``'s ``NativeGrpcFront`` (HTTP/2, framing, flow
control and deadlines in Rust, on tokio threads outside the GIL) with AISP's own dispatch.

Why not ``pygrpc_native.aio.server()``, its grpcio-compatible server: it makes a call object, a
servicer context and a task per call and runs the handler's coroutine, which waits on a future
of its own, and every call crosses from the front's thread to the event loop's (each crossing
waits for the GIL). Calls reach Python in batches; this front keeps them batched and has no event
loop on the unary path: one dispatch thread takes each batch of calls, parses, checks and admits
every ModelInfer in it and submits them together with a callback each (``ModelServer.collect``,
``submit_collected``): the calls of one batch are answered by one model call, made in that
thread when the model is idle and cheap (in a batcher's thread otherwise, which answers them),
and no task, future, context or waiting thread exists per call. The other unary methods are the
servicer's own, run in the thread pool with a small context (``_Context``: metadata, peer,
deadline, ``abort``). The
bidirectional streams (ModelStreamInfer, the pipeline ingest stream) and unknown methods are
forwarded by the front to a grpc.aio server on a Unix socket (``fallback``), which the caller
builds and owns.

Statuses, auth and limits are those of the grpc.aio transport: a failure is answered with
``status_of``'s status; bearer tokens are checked before a method runs (health open, the
repository and shared-memory extensions admin); a request larger than ``max_message`` is refused
with RESOURCE_EXHAUSTED. No TLS (the front has none). The front reads a whole message (up to the
4 GiB gRPC framing allows) before it reaches Python, where grpc.aio refuses one past its limit at
the frame's header: a hostile client can make the process hold that much, which is why
``grpc_transport`` makes this transport the default on a loopback address only.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from pygrpc_native import EVENT_CALL, NativeGrpcFront
from tritonclient.grpc import service_pb2 as pb

from aisp.errors import AispError, BadRequest
from aisp.serve.admission import collect_admitted
from aisp.serve.auth import Scope, Tokens
from aisp.serve.grpc.events import status_of
from aisp.serve.metrics import ServerMetrics
from aisp.serve.models.served import InferResult
from aisp.serve.oip.request import InferRequest, Signature

__all__ = ["NativeFront", "auth_refusal"]

log = logging.getLogger("aisp.serve")

SERVICE = "inference.GRPCInferenceService"
OPEN_METHODS = frozenset({f"/{SERVICE}/ServerLive", f"/{SERVICE}/ServerReady"})
ADMIN_METHODS = frozenset(
    {
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
        "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus",
        "CudaSharedMemoryRegister",
        "CudaSharedMemoryUnregister",
    }
)


def auth_refusal(
    tokens: Tokens | None, method: str, authorization: str | None
) -> tuple[grpc.StatusCode, str] | None:
    """Why a call of ``method`` (``/service/Method``) with this ``authorization`` metadata is
    refused, or None: health is open; the repository and shared-memory extensions need an admin
    token, the rest an infer one."""
    if tokens is None or not tokens.enabled or method in OPEN_METHODS:
        return None
    scope: Scope = "admin" if method.rsplit("/", 1)[-1] in ADMIN_METHODS else "infer"
    status = tokens.check(authorization, scope)
    if status == 200:
        return None
    if status == 401:
        return grpc.StatusCode.UNAUTHENTICATED, "unauthorized"
    return grpc.StatusCode.PERMISSION_DENIED, "forbidden"


class _Abort(Exception):  # noqa: N818 - a control-flow signal, as grpc's own abort
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What the servicer's unary methods ask of grpc's ``ServicerContext``."""

    __slots__ = ("_deadline", "_metadata", "_peer", "code", "details")

    def __init__(self, metadata: tuple[tuple[str, Any], ...], peer: str, remaining_s: float | None) -> None:
        self._metadata, self._peer = metadata, peer
        self._deadline = None if remaining_s is None else time.monotonic() + remaining_s
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Abort(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


def _code(status: grpc.StatusCode) -> int:
    return int(status.value[0])


class NativeFront:
    """The unary methods of ``servicer`` (an ``InferenceServicer``, or None when only pipelines
    are served) on ``host:port``; everything else goes to the grpc.aio server listening on the
    Unix socket ``fallback``. ``start()`` serves; ``stop`` refuses new calls and waits up to
    ``grace_s`` for the ones in progress."""

    def __init__(
        self,
        servicer: Any,
        *,
        host: str,
        port: int,
        fallback: str,
        pool: futures.Executor,
        tokens: Tokens | None = None,
        metrics: ServerMetrics | None = None,
        max_message: int = 64 << 20,
    ) -> None:
        self._servicer = servicer
        self._pool = pool
        self._tokens = tokens if tokens is not None and tokens.enabled else None
        self._metrics = metrics
        self._max_message = max_message
        self._fallback = fallback
        self._table: list[tuple[str, Callable[..., None]]] = []
        if servicer is not None:
            for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
                if method.client_streaming or method.server_streaming:
                    continue  # the fallback's
                path = f"/{SERVICE}/{method.name}"
                if method.name == "ModelInfer":
                    self._table.append((path, self._infer))
                else:
                    parse = getattr(pb, method.input_type.name).FromString
                    run = functools.partial(self._unary, getattr(servicer, method.name), parse)
                    self._table.append((path, run))
        try:
            self._front = NativeGrpcFront(
                f"{host}:{port}", [(p, False) for p, _ in self._table], call_details=True
            )
        except OSError as exc:
            raise OSError(f"cannot bind the gRPC port {host}:{port}: {exc}") from exc
        self.port = self._front.bound_port
        self._thread: threading.Thread | None = None
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stopping = False

    def start(self) -> None:
        self._front.set_fallback(self._fallback)
        self._front.start()
        self._thread = threading.Thread(target=self._dispatch, name="aisp-grpc-native", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float) -> None:
        """Refuse new calls (UNAVAILABLE), wait up to ``grace_s`` for those in progress, close."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self._in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        self._front.close()
        if self._thread is not None:
            self._thread.join(5)

    # -- dispatch -----------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """(Its own thread) every batch of calls, as it comes."""
        while (events := self._front.recv_batch_details(64)) is not None:
            try:
                self._on_events(events)
            except Exception:  # noqa: BLE001 - never ends the thread: each call has been answered
                log.exception("gRPC dispatch failed")

    def _on_events(self, events: list[Any]) -> None:
        """Start every call of a batch; its ModelInfer calls are submitted together."""
        front = self._front
        collected: dict[Any, list[Any]] = {}
        for kind, call_id, method_id, payload, _, details in events:
            if kind != EVENT_CALL:
                continue  # a cancel: the front drops the answer of a call its client left
            if self._stopping:
                front.fail(call_id, _code(grpc.StatusCode.UNAVAILABLE), "the server is shutting down")
                continue
            path, run = self._table[method_id]
            metadata, peer, remaining = details
            refused = auth_refusal(self._tokens, path, _authorization(metadata))
            if refused is not None:
                front.fail(call_id, _code(refused[0]), refused[1])
                continue
            if len(payload) > self._max_message:
                front.fail(
                    call_id,
                    _code(grpc.StatusCode.RESOURCE_EXHAUSTED),
                    f"received message larger than max ({len(payload)} vs. {self._max_message})",
                )
                continue
            with self._lock:
                self._in_flight += 1
            run(collected, call_id, payload, metadata, peer, remaining)
        if collected:
            self._servicer.models.submit_collected(collected)

    def _done(self) -> None:
        with self._lock:
            self._in_flight -= 1

    # -- ModelInfer ---------------------------------------------------------------------------
    def _infer(
        self,
        collected: dict[Any, list[Any]],
        call_id: int,
        payload: bytes,
        metadata: tuple[tuple[str, Any], ...],
        peer: str,
        remaining: float | None,
    ) -> None:
        """Parse, check and admit one ModelInfer into ``collected``; ``_answer`` answers it."""
        started = time.perf_counter()
        servicer = self._servicer
        request = None
        try:
            try:
                request = pb.ModelInferRequest.FromString(payload)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, and what else it raises
                raise BadRequest(f"the request is not a ModelInferRequest: {exc}") from exc
            req, sig, admitted = servicer.admit(request, dict(metadata), lambda: peer, remaining)
            answer = functools.partial(self._answer, call_id, request, req, sig, started)
            collect_admitted(servicer.models, collected, request.model_name, admitted, answer)
        except Exception as exc:  # noqa: BLE001 - every failure is answered with its status
            self._refuse(call_id, request, exc, started)

    def _answer(
        self,
        call_id: int,
        request: Any,
        req: InferRequest,
        sig: Signature,
        started: float,
        result: InferResult | AispError,
    ) -> None:
        """(The thread that finished it) a ModelInfer's answer, or its failure."""
        if isinstance(result, Exception):
            self._refuse(call_id, request, result, started)
            return
        try:
            data = self._servicer.encode(req, sig, result).SerializeToString()
        except Exception as exc:  # noqa: BLE001 - an output that cannot be encoded, shared memory gone
            self._refuse(call_id, request, exc, started)
            return
        self._front.respond(call_id, data)
        self._observe(request, "OK", started)
        self._done()

    def _refuse(self, call_id: int, request: Any, exc: Exception, started: float) -> None:
        status, details = status_of(exc)
        self._front.fail(call_id, _code(status), details)
        self._observe(request, status.name, started)
        self._done()

    def _observe(self, request: Any, code: str, started: float) -> None:
        if self._metrics is None:
            return
        models = self._servicer.models
        name = request.model_name if request is not None else ""
        label = name if name and models.is_loaded(name) else "unknown"
        self._metrics.observe("grpc", label, code, time.perf_counter() - started)

    # -- the other unary methods --------------------------------------------------------------
    def _unary(
        self,
        method: Callable[[Any, Any], Any],
        parse: Callable[[bytes], Any],
        collected: dict[Any, list[Any]],
        call_id: int,
        payload: bytes,
        metadata: tuple[tuple[str, Any], ...],
        peer: str,
        remaining: float | None,
    ) -> None:
        """A servicer method other than ModelInfer, run in the thread pool."""
        self._pool.submit(
            self._run_unary, method, parse, call_id, payload, _Context(metadata, peer, remaining)
        )

    def _run_unary(
        self,
        method: Callable[[Any, Any], Any],
        parse: Callable[[bytes], Any],
        call_id: int,
        payload: bytes,
        context: _Context,
    ) -> None:
        """(A pool thread) run it, answer it (the front answers from any thread)."""
        front = self._front
        try:
            try:
                request = parse(payload)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and the like
                raise BadRequest(f"the request is not a valid message: {exc}") from exc
            response = method(request, context)
            if context.code not in (None, grpc.StatusCode.OK):
                front.fail(call_id, _code(context.code), context.details)
            else:
                front.respond(call_id, response.SerializeToString())
        except _Abort as abort:
            front.fail(call_id, _code(abort.code), abort.details)
        except Exception as exc:  # noqa: BLE001 - every failure is answered with its status
            if context.code not in (None, grpc.StatusCode.OK):  # the base servicer's UNIMPLEMENTED
                front.fail(call_id, _code(context.code), context.details or str(exc))
            else:
                status, details = status_of(exc)
                front.fail(call_id, _code(status), details)
        finally:
            self._done()


def _authorization(metadata: tuple[tuple[str, Any], ...]) -> str | None:
    for key, value in metadata:
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None
