"""A model served by another Open Inference Protocol v2 server, called over gRPC.

``RemoteRuntime`` speaks OIP v2 through ``tritonclient.grpc``, so the server can be Triton,
KServe, MLServer or another AISP. Each call has a timeout; failures that can pass (unavailable,
deadline exceeded, resource exhausted, aborted) are retried with exponential backoff and full
jitter; a circuit breaker opens after consecutive failures, so calls fail fast (and their rows go
to the dead-letter sink with the cause) until a trial call after ``reset_s`` succeeds.

A secured server (``aisp serve`` with tokens and TLS, Triton behind a gateway) is reached with an
``EndpointAccess``: a bearer token in each call's metadata, TLS against a CA. A refused token
(``UNAUTHENTICATED``, ``PERMISSION_DENIED``) or a failed TLS handshake is final: it is not
retried as an outage, and a runtime that meets it at start fails at once, saying which.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.errors import ModelError
from aisp.infer.runtimes.base import TensorSpec, check_rows
from aisp.infer.runtimes.endpoints import BreakerConfig, CircuitBreaker, EndpointAccess, RetryPolicy
from aisp.retry import RETRIES, Backoff

__all__ = ["EndpointRefused", "EndpointUnavailable", "RemoteRuntime", "refusal"]

log = logging.getLogger("aisp.remote")

RETRIABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED")
OIP_DTYPES = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


class EndpointUnavailable(ModelError):
    """The server did not answer (unavailable, too slow, overloaded, or its circuit is open):
    another server of the same model may. ``code`` says which: the gRPC status (``UNAVAILABLE``,
    ``DEADLINE_EXCEEDED``, ``RESOURCE_EXHAUSTED``, ``ABORTED``) or ``CIRCUIT_OPEN``."""

    retriable = True

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class EndpointRefused(ModelError):
    """The server refused this client (its token, or TLS): no retry or other wait will pass."""


class RemoteRuntime:
    """Model ``model`` on the OIP v2 gRPC server at ``url`` (``host:port``).

    Args:
        url: the server's gRPC address.
        model: the model name there; ``version`` pins a version ("" = the server's choice).
        timeout_ms: per attempt.
        retry: attempts and backoff.
        breaker: circuit breaker settings, or the breaker itself (an ``EndpointPool``'s).
        name: the name rows are tagged with (default: ``model``).
        connect_timeout_s: at start, how long to wait for the server to answer (one that is
            still starting is waited for, with backoff); then a clear ``ModelError``.
        access: a bearer token and TLS settings for a secured server.
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        version: str = "",
        timeout_ms: float = 1000.0,
        retry: RetryPolicy | None = None,
        breaker: BreakerConfig | CircuitBreaker | None = None,
        name: str | None = None,
        connect_timeout_s: float = 30.0,
        access: EndpointAccess | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        import tritonclient.grpc as tc

        self._tc = tc
        self.access = access or EndpointAccess()
        self._headers = self.access.headers() or None
        self.url, self.model = url, model
        self.name = name or model
        self._version = version
        self.timeout_s = timeout_ms / 1000
        self.retry = retry or RetryPolicy()
        if not isinstance(breaker, CircuitBreaker):
            breaker = CircuitBreaker(breaker or BreakerConfig(), clock)
        self.breaker = breaker
        self._sleep = sleep
        self.provider = f"remote:{url}"
        self.attempts = 0
        self.retries = 0
        self._client = self._connect()
        meta = self._metadata(connect_timeout_s, clock)
        self.version = version or str((meta.get("versions") or [""])[-1])
        self.input_names = tuple(i["name"] for i in meta["inputs"])
        self.output_names = tuple(o["name"] for o in meta["outputs"])
        self._datatypes = {i["name"]: i["datatype"] for i in meta["inputs"]}
        self.input_specs: Mapping[str, TensorSpec] = {
            i["name"]: TensorSpec(
                np.dtype(OIP_DTYPES[i["datatype"]]) if i["datatype"] in OIP_DTYPES else None,
                tuple(None if int(d) < 0 else int(d) for d in i["shape"]),
            )
            for i in meta["inputs"]
        }
        self.max_batch_size = self._max_batch_size()
        """The most rows the server takes in one request (its model config's ``max_batch_size``;
        0: no limit known). ``run`` splits a larger batch into requests of at most that many."""

    def _max_batch_size(self) -> int:
        """From the server's model config (Triton's extension, which ``aisp serve`` speaks too); a
        server without it (KServe, MLServer) sets no limit here, and a batch it refuses is an error."""
        from tritonclient.utils import InferenceServerException

        try:
            config = self._client.get_model_config(
                self.model, self._version, headers=self._headers, as_json=True, client_timeout=self.timeout_s
            )
        except InferenceServerException:
            return 0
        return max(0, int(config.get("config", {}).get("max_batch_size", 0) or 0))

    def _metadata(self, wait_s: float, clock: Callable[[], float]) -> Any:
        """The model's metadata, waiting up to ``wait_s`` for a server that is not up yet."""
        deadline = clock() + wait_s
        pauses = Backoff(0.1, 2.0, jitter=False).delays()  # one waiter polling a starting server
        while True:
            try:
                return self._call(
                    lambda t: self._client.get_model_metadata(
                        self.model, self._version, headers=self._headers, as_json=True, client_timeout=t
                    )
                )
            except ModelError as exc:
                starting = isinstance(exc, EndpointUnavailable) and exc.code in (
                    "UNAVAILABLE",
                    "CIRCUIT_OPEN",
                )
                if clock() >= deadline or not starting:
                    raise type(exc)(f"{exc} (waited {wait_s:g} s for the server at start)") from exc
                RETRIES.note(f"remote model {self.model} at {self.url}", "starting")
                self._sleep(next(pauses))
                self.breaker.reset()  # not open because of start-up
                self._client = self._connect()

    def _connect(self) -> Any:
        return self._tc.InferenceServerClient(
            self.url,
            channel_args=[
                ("grpc.initial_reconnect_backoff_ms", 50),
                ("grpc.min_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 500),
                ("grpc.use_local_subchannel_pool", 1),  # a new client must not inherit a backoff
            ],
            **self.access.grpc_client(),
        )

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        rows = len(next(iter(inputs.values()))) if inputs else 0
        limit = self.max_batch_size
        if limit <= 0 or rows <= limit:
            return self._run(inputs)
        parts = [self._run({k: v[i : i + limit] for k, v in inputs.items()}) for i in range(0, rows, limit)]
        outputs = {name: np.concatenate([p[name] for p in parts]) for name in self.output_names}
        check_rows(self.name, inputs, outputs)
        return outputs

    def _run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        tc = self._tc
        request = []
        for name in self.input_names:
            arr = np.ascontiguousarray(inputs[name])
            tensor = tc.InferInput(name, list(arr.shape), self._datatypes[name])
            tensor.set_data_from_numpy(arr)
            request.append(tensor)
        wanted = [tc.InferRequestedOutput(o) for o in self.output_names]
        result = self._call(
            lambda t: self._client.infer(
                self.model, request, self._version, outputs=wanted, headers=self._headers, client_timeout=t
            )
        )
        outputs = {o: result.as_numpy(o) for o in self.output_names}
        check_rows(self.name, inputs, outputs)
        return outputs

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        """Check the path to the server with one small request (the server warms its own model).

        A failure is logged, not raised: the pipeline starts, and rows that cannot be scored go
        to the dead-letter sink with the cause.
        """
        zeros = {n: s.zeros(1) for n, s in self.input_specs.items()}
        if all(v is not None for v in zeros.values()):
            try:
                self.run({k: v for k, v in zeros.items() if v is not None})
            except ModelError as exc:
                log.warning("remote model %s: warm-up failed: %s", self.model, exc)

    def _call(self, fn: Callable[[float], Any]) -> Any:
        from tritonclient.utils import InferenceServerException

        if not self.breaker.allow():
            raise EndpointUnavailable(
                f"remote model {self.model!r} at {self.url}: circuit open after repeated failures;"
                f" next try in {self.breaker.retry_in_s():.1f} s",
                code="CIRCUIT_OPEN",
            )
        if self.breaker.state == "half-open":
            self._client = self._connect()  # a fresh channel: the old one may sit in reconnect backoff
        last, passing, code = "", True, ""
        for attempt in range(self.retry.attempts):
            if attempt:
                self.retries += 1
                self._sleep(self.retry.backoff_s(attempt))
            self.attempts += 1
            try:
                out = fn(self.timeout_s)
            except InferenceServerException as exc:
                status = str(exc.status() or "")
                last = f"{status}: {exc.message()}"
                self.breaker.failure()
                refused = refusal(status, str(exc.message() or ""))
                if refused is not None:
                    raise EndpointRefused(
                        f"remote model {self.model!r} at {self.url}: {refused} ({last})"
                    ) from exc
                code = next((c for c in RETRIABLE if c in status), "")
                passing = bool(code)
                if not passing or not self.breaker.allow():
                    break
                RETRIES.note(f"remote model {self.model} at {self.url}", status or "error")
                continue
            self.breaker.success()
            return out
        message = f"remote model {self.model!r} at {self.url} failed after {attempt + 1} attempt(s): {last}"
        if passing:
            raise EndpointUnavailable(message, code=code)
        raise ModelError(message)

    def __repr__(self) -> str:
        return f"RemoteRuntime({self.url!r}, {self.model!r}, version={self.version!r})"


def refusal(status: str, message: str) -> str | None:
    """Why a call failed for good though its status may read as an outage: the server refused
    the token, or TLS could not be agreed (gRPC reports a failed handshake as ``UNAVAILABLE``).

    >>> refusal("StatusCode.UNAVAILABLE", "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED")
    "TLS handshake failed (the server's certificate is not trusted, or it does not speak TLS)"
    >>> refusal("StatusCode.UNAVAILABLE", "failed to connect to all addresses") is None
    True
    """
    if "UNAUTHENTICATED" in status:
        return "authentication failed (the server refused the token)"
    if "PERMISSION_DENIED" in status:
        return "not permitted (the token's scope does not allow it)"
    lowered = message.lower()
    if "handshake failed" in lowered or "certificate_verify_failed" in lowered or "ssl_error" in lowered:
        return "TLS handshake failed (the server's certificate is not trusted, or it does not speak TLS)"
    return None
