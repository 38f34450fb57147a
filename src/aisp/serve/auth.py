"""Bearer-token authentication for the servers, with a separate admin scope.

Tokens come from a config file (TOML: ``[auth] tokens = [...]``, ``admin_tokens = [...]``) and/or
the environment (``AISP_TOKENS``, ``AISP_ADMIN_TOKENS``, comma-separated). Admin tokens may do
everything; other tokens may call everything but the repository's load/unload/index. With no
token configured, auth is off (the servers bind 127.0.0.1 by default). Only SHA-256 digests are
kept, compared in constant time; refusals say 401 or 403 and nothing more.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from aisp.errors import ConfigError

__all__ = ["Scope", "Tokens", "api_key", "is_loopback"]

Scope = Literal["infer", "admin"]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def api_key(authorization: str | None, peer: str) -> str:
    """Who a rate limit counts against: a digest of the bearer token, else the client's address.

    >>> api_key("Bearer t1", "10.0.0.1") == api_key("Bearer t1", "10.0.0.2"), api_key(None, "10.0.0.1")
    (True, '10.0.0.1')
    """
    if authorization and authorization.startswith("Bearer "):
        return hashlib.sha256(authorization[7:].strip().encode()).hexdigest()[:16]
    return peer


@dataclass(frozen=True)
class Tokens:
    """Accepted tokens, by scope (as digests).

    >>> t = Tokens.of(tokens=["user-1"], admin_tokens=["root-1"])
    >>> t.check("Bearer user-1", "infer"), t.check("Bearer user-1", "admin"), t.check(None, "infer")
    (200, 403, 401)
    """

    infer: frozenset[bytes] = field(default_factory=frozenset)
    admin: frozenset[bytes] = field(default_factory=frozenset)

    @classmethod
    def of(cls, *, tokens: Iterable[str] = (), admin_tokens: Iterable[str] = ()) -> Tokens:
        return cls(
            frozenset(_digest(t) for t in tokens if t), frozenset(_digest(t) for t in admin_tokens if t)
        )

    @classmethod
    def load(cls, config: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Tokens:
        env = os.environ if environ is None else environ
        tokens = [t.strip() for t in env.get("AISP_TOKENS", "").split(",")]
        admin = [t.strip() for t in env.get("AISP_ADMIN_TOKENS", "").split(",")]
        if config is not None:
            try:
                data = tomllib.loads(Path(config).read_text())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"cannot read config {str(config)!r}: {exc}") from exc
            auth = data.get("auth", {})
            tokens += [str(t) for t in auth.get("tokens", [])]
            admin += [str(t) for t in auth.get("admin_tokens", [])]
        return cls.of(tokens=tokens, admin_tokens=admin)

    @property
    def enabled(self) -> bool:
        return bool(self.infer or self.admin)

    def check(self, authorization: str | None, scope: Scope) -> int:
        """200 if allowed, 401 without a valid token, 403 with a token lacking ``scope``."""
        if not self.enabled:
            return 200
        if not authorization or not authorization.startswith("Bearer "):
            return 401
        digest = _digest(authorization[7:].strip())
        is_admin = any(hmac.compare_digest(digest, d) for d in self.admin)
        if is_admin:
            return 200
        if not any(hmac.compare_digest(digest, d) for d in self.infer):
            return 401
        return 200 if scope == "infer" else 403


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) reaches this machine only: every address it
    resolves to is a loopback one (``0.0.0.0`` and ``::`` bind every interface: they are not).

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("0.0.0.0"), is_loopback("10.1.2.3")
    (True, True, False, False)
    """
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)
