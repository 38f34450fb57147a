"""A served pipeline's ingest stream over gRPC: ``/aisp.v1.Pipelines/Events``, the gRPC form of
``POST /v1/pipelines/{p}/events`` (``http.events``), and how a failure becomes a gRPC status.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import msgspec

from aisp.admission.ratelimit import Limiter
from aisp.admission.tiers import TIER_KEY, parse_tier
from aisp.errors import AispError, BadRequest, NotFound, Overloaded
from aisp.serve.admission import PipelineAdmission
from aisp.serve.auth import api_key
from aisp.serve.pipelines.service import Chunk, InboxClosed, PipelineService

__all__ = ["EVENTS_METHOD", "PipelineStreams", "status_of"]

EVENTS_METHOD = "/aisp.v1.Pipelines/Events"
"""The pipeline ingest stream: bidirectional, raw bytes messages (NDJSON lines each way; to a
pipeline whose schema is ``RawMessage``, each message is one event's bytes)."""

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
            if isinstance(exc, Overloaded):  # when to come back, as HTTP's Retry-After-Ms
                context.set_trailing_metadata(
                    (("retry-after-ms", str(max(1, round(exc.retry_after_s * 1000)))),)
                )
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
                    data = bytes(message)  # NDJSON lines as over HTTP; a raw pipeline's: one event
                    lines = ([data] if data else []) if service.raw else [x for x in data.split(b"\n") if x]
                    if not lines:
                        continue
                    first = line == 1
                    moved = threading.Event()
                    try:
                        batch, chunk, errors = service.prepare(
                            lines,
                            notify=moved.set,
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
                        answers.put((chunk, moved))
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
                if isinstance(item, tuple):
                    yield from _answers(*item)
                elif isinstance(item, bytes):
                    yield item
        finally:
            stop.set()
            while reader.is_alive():  # unblock a reader waiting for room in the answer queue
                try:
                    item = answers.get(timeout=0.05)
                except queue.Empty:
                    continue
                if isinstance(item, tuple):
                    service.tracker.discard(item[0])


def _answers(chunk: Chunk, moved: threading.Event) -> Iterator[bytes]:
    """A chunk's result lines: in one message when it is done, and before that the pieces of
    results (an LLM step's tokens) as they come, each message what was new."""
    sent = 0
    while True:
        moved.clear()
        done = chunk.done.is_set()
        if chunk.pieces or (done and sent < chunk.n):
            upto = chunk.prefix
            data = chunk.stream(sent, upto)
            sent = max(sent, upto)
            if data:
                yield data
        if done:
            return
        moved.wait()


def _failed_message(n: int, first_line: int, exc: AispError, *, fire: bool) -> bytes:
    """The answer to a message none of whose ``n`` events could be taken."""
    encode = msgspec.json.encode
    if fire:
        errors = [{"line": first_line + i, "reason": str(exc)} for i in range(n)]
        return encode({"accepted": 0, "rejected": n, "errors": errors}) + b"\n"
    return b"".join(encode({"error": str(exc), "line": first_line + i}) + b"\n" for i in range(n))
