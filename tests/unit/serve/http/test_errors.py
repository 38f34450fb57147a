"""``JsonErrorsHttpTools``: uvicorn's httptools protocol answering a request it cannot parse with a
JSON 400. It subclasses a uvicorn internal, so a uvicorn upgrade that changes that internal must
fail here, loudly and by name, not quietly turn the answer back into plain text."""

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
