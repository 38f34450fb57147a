"""The nats-py connection every NATS part (source, sink, scenarios) opens: reconnecting for ever,
quickly (the parts bound their waits with ``retry_s``), credentials and TLS from an ``Access``,
and a refused login or an untrusted server final at once instead of retried as an outage."""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

from aisp.connectors.access import Access

__all__ = ["NatsRefused", "connect_nats", "nats_refusal"]

log = logging.getLogger("aisp.nats")


async def connect_nats(servers: str, access: Access | None = None, *, reconnect: bool = True) -> Any:
    """A NATS connection as the connectors use it: reconnecting for ever, quickly (the
    connectors bound how long they wait, with their own ``retry_s``); a lost connection is
    logged as one line, not the client's traceback per reconnect attempt. ``access``: the user
    and password, a token (a user without a password), TLS, a credentials file. A refused
    login or an untrusted server is final: ``NatsRefused`` at once, not retried as an outage.
    ``reconnect=False``: one try (the tools of tests and benchmarks)."""
    import nats

    access = access or Access()
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def error(exc: Exception) -> None:
        reason = nats_refusal(exc)
        if reason is None:
            log.warning("NATS at %s: %s: %s", servers, type(exc).__name__, exc)
        elif not refused.done():  # said once, by the error the connection raises
            refused.set_result(f"{reason}: {exc}")

    async def disconnected() -> None:
        log.info("NATS at %s: disconnected, reconnecting", servers)

    secret: dict[str, Any] = {}
    if access.user is not None and access.password is not None:
        secret.update(user=access.user, password=access.password)
    elif access.user is not None:
        secret["token"] = access.user
    elif access.password is not None:
        secret["token"] = access.password
    if access.creds is not None:
        secret["user_credentials"] = access.creds
    connecting = asyncio.ensure_future(
        nats.connect(
            servers,
            connect_timeout=2,
            max_reconnect_attempts=-1 if reconnect else 0,
            reconnect_time_wait=0.2,
            error_cb=error,
            disconnected_cb=disconnected,
            tls=access.ssl_context(),
            **secret,
        )
    )
    waits: set[asyncio.Future[Any]] = {connecting, refused}
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if refused.done():
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        raise NatsRefused(refused.result())
    refused.cancel()
    return connecting.result()


class NatsRefused(Exception):
    """The NATS server refused this client (authentication, authorisation, TLS): final."""


def nats_refusal(exc: BaseException) -> str | None:
    """Why ``exc`` from a NATS connection will not pass by waiting; None for an outage."""
    text = str(exc).lower()
    chain = [exc, exc.__cause__, exc.__context__]
    if "authorization violation" in text or "authentication" in text or "user authentication" in text:
        return "authentication failed"
    if "permissions violation" in text:
        return "not permitted"
    if any(isinstance(e, ssl.SSLCertVerificationError) for e in chain) or "certificate verify failed" in text:
        return "TLS verification failed (the server's certificate is not trusted)"
    if any(isinstance(e, ssl.SSLError) for e in chain):
        return "TLS handshake failed"
    return None
