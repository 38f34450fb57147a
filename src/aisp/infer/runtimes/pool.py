"""One model served by several OIP v2 servers (a pool), called as one runtime.

``RemotePool`` keeps a ``RemoteRuntime`` per endpoint and sends each batch to the endpoint with
the fewest requests in flight (then the fewest calls so far), among those whose circuit breaker
lets calls through. A call that an endpoint cannot answer (unavailable, too slow, overloaded:
``EndpointUnavailable``) goes to the next endpoint at once; only when every endpoint failed does
the pool back off (``retry``) and go round again, and only when the rounds run out do the rows
go to the dead letters. An error of the request itself (a bad input) is not retried elsewhere.

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
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from aisp.errors import ConfigError, ModelError
from aisp.infer.runtimes.base import TensorSpec
from aisp.infer.runtimes.remote import BreakerConfig, EndpointUnavailable, RemoteRuntime, RetryPolicy

__all__ = ["RemotePool"]

log = logging.getLogger("aisp.remote")


@dataclass
class _Endpoint:
    url: str
    runtime: RemoteRuntime | None = None
    outstanding: int = 0
    calls: int = 0
    failures: int = 0
    next_try: float = 0.0  # when a server that is not connected is tried again
    connecting: bool = False
    error: str = ""

    def state(self) -> str:
        if self.runtime is None:
            return "down"
        return "up" if self.runtime.breaker.state == "closed" else self.runtime.breaker.state


class RemotePool:
    """Model ``model`` on the OIP v2 gRPC servers at ``urls`` (``host:port`` each).

    Args:
        urls: the endpoints (at least one must answer within ``connect_timeout_s`` at start).
        model: the model name on each; ``version`` pins a version ("" = the servers' choice).
        timeout_ms: per call to an endpoint.
        retry: rounds over the endpoints, and the backoff between rounds.
        breaker: each endpoint's circuit breaker (its ``reset_s`` also paces reconnecting).
        name: the name rows are tagged with (default: ``model``).
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
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not urls:
            raise ConfigError("a model pool needs at least one endpoint")
        if len(set(urls)) != len(urls):
            raise ConfigError(f"model pool endpoints repeat: {list(urls)}")
        self.model, self.name = model, name or model
        self._version, self._timeout_ms = version, timeout_ms
        self.retry = retry or RetryPolicy()
        self.breaker = breaker or BreakerConfig(failures=2, reset_s=1.0)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._endpoints = [_Endpoint(url) for url in urls]
        self._signature: tuple[Any, ...] | None = None
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
        return "remote-pool:" + ",".join(e.url for e in self._endpoints)

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        last = "no endpoint could be tried"
        for attempt in range(self.retry.attempts):
            if attempt:
                self._sleep(self.retry.backoff_s(attempt))
            tried: set[str] = set()
            while (endpoint := self._pick(tried)) is not None:
                tried.add(endpoint.url)
                try:
                    return self._call(endpoint, inputs)
                except EndpointUnavailable as exc:
                    last = str(exc)
        raise ModelError(
            f"model pool {self.model!r}: no endpoint answered in {self.retry.attempts} round(s): {last}"
        )

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Check the path to each connected endpoint with one small request (logged, not raised)."""
        for endpoint in list(self._endpoints):
            if endpoint.runtime is not None:
                endpoint.runtime.warmup(batch_sizes)

    # -- endpoints joining and leaving ----------------------------------------------------------
    def add(self, url: str) -> None:
        """Add an endpoint (connected now if it answers, else tried again later)."""
        with self._lock:
            if any(e.url == url for e in self._endpoints):
                raise ConfigError(f"model pool {self.model!r} already has endpoint {url}")
            endpoint = _Endpoint(url)
            self._endpoints = [*self._endpoints, endpoint]
        self._connect(endpoint)

    def remove(self, url: str) -> None:
        """Take an endpoint out of the pool (calls in flight to it finish)."""
        with self._lock:
            left = [e for e in self._endpoints if e.url != url]
            if len(left) == len(self._endpoints):
                raise ConfigError(f"model pool {self.model!r} has no endpoint {url}")
            if not left:
                raise ConfigError(f"model pool {self.model!r} needs at least one endpoint")
            self._endpoints = left

    def endpoints(self) -> list[dict[str, Any]]:
        """Each endpoint: url, state (up, open, half-open, down), in flight, calls, failures."""
        with self._lock:
            return [{"url": e.url, "state": e.state(), "outstanding": e.outstanding, "calls": e.calls,
                     "failures": e.failures, "error": e.error} for e in self._endpoints]  # fmt: skip

    # -- internals ------------------------------------------------------------------------------
    def _first(self) -> RemoteRuntime:
        for endpoint in self._endpoints:
            if endpoint.runtime is not None:
                return endpoint.runtime
        raise ModelError(f"model pool {self.model!r}: no endpoint connected")

    def _connect_first(self, wait_s: float) -> None:
        """Connect every endpoint; wait up to ``wait_s`` for at least one."""
        deadline, pause = self._clock() + wait_s, 0.1
        while True:
            for endpoint in self._endpoints:
                if endpoint.runtime is None:
                    self._connect(endpoint)
            if any(e.runtime is not None for e in self._endpoints):
                return
            if self._clock() >= deadline:
                errors = "; ".join(f"{e.url}: {e.error}" for e in self._endpoints)
                raise ModelError(
                    f"model pool {self.model!r}: no endpoint answered in {wait_s:g} s ({errors})"
                )
            self._sleep(pause)
            pause = min(2 * pause, 2.0)

    def _connect(self, endpoint: _Endpoint) -> None:
        try:
            runtime = RemoteRuntime(
                endpoint.url, self.model, version=self._version, timeout_ms=self._timeout_ms,
                retry=RetryPolicy(attempts=1), breaker=self.breaker, name=self.name,
                connect_timeout_s=0.0, clock=self._clock, sleep=self._sleep,
            )  # fmt: skip
        except ModelError as exc:
            self._not_connected(endpoint, str(exc))
            return
        signature = (runtime.input_names, runtime.output_names, dict(runtime.input_specs))
        with self._lock:
            self._signature = self._signature or signature
            if signature == self._signature:
                endpoint.runtime, endpoint.error, endpoint.connecting = runtime, "", False
                return
        self._not_connected(
            endpoint, f"it serves {self.model!r} with other inputs or outputs than the pool's"
        )

    def _not_connected(self, endpoint: _Endpoint, why: str) -> None:
        with self._lock:
            endpoint.error, endpoint.next_try = why, self._clock() + self.breaker.reset_s
            endpoint.connecting = False
        log.warning("model pool %s: endpoint %s not connected: %s", self.model, endpoint.url, why)

    def _pick(self, tried: set[str]) -> _Endpoint | None:
        """The endpoint to call next: connected, its breaker letting calls through, fewest in
        flight; else one due to be connected again (connected here, then picked if it answers)."""
        now = self._clock()
        with self._lock:
            ready = [
                e for e in self._endpoints
                if e.url not in tried and e.runtime is not None and e.runtime.breaker.ready()
            ]  # fmt: skip
            if ready:
                best = min(ready, key=lambda e: (e.outstanding, e.calls))
                best.outstanding += 1
                return best
            due = [
                e for e in self._endpoints
                if e.url not in tried and e.runtime is None and not e.connecting and now >= e.next_try
            ]  # fmt: skip
            if not due:
                return None
            due[0].connecting = True
        self._connect(due[0])
        if due[0].runtime is None:
            tried.add(due[0].url)
            return self._pick(tried)
        with self._lock:
            due[0].outstanding += 1
        return due[0]

    def _call(
        self, endpoint: _Endpoint, inputs: Mapping[str, npt.NDArray[Any]]
    ) -> dict[str, npt.NDArray[Any]]:
        assert endpoint.runtime is not None
        try:
            out = endpoint.runtime.run(inputs)
        except EndpointUnavailable:
            with self._lock:
                endpoint.failures += 1
            raise
        finally:
            with self._lock:
                endpoint.outstanding -= 1
                endpoint.calls += 1
        return out

    def __repr__(self) -> str:
        return f"RemotePool({[e.url for e in self._endpoints]!r}, {self.model!r})"
