from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from aisp.faults import FaultProxy, Faults


@pytest.fixture
def echo() -> Iterator[int]:
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=pump, args=(conn,), daemon=True).start()

    def pump(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the proxy may reset us: that is the point
            while data := conn.recv(65536):
                conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    srv.close()


def roundtrip(port: int, payload: bytes = b"ping", timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_forwards_both_ways(echo: int) -> None:
    with FaultProxy(("127.0.0.1", echo)) as proxy:
        assert roundtrip(proxy.port, b"x" * 100_000) == b"x" * 100_000


def test_delay_is_added_each_way(echo: int) -> None:
    with FaultProxy(("127.0.0.1", echo), faults=Faults(delay_ms=100)) as proxy:
        t0 = time.monotonic()
        assert roundtrip(proxy.port) == b"ping"
        assert time.monotonic() - t0 >= 0.2  # 100 ms out, 100 ms back


def test_refuse_resets_new_connections(echo: int) -> None:
    with FaultProxy(("127.0.0.1", echo)) as proxy:
        proxy.set(refuse=True)
        try:
            got = roundtrip(proxy.port)
        except OSError:  # reset while connecting, sending or reading
            got = b""
        assert got == b""
        proxy.clear()
        assert roundtrip(proxy.port) == b"ping"


def test_blackhole_never_answers(echo: int) -> None:
    with FaultProxy(("127.0.0.1", echo), faults=Faults(blackhole=True)) as proxy, pytest.raises(TimeoutError):
        roundtrip(proxy.port, timeout=0.3)


def test_dropped_connections_are_reset_and_new_ones_work_again(echo: int) -> None:
    with FaultProxy(("127.0.0.1", echo), faults=Faults(drop=1.0)) as proxy:
        with pytest.raises(OSError):  # reset: the chunk went with the connection
            got = roundtrip(proxy.port)
            if not got:
                raise ConnectionResetError("closed")
        proxy.set(drop=0.0)
        assert roundtrip(proxy.port, b"y" * 10_000) == b"y" * 10_000
