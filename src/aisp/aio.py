"""A private event loop in a daemon thread, for synchronous callers of asyncio code.

Connectors run in executor threads, but some broker clients (``nats-py``) are asyncio-only, and
the gRPC server runs on ``grpc.aio``. ``LoopThread`` is anyio's ``BlockingPortal`` (an event
loop in a thread of its own, calls into it that wait for their result and are cancelled when
they time out) with what the connectors add: set-up errors named, and a close that ends a
client's own background tasks, with every wait bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """One event loop in one thread named ``name``; ``close()`` stops both.

    >>> async def add(a: int, b: int) -> int:
    ...     return a + b
    >>> loop = LoopThread("doc")
    >>> loop.run(add(1, 2))
    3
    >>> loop.close()
    """

    def __init__(self, name: str, *, fast: bool = False) -> None:
        """``fast``: a uvloop loop (where a server's event loop is the bottleneck; the gRPC
        server answers 35% more calls on it), else asyncio's own."""
        started: Future[BlockingPortal] = Future()

        async def serve() -> None:
            async with BlockingPortal() as portal:
                started.set_result(portal)
                await portal.sleep_until_stopped()

        def main() -> None:
            import anyio

            try:
                anyio.run(serve, backend="asyncio", backend_options={"use_uvloop": fast})
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits
                if not started.done():
                    started.set_exception(exc)

        self._thread = threading.Thread(target=main, name=name, daemon=True)
        self._thread.start()
        self._portal = started.result()
        self._closed = False

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result; past ``timeout_s`` it is cancelled
        and ``TimeoutError`` raised."""
        future: Future[T] = self._portal.start_task_soon(_wait_for, coro)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"not done in {timeout_s:g} s") from None

    def start(self, coro: Coroutine[Any, Any, T], timeout_s: float, error: type[Exception], what: str) -> T:
        """``run(coro)`` for a connector's set-up: on failure the loop is closed and ``error``
        raised, naming ``what``."""
        try:
            return self.run(coro, timeout_s)
        except Exception as exc:
            self.close()
            raise error(f"{what}: {exc}") from exc

    def close(self, client: Any = None) -> None:
        """Close ``client`` (an asyncio client with ``close()``, if given), cancel the calls still
        running and stop the loop, which cancels what else runs on it (a client's background
        tasks); each step waits 5 s at most."""
        if self._closed:
            return
        self._closed = True
        if client is not None:
            try:
                self.run(client.close(), timeout_s=5)
            except Exception:  # noqa: BLE001, S110 - stopping anyway
                pass
        try:
            self._portal.start_task_soon(self._portal.stop, True).result(5)
        except Exception:  # noqa: BLE001, S110 - the loop has stopped already
            pass
        self._thread.join(5)


async def _wait_for(coro: Coroutine[Any, Any, T]) -> T:
    return await coro
