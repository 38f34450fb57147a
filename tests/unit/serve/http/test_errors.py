"""``JsonErrorsHttpTools``: uvicorn's httptools protocol answering a request it cannot parse with a
JSON 400, and a response's headers and body in one write. It subclasses a uvicorn internal, so a
uvicorn upgrade that changes that internal must fail here, loudly and by name, not quietly turn
the answer back into plain text."""

from __future__ import annotations

import inspect
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aisp.serve.http.errors import JsonErrorsHttpTools

UPGRADE = f"uvicorn {uvicorn.__version__} changed HttpToolsProtocol: check JsonErrorsHttpTools against it"


def test_the_uvicorn_internal_it_overrides_is_still_there() -> None:
    own = inspect.signature(HttpToolsProtocol.send_400_response)
    assert list(own.parameters) == ["self", "msg"], UPGRADE
    source = inspect.getsource(HttpToolsProtocol)
    assert "self.send_400_response(" in source, UPGRADE  # the parser's errors still go through it
    for used in ("self.server_state.default_headers", "self.transport"):
        assert used in source, f"{UPGRADE} ({used} is gone)"
    # the WebSocket upgrade hands the connection's transport to the WebSocket protocol
    upgrade = inspect.getsource(HttpToolsProtocol.handle_websocket_upgrade)
    assert "protocol.connection_made(self.transport)" in upgrade, UPGRADE


async def _app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never reached
    raise AssertionError("a request that cannot be parsed never reaches the app")


def test_a_request_that_cannot_be_parsed_gets_a_json_400() -> None:
    config = uvicorn.Config(_app, host="127.0.0.1", port=0, http=JsonErrorsHttpTools, log_level="critical")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"NOT A REQUEST LINE\r\n\r\n")
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert b"content-type: application/json" in head.lower()
        assert set(json.loads(body)) == {"error"}
    finally:
        server.should_exit = True
        thread.join(10)


class _Recording:
    """A transport that records each write (what the socket would get as one send)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def test_a_responses_headers_and_body_go_out_in_one_write_and_close_sends_what_is_held() -> None:
    import asyncio

    from uvicorn.server import ServerState

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"hello"})

    async def run(requests: bytes) -> _Recording:
        config = uvicorn.Config(app, http=JsonErrorsHttpTools, log_level="critical", lifespan="off")
        config.load()
        protocol = JsonErrorsHttpTools(config=config, server_state=ServerState(), app_state={})
        transport = _Recording()
        protocol.connection_made(transport)  # type: ignore[arg-type]
        protocol.data_received(requests)
        for _ in range(20):
            await asyncio.sleep(0)
        return transport

    one = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    transport = asyncio.run(run(one * 3))  # three pipelined requests
    assert len(transport.writes) == 3, transport.writes
    assert all(w.startswith(b"HTTP/1.1 200 OK") and w.endswith(b"hello") for w in transport.writes), (
        transport.writes
    )
    # a connection the client asked to close: the response, then the close
    transport = asyncio.run(run(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"))
    assert len(transport.writes) == 1 and transport.writes[0].endswith(b"hello") and transport.closed
