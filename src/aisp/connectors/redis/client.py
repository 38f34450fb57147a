"""The redis-py client of every Redis part (source, sink, dead letters, scenarios): credentials and
TLS from an ``Access``, and the errors that waiting will not cure.

redis-py reports a refused password as ``AuthenticationError``, a subclass of its
``ConnectionError``, and an untrusted certificate as a ``ConnectionError`` too: retried as an
outage, either would hold a run for ``retry_s`` and end with a misleading reason. ``final_reason``
tells them apart, so they end the run at once with what went wrong.
"""

from __future__ import annotations

import ssl
from typing import Any

from aisp.connectors.access import Access
from aisp.errors import AispError
from aisp.retry import call_with_retry

__all__ = ["call_redis", "final_reason", "redis_client", "redis_kwargs"]

_AUTH = ("WRONGPASS", "NOAUTH", "HELLO must be called", "invalid username-password", "AUTH failed")


def redis_kwargs(access: Access) -> dict[str, Any]:
    """redis-py's connection settings for ``access`` (sync and asyncio clients take the same)."""
    kw: dict[str, Any] = {}
    if access.user:
        kw["username"] = access.user
    if access.password is not None:
        kw["password"] = access.password
    if access.tls:
        kw.update(ssl=True, ssl_cert_reqs="required", ssl_ca_certs=access.ca)
        if access.cert is not None:
            kw.update(ssl_certfile=access.cert, ssl_keyfile=access.key)
    return kw


def redis_client(host: str, port: int, access: Access, **kwargs: Any) -> Any:
    """A synchronous ``redis.Redis`` to ``host:port`` with ``access`` (``kwargs``: timeouts...)."""
    import redis

    return redis.Redis(host=host, port=port, **redis_kwargs(access), **kwargs)


def final_reason(exc: BaseException) -> str | None:
    """Why ``exc`` will not pass by waiting: authentication or authorisation refused, TLS not
    verified or not spoken; None for an outage (retry it)."""
    import redis

    text = str(exc)
    if isinstance(exc, redis.AuthenticationError) or any(mark in text for mark in _AUTH):
        return "authentication failed"
    if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in text:
        return "not permitted (the user's ACL refuses it)"
    chain = [exc, exc.__cause__, exc.__context__]
    if any(isinstance(e, ssl.SSLCertVerificationError) for e in chain) or "certificate verify failed" in text:
        return "TLS verification failed (the server's certificate is not trusted)"
    if any(isinstance(e, ssl.SSLError) for e in chain) or "wrong version number" in text:
        return "TLS handshake failed"
    return None


def call_redis(
    fn: Any, *args: Any, retry_on: tuple[type[BaseException], ...], retry_s: float, what: str,
    error: type[AispError],
) -> Any:  # fmt: skip
    """``fn(*args)``, an outage (``retry_on``) retried for ``retry_s``; an error that waiting will
    not cure (``final_reason``) raised at once as ``error`` naming ``what`` (the server)."""
    import redis

    try:
        return call_with_retry(
            fn, *args, retry_on=retry_on, give_up_after_s=retry_s, what=what, error=error, final=final_reason
        )
    except redis.ResponseError as exc:  # NOAUTH, NOPERM: an answer, not an outage
        reason = final_reason(exc)
        if reason is None:
            raise
        raise error(f"{what}: {reason}: {exc}") from exc
