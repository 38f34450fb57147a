"""An asyncio TCP fault proxy, placed between a client and a server (a broker, a remote model).

It forwards bytes both ways and applies the current ``Faults``: added latency with jitter per
chunk, a bandwidth limit, connections dropped at random (a flaky link), refusing new connections
(reset), resetting open ones, or a blackhole (accept and read, forward nothing). Faults can be
changed while it runs; ``FaultProxy`` runs its own event loop in a thread so synchronous tests
and tools can drive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["FaultProxy", "Faults"]


@dataclass(frozen=True, kw_only=True)
class Faults:
    """What the proxy does to traffic now.

    Args:
        delay_ms: latency added to every chunk forwarded, each way.
        jitter_ms: uniform extra latency in ``[0, jitter_ms]``.
        bandwidth_bytes_per_s: throughput cap per direction (0: none).
        drop: the chance, per chunk forwarded, that the connection is dropped instead (both
            peers see a reset; what was in the chunk is lost with it).
        refuse: reset new connections at once.
        blackhole: accept, read and drop everything; never answer.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    drop: float = 0.0
    refuse: bool = False
    blackhole: bool = False


class FaultProxy:
    """Listens on ``127.0.0.1:listen_port`` (0: a free port) and forwards to ``target``.

    >>> import socket
    >>> srv = socket.create_server(("127.0.0.1", 0)); port = srv.getsockname()[1]
    >>> with FaultProxy(("127.0.0.1", port)) as proxy:
    ...     proxy.port > 0
    True
    >>> srv.close()
    """

    def __init__(
        self, target: tuple[str, int], *, listen_port: int = 0, faults: Faults | None = None
    ) -> None:
        self.target = target
        self.faults = faults or Faults()
        self._listen_port = listen_port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aisp-fault-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.connections = 0

    # -- control ------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def set(self, **changes: Any) -> None:
        """Change the faults (e.g. ``proxy.set(delay_ms=200)``); open connections see it at once."""
        self.faults = replace(self.faults, **changes)

    def clear(self) -> None:
        self.faults = Faults()

    def reset_connections(self) -> None:
        """Abort every open connection (the peers see a reset)."""
        asyncio.run_coroutine_threadsafe(self._reset_all(), self._loop).result(timeout=10)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the event loop side ------------------------------------------------------------------
    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self._listen_port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self._reset_all()

    async def _reset_all(self) -> None:
        for w in list(self._conns):
            _abort(w)
        self._conns.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.faults.refuse:
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _abort(writer)
            return
        self._conns.update((writer, up_writer))
        pair = (writer, up_writer)
        try:
            await asyncio.gather(self._pipe(reader, up_writer, pair), self._pipe(up_reader, writer, pair))
        finally:
            for w in (writer, up_writer):
                self._conns.discard(w)
                with contextlib.suppress(Exception):
                    w.close()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        try:
            while data := await reader.read(65536):
                f = self.faults
                if f.blackhole:
                    continue
                if f.drop and random.random() < f.drop:  # noqa: S311 - a fault, not a secret
                    for w in pair:
                        _abort(w)
                    return
                wait = f.delay_ms / 1000 + (random.uniform(0, f.jitter_ms) / 1000 if f.jitter_ms else 0.0)  # noqa: S311
                if f.bandwidth_bytes_per_s > 0:
                    wait += len(data) / f.bandwidth_bytes_per_s
                if wait > 0:
                    await asyncio.sleep(wait)
                if writer.is_closing():
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            return
        finally:
            with contextlib.suppress(Exception):
                if writer.can_write_eof():
                    writer.write_eof()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0) so the peer sees a reset, not a clean end."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    writer.transport.abort()
