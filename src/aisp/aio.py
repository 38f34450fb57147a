"""A private asyncio event loop in a daemon thread, for synchronous callers of asyncio clients.

Connectors run in executor threads, but some broker clients (``nats-py``) are asyncio-only.
``LoopThread.run(coro)`` runs a coroutine on the connector's own loop and waits for its result.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "connect_nats"]

T = TypeVar("T")
log = logging.getLogger("aisp.nats")


class LoopThread:
    """One event loop, one thread; ``close()`` stops both."""

    def __init__(self, name: str, *, fast: bool = False) -> None:
        """``fast``: a uvloop loop (where a server's event loop is the bottleneck; the gRPC
        server answers 35% more calls on it), else asyncio's own."""
        if fast:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self, coro: Coroutine[Any, Any, T], timeout_s: float, error: type[Exception], what: str) -> T:
        """``run(coro)`` for a connector's set-up: on failure the loop is closed and ``error``
        raised, naming ``what``."""
        try:
            return self.run(coro, timeout_s)
        except Exception as exc:
            self.close()
            raise error(f"{what}: {exc}") from exc

    def close(self, client: Any = None) -> None:
        """Close ``client`` (an asyncio client with ``close()``, if given), cancel what still runs
        on the loop (a client's background tasks), stop the loop and close it."""
        if self.loop.is_closed():
            return
        for step in ([client.close()] if client is not None else []) + [_cancel_others()]:
            try:
                self.run(step, timeout_s=5)
            except Exception:  # noqa: BLE001, S110 - stopping anyway
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


async def _cancel_others() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def connect_nats(servers: str) -> Any:
    """A NATS connection as the connectors use it: reconnecting for ever, quickly (the
    connectors bound how long they wait, with their own ``retry_s``); a lost connection is
    logged as one line, not the client's traceback per reconnect attempt."""
    import nats

    async def error(exc: Exception) -> None:
        log.warning("NATS at %s: %s: %s", servers, type(exc).__name__, exc)

    async def disconnected() -> None:
        log.info("NATS at %s: disconnected, reconnecting", servers)

    return await nats.connect(
        servers,
        connect_timeout=2,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        error_cb=error,
        disconnected_cb=disconnected,
    )
