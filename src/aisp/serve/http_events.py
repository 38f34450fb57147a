"""``POST /v1/pipelines/{pipeline}/events``: a served pipeline's NDJSON ingest over HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aisp.errors import AispError, BadRequest, NotFound, PayloadTooLarge
from aisp.schedule.ratelimit import Limiter
from aisp.serve.admission import PipelineAdmission
from aisp.serve.auth import api_key
from aisp.serve.http_errors import error_response, parse_deadline_s, parse_tier_header
from aisp.serve.pipelines import Chunk, PipelineService

__all__ = ["NDJSON", "Events"]

NDJSON = "application/x-ndjson"
log = logging.getLogger("aisp.serve")


async def _body_lines(receive: Any, chunk_rows: int, max_line_bytes: int) -> AsyncIterator[list[bytes]]:
    """Non-empty lines of a (possibly chunked, unbounded) request body, at most ``chunk_rows``
    at a time, as they arrive. A line longer than ``max_line_bytes`` raises ``PayloadTooLarge``."""
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
            raise PayloadTooLarge(f"a line is longer than {max_line_bytes} bytes")
        lines = [p for p in parts if p]  # blank lines are skipped; whitespace-only ones fail to parse
        for i in range(0, len(lines), chunk_rows):
            yield lines[i : i + chunk_rows]


class Events:
    """``POST /v1/pipelines/{pipeline}/events``: NDJSON in, one NDJSON result per event out.

    A raw ASGI endpoint, so the response streams while the (possibly unbounded, chunked) body is
    still being read: results go back in request order as the pipeline finishes them. With
    ``?mode=fire`` the events are only acknowledged, in bulk, once admitted (202 with counts).
    When the pipeline's admission queue is full the first chunk waits ``admission_wait_s``,
    then the request gets a 429 with ``Retry-After``; later chunks of a stream wait for room
    (the stream stops reading). A request keeps at most ``window_events`` events unanswered.

    Whatever goes wrong with one request is answered on that request alone: before the response
    starts, as a JSON error with its status (``http_errors``); after it, as an error line in the
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

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
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

    async def _serve(self, scope: Any, receive: Any, send: Any) -> None:
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
        stream = _body_lines(receive, service.chunk_rows, self.max_line_bytes)
        parent = service.trace_parent(request.headers.get("traceparent"), request.headers.get("tracestate"))
        opts = {"deadline_ns": deadline_ns, "tier": tier, "trace_parent": parent}
        if mode == "fire":
            reply = await self._fire(service, stream, key, opts)
            await reply(scope, receive, send)
        else:
            await self._results(service, stream, key, opts, send)

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


def _failed_chunk(reason: str) -> Chunk:
    chunk = Chunk(0, 1)
    chunk.results[0] = msgspec.json.encode({"error": reason})
    chunk.open[0] = 0
    chunk.prefix = 1
    return chunk


def _peer(request: Request) -> str:
    return request.client.host if request.client else "unknown"
