"""``POST /v1/pipelines/{pipeline}/events``: a served pipeline's NDJSON ingest over HTTP.

An NDJSON line may be up to ``max_line_bytes`` long (1 MiB), or ``MEDIA_LINE_BYTES`` for a
pipeline whose input schema has a ``bytes`` field (an image or audio as base64 in JSON: an event
of ``RAW_MAX_BYTES``, its base64 a third longer, and 64 KiB for its other fields). A longer line
is answered 413 with the limit in its JSON reason.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from aisp.admission.ratelimit import Limiter
from aisp.errors import AispError, BadRequest, NotFound, PayloadTooLarge
from aisp.serve.admission import PipelineAdmission
from aisp.serve.auth import api_key
from aisp.serve.headers import Headers
from aisp.serve.http.errors import error_response, parse_deadline_s, parse_tier_header
from aisp.serve.pipelines.service import Chunk, PipelineService

__all__ = ["MEDIA_LINE_BYTES", "NDJSON", "Events", "EventsSocket", "carries_bytes", "close_code"]

NDJSON = "application/x-ndjson"
RAW_MAX_BYTES = 32 << 20
"""The largest event of a pipeline whose schema is ``RawMessage`` (a whole body or message)."""
MEDIA_LINE_BYTES = (RAW_MAX_BYTES + 2) // 3 * 4 + (64 << 10)
"""The longest NDJSON line of a pipeline whose schema has a ``bytes`` field: ``RAW_MAX_BYTES``
as base64, and 64 KiB for the event's other fields."""
log = logging.getLogger("aisp.serve")


async def _pieces(receive: Receive) -> AsyncIterator[tuple[bytes, bool]]:
    """A request body's pieces as they arrive, each with whether more follow; a client that
    goes away raises ``ConnectionResetError``."""
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("client disconnected")
        more = message.get("more_body", False)
        yield message.get("body", b""), more


async def _body_whole(receive: Receive) -> AsyncIterator[list[bytes]]:
    """A raw pipeline's request: its whole body is one event (an image, an audio chunk)."""
    body = bytearray()
    async for data, _ in _pieces(receive):
        body += data
        if len(body) > RAW_MAX_BYTES:
            raise PayloadTooLarge(f"an event is larger than {RAW_MAX_BYTES} bytes")
    yield [bytes(body)]


async def _body_lines(receive: Receive, chunk_rows: int, max_line_bytes: int) -> AsyncIterator[list[bytes]]:
    """Non-empty lines of a (possibly chunked, unbounded) request body, at most ``chunk_rows``
    at a time, as they arrive. A line longer than ``max_line_bytes`` raises ``PayloadTooLarge``.
    The pieces of a line that spans many are held apart and joined once, when it ends."""
    held: list[bytes] = []  # the pieces of the line not ended yet
    held_bytes = 0
    async for data, more in _pieces(receive):
        if more and b"\n" not in data:
            held.append(data)
            held_bytes += len(data)
            _check_line(held_bytes, max_line_bytes)
            continue
        parts = data.split(b"\n")
        if held:
            parts[0] = b"".join([*held, parts[0]])
            held, held_bytes = [], 0
        if more:
            held.append(parts.pop())
            held_bytes = len(held[0])
        _check_line(max(held_bytes, *map(len, parts)), max_line_bytes)
        lines = [p for p in parts if p]  # blank lines are skipped; whitespace-only ones fail to parse
        for i in range(0, len(lines), chunk_rows):
            yield lines[i : i + chunk_rows]


def _check_line(length: int, max_line_bytes: int) -> None:
    if length > max_line_bytes:
        raise PayloadTooLarge(f"a line is longer than {max_line_bytes} bytes")


@functools.lru_cache(maxsize=256)
def carries_bytes(schema: type) -> bool:
    """Whether an input schema has a ``bytes`` field anywhere (nested, in a list, optional)."""

    def walk(t: Any, depth: int) -> bool:
        mi = msgspec.inspect
        if isinstance(t, mi.BytesType | mi.ByteArrayType | mi.MemoryViewType):
            return True
        if depth > 16:
            return False
        if isinstance(t, mi.StructType | mi.DataclassType | mi.TypedDictType | mi.NamedTupleType):
            return any(walk(f.type, depth + 1) for f in t.fields)
        if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
            return walk(t.item_type, depth + 1)
        if isinstance(t, mi.UnionType):
            return any(walk(x, depth + 1) for x in t.types)
        if isinstance(t, mi.TupleType):
            return any(walk(x, depth + 1) for x in t.item_types)
        if isinstance(t, mi.DictType):
            return walk(t.value_type, depth + 1)
        return False

    try:
        return walk(msgspec.inspect.type_info(schema), 0)
    except (TypeError, ValueError):  # not a type msgspec knows: no bytes it would decode
        return False


class Events:
    """``POST /v1/pipelines/{pipeline}/events``: NDJSON in, one NDJSON result per event out
    (as server-sent events with ``Accept: text/event-stream``).

    A raw ASGI endpoint, so the response streams while the (possibly unbounded, chunked) body is
    still being read: results go back in request order as the pipeline finishes them. With
    ``?mode=fire`` the events are only acknowledged, in bulk, once admitted (202 with counts).
    When the pipeline's admission queue is full the first chunk waits ``admission_wait_s``,
    then the request gets a 429 with ``Retry-After``; later chunks of a stream wait for room
    (the stream stops reading). A request keeps at most ``window_events`` events unanswered.

    Whatever goes wrong with one request is answered on that request alone: before the response
    starts, as a JSON error with its status (``http.errors``); after it, as an error line in the
    stream, which then ends.
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
        self.admissions = {
            name: PipelineAdmission(service, limiter=limiter, wait_s=admission_wait_s)
            for name, service in pipelines.items()
        }
        self.window_events = window_events
        self.max_line_bytes = max_line_bytes

    def line_limit(self, service: PipelineService) -> int:
        """The longest NDJSON line ``service`` takes: ``max_line_bytes``, or at least
        ``MEDIA_LINE_BYTES`` when its input schema has a ``bytes`` field."""
        schema = service.pipeline.input_schema
        if schema is not None and carries_bytes(schema):
            return max(self.max_line_bytes, MEDIA_LINE_BYTES)
        return self.max_line_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._serve(scope, receive, tracked)
        except ConnectionResetError:
            return
        except Exception as exc:  # noqa: BLE001 - answered on this request alone
            if started:  # the status went out: nothing more can be said on this response
                log.warning("pipeline request ended early: %s", exc)
                return
            await error_response(exc)(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        service = self.pipelines.get(scope["path_params"]["pipeline"])
        if service is None:
            names = sorted(self.pipelines)
            raise NotFound(f"no pipeline {scope['path_params']['pipeline']!r}; serving {names}")
        mode = request.query_params.get("mode", "results")
        if mode not in ("results", "fire"):
            raise BadRequest(f"mode must be 'results' or 'fire', got {mode[:40]!r}")
        timeout_s = parse_deadline_s(request.headers)
        tier = parse_tier_header(request.headers)
        deadline_ns = None if timeout_s is None else time.monotonic_ns() + int(timeout_s * 1e9)
        key = (
            api_key(request.headers.get("authorization"), _peer(request)) if self.limiter is not None else ""
        )
        if service.raw:
            stream = _body_whole(receive)
        else:
            stream = _body_lines(receive, service.chunk_rows, self.line_limit(service))
        parent = service.trace_parent(request.headers.get("traceparent"), request.headers.get("tracestate"))
        opts = {"deadline_ns": deadline_ns, "tier": tier, "trace_parent": parent}
        if mode == "fire":
            reply = await self._fire(service, stream, key, opts)
            await reply(scope, receive, send)
        else:
            sse = "text/event-stream" in request.headers.get("accept", "")
            await self._results(service, stream, key, opts, _SseOut(send) if sse else _HttpOut(send))

    async def _fire(
        self, service: PipelineService, stream: AsyncIterator[list[bytes]], key: str, opts: dict[str, Any]
    ) -> Response:
        accepted, line = 0, 1
        errors: list[dict[str, Any]] = []
        stopped = None
        try:
            async for lines in stream:
                decoded = await service.decode_async(lines)
                batch, _, bad = service.prepare(lines, decoded=decoded, track=False, first_line=line, **opts)
                await self.admissions[service.name].admit_async(
                    batch, None, key=key, tier=opts["tier"], first=line == 1
                )
                line += len(lines)
                accepted += len(lines) - len(bad)
                errors += bad[: max(0, 100 - len(errors))]
        except (AispError, ConnectionResetError) as exc:
            if line == 1:
                raise  # nothing admitted: the status says it all
            stopped = str(exc) or type(exc).__name__  # some events were admitted: say where it stopped
        body: dict[str, Any] = {"accepted": accepted, "rejected": line - 1 - accepted, "errors": errors}
        if stopped is not None:
            body["stopped"] = {"line": line, "error": stopped}
        return JSONResponse(body, status_code=202)

    async def _results(
        self,
        service: PipelineService,
        stream: AsyncIterator[list[bytes]],
        key: str,
        opts: dict[str, Any],
        out: _Out,
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
            await self.admissions[service.name].admit_async(
                batch, chunk, key=key, tier=opts["tier"], first=first
            )
            state["line"] += len(lines)
            state["unanswered"] += chunk.n
            pending.append(chunk)
            wake.set()

        first = await anext(stream, None)
        if first is not None:
            await admit_next(first, True)  # may refuse: nothing has been sent yet
        await out.start()

        async def read_rest() -> None:
            try:
                async for lines in stream:
                    while state["unanswered"] >= self.window_events:
                        room.clear()
                        await room.wait()
                    await admit_next(lines, False)
            except ConnectionResetError:
                pass
            except Exception as exc:  # noqa: BLE001 - answered in place: the status went out
                if not isinstance(exc, AispError):
                    log.exception("pipeline %s: reading a request failed", service.name)
                pending.append(_failed_chunk(str(exc) if isinstance(exc, AispError) else "internal error"))
            finally:
                state["reading"] = False
                wake.set()

        reader = asyncio.create_task(read_rest())
        try:
            sent = 0
            while True:
                wake.clear()
                ready = []
                while pending:
                    chunk = pending[0]
                    upto = chunk.prefix
                    if chunk.pieces:  # partial results (tokens): streamed as they come
                        ready.append(chunk.stream(sent, upto))
                        sent = max(sent, upto)
                    elif upto > sent:
                        ready.append(chunk.lines(sent, upto))
                        sent = upto
                    if sent < chunk.n:
                        break
                    pending.popleft()
                    sent = 0
                    state["unanswered"] -= chunk.n
                    room.set()
                if any(ready):
                    await out.write(b"".join(ready))
                elif not pending and not state["reading"]:
                    break
                else:
                    await wake.wait()
            await out.end()
        finally:
            reader.cancel()
            for chunk in pending:
                service.tracker.discard(chunk)


class _Out(Protocol):
    """Where ``_results`` writes: the status (``start``), result lines, the end."""

    async def start(self) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...


class _HttpOut:
    """A streamed NDJSON response."""

    def __init__(self, send: Send) -> None:
        self._send = send

    async def start(self) -> None:
        headers = [(b"content-type", NDJSON.encode())]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    async def write(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


class _SseOut(_HttpOut):
    """The same lines as server-sent events (``Accept: text/event-stream``): ``data: LINE``
    each; the end of the results is the end of the stream."""

    async def start(self) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    async def write(self, data: bytes) -> None:
        events = b"".join(b"data: " + line + b"\n\n" for line in data.split(b"\n") if line)
        await super().write(events)


class _SocketOut:
    """Text messages on an accepted WebSocket, each holding whole NDJSON result lines."""

    def __init__(self, send: Send) -> None:
        self._send = send

    async def start(self) -> None:
        pass

    async def write(self, data: bytes) -> None:
        await self._send({"type": "websocket.send", "text": data.decode()})

    async def end(self) -> None:
        pass


def close_code(exc: BaseException) -> int:
    """The WebSocket close code of a failure: 4000 + its HTTP status (4400 bad input, 4404 no
    such pipeline, 4429 overloaded, 4503 draining, ...); 1011 for a fault of the server."""
    return 4000 + exc.http_status if isinstance(exc, AispError) else 1011


class EventsSocket:
    """``/v1/pipelines/{pipeline}/ws``: the WebSocket form of ``Events`` (results mode).

    Each message from the client (text or binary) holds whole NDJSON events; an empty message
    ends the input. Results go back as text messages of whole NDJSON result lines, in the order
    of the events, as the pipeline finishes them; after the last one the server closes with
    1000. The handshake's headers carry the tier, the deadline and the token, as over HTTP.
    What fails closes the socket with ``close_code`` and the reason: before any event was taken
    (an unknown pipeline, a full admission queue after ``admission_wait_s``), or in the stream
    after an error line. A full queue later in the stream stops reading the socket.
    """

    def __init__(self, events: Events) -> None:
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        try:
            await self._serve(scope, receive, send)
        except ConnectionResetError:
            return
        except Exception as exc:  # noqa: BLE001 - this socket closes with the reason, the others go on
            if not isinstance(exc, AispError):
                log.exception("pipeline socket failed")
            reason = str(exc) if isinstance(exc, AispError) else "internal error"
            await _close(send, close_code(exc), reason)
            return
        await _close(send, 1000, "")

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        events = self.events
        name = scope["path_params"]["pipeline"]
        service = events.pipelines.get(name)
        if service is None:
            raise NotFound(f"no pipeline {name!r}; serving {sorted(events.pipelines)}")
        headers = Headers.of(scope)
        timeout_s, tier = parse_deadline_s(headers), parse_tier_header(headers)
        deadline_ns = None if timeout_s is None else time.monotonic_ns() + int(timeout_s * 1e9)
        client = scope.get("client")
        peer = client[0] if client else "unknown"
        key = api_key(headers.get("authorization"), peer) if events.limiter is not None else ""
        parent = service.trace_parent(headers.get("traceparent"), headers.get("tracestate"))
        opts = {"deadline_ns": deadline_ns, "tier": tier, "trace_parent": parent}
        limit = RAW_MAX_BYTES if service.raw else events.line_limit(service)
        stream = _socket_lines(receive, service.chunk_rows, limit, raw=service.raw)
        await events._results(service, stream, key, opts, _SocketOut(send))


async def _socket_lines(
    receive: Receive, chunk_rows: int, max_bytes: int, *, raw: bool = False
) -> AsyncIterator[list[bytes]]:
    """The non-empty lines of each message, at most ``chunk_rows`` at a time (``raw``: each
    message is one event), until an empty message (the end of the input) or a disconnect."""
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            raise ConnectionResetError("client disconnected")
        data = message.get("bytes") or (message.get("text") or "").encode()
        if not data:
            return
        if raw:
            if len(data) > max_bytes:
                raise PayloadTooLarge(f"an event is larger than {max_bytes} bytes")
            yield [data]
            continue
        parts = data.split(b"\n")
        if len(data) > max_bytes and max(map(len, parts)) > max_bytes:
            raise PayloadTooLarge(f"a line is longer than {max_bytes} bytes")
        lines = [p for p in parts if p]
        for i in range(0, len(lines), chunk_rows):
            yield lines[i : i + chunk_rows]


async def _close(send: Send, code: int, reason: str) -> None:
    reason_bytes = reason.encode()[:123]  # the protocol's limit for a close reason
    try:
        await send(
            {"type": "websocket.close", "code": code, "reason": reason_bytes.decode("utf-8", "ignore")}
        )
    except Exception:  # noqa: BLE001, S110 - the client is gone already
        pass


def _failed_chunk(reason: str) -> Chunk:
    chunk = Chunk(0, 1)
    chunk.results[0] = msgspec.json.encode({"error": reason})
    chunk.open[0] = 0
    chunk.prefix = 1
    return chunk


def _peer(request: Request) -> str:
    return request.client.host if request.client else "unknown"
