"""One model served by several OIP v2 servers (a pool), called as one runtime.

``RemotePool`` keeps a ``RemoteRuntime`` per endpoint of an ``EndpointPool`` and sends each batch
to the endpoint it picks: the fewest requests in flight (then the fewest calls so far), among
those whose circuit breaker lets calls through. A call that an endpoint cannot answer
(unavailable, too slow, overloaded: ``EndpointUnavailable``) goes to the next endpoint at once;
only when every endpoint failed does the pool back off (``retry``) and go round again, and only
when the rounds run out do the rows go to the dead letters. An error of the request itself (a
bad input) is not retried elsewhere.

Endpoints may join (``add``) and leave (``remove``) while the pipeline runs; one that is down
when it joins, or at start, is tried again every ``breaker.reset_s``. The model tier (``aisp
serve`` or Triton instances, GPUs) then scales apart from the stream tier: give the infer step
``BatcherConfig(instances=N)`` to keep up to N batches in flight across the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy.typing as npt

from aisp.errors import ModelError
from aisp.infer.runtimes.base import TensorSpec
from aisp.infer.runtimes.endpoints import BreakerConfig, Endpoint, EndpointAccess, EndpointPool, RetryPolicy
from aisp.infer.runtimes.remote import EndpointRefused, EndpointUnavailable, RemoteRuntime

__all__ = ["RemotePool"]

log = logging.getLogger("aisp.remote")


class RemotePool:
    """Model ``model`` on the OIP v2 gRPC servers at ``urls`` (``host:port`` each).

    Args:
        urls: the endpoints (at least one must answer within ``connect_timeout_s`` at start).
        model: the model name on each; ``version`` pins a version ("" = the servers' choice).
        timeout_ms: per call to an endpoint.
        retry: rounds over the endpoints, and the backoff between rounds.
        breaker: each endpoint's circuit breaker (its ``reset_s`` also paces reconnecting).
        name: the name rows are tagged with (default: ``model``).
        access: a bearer token and TLS settings, the same for every endpoint.
    """

    def __init__(
        self,
        urls: Sequence[str],
        model: str,
        *,
        version: str = "",
        timeout_ms: float = 1000.0,
        retry: RetryPolicy | None = None,
        breaker: BreakerConfig | None = None,
        name: str | None = None,
        connect_timeout_s: float = 30.0,
        access: EndpointAccess | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.model, self.name = model, name or model
        self.access = access or EndpointAccess()
        self._refused: set[str] = set()  # endpoints that refused the token or TLS
        self._version, self._timeout_ms = version, timeout_ms
        self.retry = retry or RetryPolicy()
        self.breaker = breaker or BreakerConfig(failures=2, reset_s=1.0)
        self._clock, self._sleep = clock, sleep
        self._pool: EndpointPool[RemoteRuntime] = EndpointPool(
            urls, self.breaker, what=f"model pool {model!r}", connected=False, clock=clock
        )
        self._signature: tuple[Any, ...] | None = None
        self._lock = threading.Lock()  # the signature, set by the first endpoint connected
        self._connect_first(connect_timeout_s)

    # -- the runtime interface ----------------------------------------------------------------
    @property
    def version(self) -> str:
        return self._first().version

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._first().input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._first().output_names

    @property
    def input_specs(self) -> Mapping[str, TensorSpec]:
        return self._first().input_specs

    @property
    def provider(self) -> str:
        return "remote-pool:" + ",".join(e.url for e in self._pool.endpoints)

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        last = "no endpoint could be tried"
        for attempt in range(self.retry.attempts):
            if attempt:
                self._sleep(self.retry.backoff_s(attempt))
            tried: set[str] = set()
            while (endpoint := self._pool.pick(tried, again=False)) is not None:
                tried.add(endpoint.url)
                if not endpoint.connected and not self._connect(endpoint):
                    self._pool.end(endpoint, called=False)
                    continue
                try:
                    return self._call(endpoint, inputs)
                except EndpointUnavailable as exc:
                    last = str(exc)
        raise ModelError(
            f"model pool {self.model!r}: no endpoint answered in {self.retry.attempts} round(s): {last}"
        )

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Check the path to each connected endpoint with one small request (logged, not raised)."""
        for endpoint in self._pool.endpoints:
            if endpoint.client is not None:
                endpoint.client.warmup(batch_sizes)

    # -- endpoints joining and leaving ----------------------------------------------------------
    def add(self, url: str) -> None:
        """Add an endpoint (connected now if it answers, else tried again later)."""
        endpoint = self._pool.add(url)
        endpoint.connecting = True
        self._connect(endpoint)

    def remove(self, url: str) -> None:
        """Take an endpoint out of the pool (calls in flight to it finish)."""
        self._pool.remove(url)

    def endpoints(self) -> list[dict[str, Any]]:
        """Each endpoint: url, state (up, open, half-open, down), in flight, calls, failures."""
        return [{"url": e.url, "state": _state(e), "outstanding": e.outstanding, "calls": e.calls,
                 "failures": e.failures, "error": e.error} for e in self._pool.endpoints]  # fmt: skip

    # -- internals ------------------------------------------------------------------------------
    def _first(self) -> RemoteRuntime:
        for endpoint in self._pool.endpoints:
            if endpoint.client is not None:
                return endpoint.client
        raise ModelError(f"model pool {self.model!r}: no endpoint connected")

    def _connect_first(self, wait_s: float) -> None:
        """Connect every endpoint; wait up to ``wait_s`` for at least one."""
        deadline, pause = self._clock() + wait_s, 0.1
        while True:
            for endpoint in self._pool.endpoints:
                if not endpoint.connected:
                    endpoint.connecting = True
                    self._connect(endpoint)
            if any(e.connected for e in self._pool.endpoints):
                return
            refused = all(e.url in self._refused for e in self._pool.endpoints)
            if refused:  # waiting will not help
                errors = "; ".join(f"{e.url}: {e.error}" for e in self._pool.endpoints)
                raise ModelError(f"model pool {self.model!r}: every endpoint refused this client ({errors})")
            if self._clock() >= deadline:
                errors = "; ".join(f"{e.url}: {e.error}" for e in self._pool.endpoints)
                raise ModelError(
                    f"model pool {self.model!r}: no endpoint answered in {wait_s:g} s ({errors})"
                )
            self._sleep(pause)
            pause = min(2 * pause, 2.0)

    def _connect(self, endpoint: Endpoint[RemoteRuntime]) -> bool:
        """Connect ``endpoint`` (marked ``connecting``); whether it answered as the pool's model."""
        try:
            runtime = RemoteRuntime(
                endpoint.url, self.model, version=self._version, timeout_ms=self._timeout_ms,
                retry=RetryPolicy(attempts=1), breaker=endpoint.breaker, name=self.name,
                connect_timeout_s=0.0, access=self.access, clock=self._clock, sleep=self._sleep,
            )  # fmt: skip
        except ModelError as exc:
            if isinstance(exc, EndpointRefused):
                self._refused.add(endpoint.url)
            return self._not_connected(endpoint, str(exc))
        self._refused.discard(endpoint.url)
        signature = (runtime.input_names, runtime.output_names, dict(runtime.input_specs))
        with self._lock:
            self._signature = self._signature or signature
            same = signature == self._signature
        if not same:
            return self._not_connected(
                endpoint, f"it serves {self.model!r} with other inputs or outputs than the pool's"
            )
        self._pool.connected(endpoint, runtime)
        return True

    def _not_connected(self, endpoint: Endpoint[RemoteRuntime], why: str) -> bool:
        self._pool.not_connected(endpoint, why)
        log.warning("model pool %s: endpoint %s not connected: %s", self.model, endpoint.url, why)
        return False

    def _call(
        self, endpoint: Endpoint[RemoteRuntime], inputs: Mapping[str, npt.NDArray[Any]]
    ) -> dict[str, npt.NDArray[Any]]:
        assert endpoint.client is not None
        failed = False
        try:
            return endpoint.client.run(inputs)
        except EndpointUnavailable:
            failed = True
            raise
        finally:
            self._pool.end(endpoint, failed=failed)

    def __repr__(self) -> str:
        return f"RemotePool({[e.url for e in self._pool.endpoints]!r}, {self.model!r})"


def _state(endpoint: Endpoint[RemoteRuntime]) -> str:
    if not endpoint.connected:
        return "down"
    return "up" if endpoint.breaker.state == "closed" else endpoint.breaker.state
