"""Errors as HTTP responses: always JSON ``{"error": ...}``, with the status the error carries.

A ``RequestError`` answers with its own status (400, 403, 404, 413, 429 with ``Retry-After``,
503, 504); anything else is a fault of the server: 500, logged with its traceback. The app's
handlers give unmatched routes (404) and methods (405) the same JSON form.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aisp.admission.tiers import TIER_HEADER, parse_tier
from aisp.errors import AispError
from aisp.serve.headers import DEADLINE_HEADER, parse_deadline_ms

__all__ = [
    "EXCEPTION_HANDLERS",
    "JsonErrorsHttpTools",
    "error_response",
    "guarded",
    "parse_deadline_s",
    "parse_tier_header",
]

log = logging.getLogger("aisp.serve")

Endpoint = Callable[[Request], Awaitable[Response]]


def error_response(exc: BaseException) -> JSONResponse:
    """The response for ``exc``; a server fault is logged with its traceback."""
    status = exc.http_status if isinstance(exc, AispError) else 500
    headers = {}
    body: dict[str, Any] = {}
    if status in (429, 503):  # overloaded, or draining: when to come back (whole seconds, as
        retry_s = getattr(exc, "retry_after_s", 1.0)  # RFC 9110 says; milliseconds beside it)
        headers["Retry-After"] = str(max(1, math.ceil(retry_s)))
        headers["Retry-After-Ms"] = str(max(1, round(retry_s * 1000)))
        body["retry_after_ms"] = max(1, round(retry_s * 1000))
    if status == 500:
        log.error("request failed: %s", exc, exc_info=exc)
    message = str(exc) if isinstance(exc, AispError) else f"internal server error: {type(exc).__name__}"
    return JSONResponse({"error": message, **body}, status_code=status, headers=headers)


def guarded(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` with every exception it raises answered by ``error_response``."""

    @functools.wraps(endpoint)
    async def call(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as exc:  # noqa: BLE001 - every failure is answered, typed or not
            return error_response(exc)

    return call


def parse_deadline_s(headers: Mapping[str, str]) -> float | None:
    ms = parse_deadline_ms(headers.get(DEADLINE_HEADER))
    return None if ms is None else ms / 1000


def parse_tier_header(headers: Mapping[str, str]) -> int | None:
    return parse_tier(headers.get(TIER_HEADER), TIER_HEADER)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    phrase = {404: "Not Found", 405: "Method Not Allowed"}.get(exc.status_code, str(exc.detail))
    return JSONResponse({"error": phrase}, status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(exc)


EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
    HTTPException: _http_error,
    Exception: _server_error,
}
"""Starlette ``exception_handlers``: JSON for unmatched routes and methods, and for faults."""


class _OneWrite:
    """A connection's transport whose writes within one turn of the event loop go out as one.

    uvicorn writes a response's status line and headers when the app sends them, and its body
    when that comes: two ``send`` system calls a response, and for small answers they were the
    largest part of serving one (42% of the CPU samples at 256 connections). An app sends both
    in the same turn of the loop, so holding what is written until the turn ends sends them in
    one. ``close`` sends what is held first; everything else is the transport's."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(bytes(data))

    def _flush(self) -> None:
        if self._held:
            data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
            self._held.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._held.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class JsonErrorsHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering a request it cannot parse (bad request line,
    headers or framing) with a JSON error like every other, instead of plain text; a response's
    headers and body go out in one write (``_OneWrite``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_OneWrite(transport))  # type: ignore[arg-type]
        self._raw = transport

    def handle_websocket_upgrade(self) -> None:
        """A WebSocket takes the connection's own transport (its frames are written by its
        protocol, which has its own buffering)."""
        cast(Any, self.transport)._flush()
        self.transport = self._raw
        super().handle_websocket_upgrade()

    def send_400_response(self, msg: str) -> None:
        body = b'{"error":' + msgspec.json.encode(msg) + b"}"
        content = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            content += [name, b": ", value, b"\r\n"]
        content += [
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
        self.transport.write(b"".join(content))
        self.transport.close()
