"""The endpoints of one service called over a network (a model on several OIP v2 servers, an LLM on
several OpenAI-compatible servers): which one a call goes to, how each one's health is tracked,
and how failed calls are tried again. ``RemoteRuntime``, ``RemotePool`` and ``OpenAIClient`` all
use these, so they spread load, fail over and back off the same way.

- ``RetryPolicy``: tries in all, with full-jitter exponential backoff (``aisp.retry.Backoff``)
  between them.
- ``CircuitBreaker``: per endpoint; opened by consecutive failures (or at once by a failed
  connect), so calls to it fail fast until a trial call after ``reset_s`` succeeds.
- ``EndpointPool``: the endpoints with their breakers and counts. ``pick`` reserves the next
  one for a call: among those whose breaker lets a call through (a half-open one whose trial is
  under way does not), one with a free slot (``slots`` each, when set), then one this call has
  not tried, then one connected, then the fewest calls in flight, then the fewest so far.
  Endpoints may join and leave while calls run: the list is replaced, never changed in place.
- ``EndpointAccess``: how a client proves itself to secured endpoints (a bearer token from the
  code, a variable or a file; TLS against a CA, with a client certificate for mutual TLS).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from aisp.errors import ConfigError
from aisp.retry import Backoff
from aisp.secrets import read_secret

__all__ = ["BreakerConfig", "CircuitBreaker", "Endpoint", "EndpointAccess", "EndpointPool", "RetryPolicy"]

C = TypeVar("C")


@dataclass(frozen=True)
class EndpointAccess:
    """A bearer token (sent as ``authorization: Bearer``, the header ``aisp serve --config``'s
    tokens check) and TLS settings for the endpoints of one service; its ``repr`` leaves the
    token out. Build it with ``of``, which reads the token from where it is kept.

    >>> EndpointAccess.of(api_key="t-1", ca=None)
    EndpointAccess(tls=False, ca=None, cert=None, key=None)
    >>> EndpointAccess.of(api_key="t-1").headers()
    {'authorization': 'Bearer t-1'}
    """

    token: str | None = field(default=None, repr=False)
    tls: bool = False
    ca: str | None = None
    """The CA certificate file (PEM) the servers' certificates must chain to (else the system's)."""
    cert: str | None = None
    """This client's certificate file (PEM), for mutual TLS; with ``key``."""
    key: str | None = None

    @classmethod
    def of(
        cls,
        *,
        api_key: str | None = None,
        api_key_env: str | None = None,
        api_key_file: str | None = None,
        tls: bool = False,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> EndpointAccess:
        """The token from ``api_key``, the variable ``api_key_env`` or the file ``api_key_file``
        (one at most); TLS when ``tls`` or a CA or client certificate is given. Errors name the
        option, never the token."""
        token = read_secret("a model endpoint", api_key, env=api_key_env, file=api_key_file)
        if (cert is None) != (key is None):
            raise ConfigError("a client certificate needs both cert and key")
        for name, path in (("ca", ca), ("cert", cert), ("key", key)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name}={path}: no such file")
        return cls(token, tls or ca is not None or cert is not None, ca, cert, key)

    def headers(self) -> dict[str, str]:
        """The request headers (gRPC metadata) that carry the token."""
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def grpc_client(self) -> dict[str, Any]:
        """``tritonclient.grpc.InferenceServerClient``'s TLS arguments."""
        if not self.tls:
            return {}
        files = {"root_certificates": self.ca, "private_key": self.key, "certificate_chain": self.cert}
        return {"ssl": True, **files}


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """``attempts`` tries in all; before try ``k`` (k >= 1) sleep uniform(0, min(max, base * 2**k)).

    >>> RetryPolicy().backoff_s(3, rand=lambda: 1.0)
    0.16
    """

    attempts: int = 4
    base_ms: float = 20.0
    max_ms: float = 1000.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"attempts must be >= 1, got {self.attempts}")

    def backoff_s(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        return Backoff(self.base_ms / 1000, self.max_ms / 1000).delay(attempt, rand)


@dataclass(frozen=True, kw_only=True)
class BreakerConfig:
    """Open after ``failures`` consecutive failed attempts; try again after ``reset_s``."""

    failures: int = 5
    reset_s: float = 5.0


class CircuitBreaker:
    """closed -> (``failures`` in a row) -> open -> (``reset_s``) -> half-open -> one trial call.

    >>> now = [0.0]
    >>> b = CircuitBreaker(BreakerConfig(failures=2, reset_s=1.0), clock=lambda: now[0])
    >>> b.failure(); b.failure(); b.state, b.ready(), b.allow()
    ('open', False, False)
    >>> now[0] = 1.5; b.ready(), b.allow(), b.state, b.ready()
    (True, True, 'half-open', False)
    >>> b.success(); b.state
    'closed'
    """

    def __init__(self, config: BreakerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self.state = "closed"
        self._failures = 0
        self._opened_at = 0.0
        self.opened = 0

    def ready(self) -> bool:
        """Whether ``allow`` would let a call through now (without starting a trial)."""
        with self._lock:
            return self.state == "closed" or (
                self.state == "open" and self._clock() - self._opened_at >= self.config.reset_s
            )

    def allow(self) -> bool:
        """Whether a call may go now; an open breaker past ``reset_s`` lets one trial through."""
        with self._lock:
            if self.state == "open" and self._clock() - self._opened_at >= self.config.reset_s:
                self.state = "half-open"
                return True
            return self.state == "closed"

    def success(self) -> None:
        with self._lock:
            self.state, self._failures = "closed", 0

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self.state == "half-open" or self._failures >= self.config.failures:
                self._open()

    def trip(self) -> None:
        """Open now, whatever the count (the endpoint could not even be connected)."""
        with self._lock:
            self._open()

    def _open(self) -> None:
        if self.state != "open":
            self.opened += 1
        self.state, self._opened_at = "open", self._clock()

    def reset(self) -> None:
        """Closed, nothing counted (failures while a server was starting do not count)."""
        with self._lock:
            self.state, self._failures = "closed", 0

    def retry_in_s(self) -> float:
        return max(0.0, self.config.reset_s - (self._clock() - self._opened_at))


@dataclass(eq=False)
class Endpoint(Generic[C]):
    """One endpoint of an ``EndpointPool``: its breaker, what calls it and its counts."""

    url: str
    breaker: CircuitBreaker
    client: C | None = None
    """What calls it (a runtime, an HTTP client), as its owner keeps it."""
    connected: bool = True
    """False until its owner has connected it (``EndpointPool(connected=False)``)."""
    connecting: bool = False
    outstanding: int = 0
    """Calls in flight."""
    calls: int = 0
    failures: int = 0
    error: str = ""
    """Why it is not connected (empty once it is)."""


class EndpointPool(Generic[C]):
    """The endpoints of ``what`` at ``urls`` (see the module docstring).

    >>> pool = EndpointPool(["a", "b"], BreakerConfig(failures=1), what="model m", slots=1)
    >>> first = pool.pick(set()); second = pool.pick(set()); first.url, second.url
    ('a', 'b')
    >>> first.breaker.failure(); pool.end(first, failed=True)
    >>> pool.pick({"b"}).url  # a's breaker is open: b, though full and tried
    'b'
    """

    def __init__(
        self,
        urls: Iterable[str],
        breaker: BreakerConfig,
        *,
        what: str,
        slots: int | None = None,
        connected: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        urls = list(urls)
        if not urls:
            raise ConfigError(f"{what} needs at least one endpoint")
        if len(set(urls)) != len(urls):
            raise ConfigError(f"{what}: endpoints repeat: {urls}")
        if slots is not None and slots < 1:
            raise ConfigError(f"{what}: slots must be >= 1, got {slots}")
        self.what, self.breaker, self.slots = what, breaker, slots
        self._connected, self._clock = connected, clock
        self._lock = threading.Lock()
        self._endpoints: tuple[Endpoint[C], ...] = tuple(self._new(u) for u in urls)

    def _new(self, url: str) -> Endpoint[C]:
        return Endpoint(url, CircuitBreaker(self.breaker, self._clock), connected=self._connected)

    @property
    def endpoints(self) -> Sequence[Endpoint[C]]:
        """The endpoints now (a snapshot: joins and leaves replace it)."""
        return self._endpoints

    def add(self, url: str) -> Endpoint[C]:
        with self._lock:
            if any(e.url == url for e in self._endpoints):
                raise ConfigError(f"{self.what} already has endpoint {url}")
            endpoint = self._new(url)
            self._endpoints = (*self._endpoints, endpoint)
        return endpoint

    def remove(self, url: str) -> None:
        """Take ``url`` out (its calls in flight finish)."""
        with self._lock:
            left = tuple(e for e in self._endpoints if e.url != url)
            if len(left) == len(self._endpoints):
                raise ConfigError(f"{self.what} has no endpoint {url}")
            if not left:
                raise ConfigError(f"{self.what} needs at least one endpoint")
            self._endpoints = left

    def pick(self, tried: set[str], *, again: bool = True) -> Endpoint[C] | None:
        """The endpoint for the next try of a call that has tried ``tried`` (``again``: those may
        be tried again when no other will do), a call in flight counted on it; an endpoint not
        connected comes back marked ``connecting`` (its owner connects it, then ``connected``
        or ``not_connected``). None: no endpoint may be called now."""
        slots = self.slots
        with self._lock:
            ready = [
                e for e in self._endpoints
                if (again or e.url not in tried) and not e.connecting and e.breaker.ready()
            ]  # fmt: skip
            if not ready:
                return None
            best = min(
                ready,
                key=lambda e: (
                    slots is not None and e.outstanding >= slots, e.url in tried, not e.connected,
                    e.outstanding, e.calls,
                ),
            )  # fmt: skip
            best.connecting = not best.connected
            best.outstanding += 1
            return best

    def connected(self, endpoint: Endpoint[C], client: C) -> None:
        with self._lock:
            endpoint.client, endpoint.connected, endpoint.connecting, endpoint.error = client, True, False, ""

    def not_connected(self, endpoint: Endpoint[C], why: str) -> None:
        """``endpoint`` could not be connected: tried again after the breaker's ``reset_s``."""
        endpoint.breaker.trip()
        with self._lock:
            endpoint.connecting, endpoint.error = False, why

    def end(self, endpoint: Endpoint[C], *, failed: bool = False, called: bool = True) -> None:
        """A call reserved by ``pick`` is over (``called``: it reached the endpoint)."""
        with self._lock:
            endpoint.outstanding -= 1
            endpoint.calls += called
            endpoint.failures += failed

    @property
    def capacity(self) -> int:
        """Calls in flight when every endpoint whose breaker is not open is full (``slots``)."""
        return (self.slots or 1) * sum(1 for e in self._endpoints if e.breaker.state != "open") or 1
