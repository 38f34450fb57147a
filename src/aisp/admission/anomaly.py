"""Sliding-window anomaly control of admission (AIMD).

A monitor keeps, for each ``step_s`` of the last ``window_s`` (by default 60 one-second
buckets), the events offered and admitted, the results written, their end-to-end latencies and
how many of a chosen model score column were above ``score_threshold``. At the end of each step
it computes the window's statistics and checks the policy's condition (every part that is set
must hold): offered events/s above ``max_events_per_s``, the share of scores above the threshold
over ``max_score_share``, the e2e p99 above ``max_p99_ms``. When the condition holds for
``consecutive`` windows in a row, the admitted rate (a token bucket) is multiplied by
``decrease`` (200k -> 120k events/s with 0.6), at most once per ``consecutive`` windows; every
window in which it does not hold raises the rate by ``increase_events_per_s``, up to
``rate_events_per_s`` (additive increase, multiplicative decrease).

Events over the admitted rate are refused with a ``Retry-After`` of about ``retry_after_ms``,
scaled by the load (offered / admitted rate over the last steps) within +-30%. Time comes from an
injectable clock and steps are evaluated when the control is used, so tests never sleep.

>>> now = [0.0]
>>> policy = AnomalyPolicy(rate_events_per_s=1000, window_s=2, step_s=1, score_column="score",
...                        max_score_share=0.5, consecutive=2)
>>> c = AnomalyControl(policy, clock=lambda: now[0])
>>> for t in (0.0, 1.0, 2.0):  # two windows in a row with every score above 0.92
...     now[0] = t
...     _ = c.admit(10)
...     c.observe_scores(np.array([0.99] * 10))
>>> c.status()["rate_events_per_s"], c.triggered
(600.0, 1)
>>> for t in (3.0, 4.0, 5.0, 6.0):  # the anomaly is over: +50 events/s a window
...     now[0] = t
...     c.observe_scores(np.array([0.1] * 10))
>>> c.status()["rate_events_per_s"]
750.0
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.admission.ratelimit import TokenBucket
from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.observe.latency import LatencyHistogram

__all__ = ["AnomalyControl", "AnomalyPolicy", "AnomalyTap", "control_run"]


@dataclass(frozen=True, kw_only=True)
class AnomalyPolicy:
    """When and how much to lower a pipeline's admitted rate (see the module docstring)."""

    rate_events_per_s: float
    """The admitted rate when all is well (the token bucket's rate), and the ceiling."""
    window_s: float = 60.0
    step_s: float = 1.0
    max_events_per_s: float = 0.0
    """Part of the condition: offered events/s over the window above this (0: not a part)."""
    score_column: str | None = None
    score_threshold: float = 0.92
    max_score_share: float = 0.0
    """Part of the condition: the share of ``score_column`` above ``score_threshold`` over this
    (0 or no column: not a part)."""
    max_p99_ms: float = 0.0
    """Part of the condition: the window's e2e p99 above this (0: not a part)."""
    consecutive: int = 3
    decrease: float = 0.6
    increase_events_per_s: float = 0.0
    """Added per window without the condition (0: 5% of ``rate_events_per_s``)."""
    min_rate_events_per_s: float = 0.0
    """The rate never falls below this (0: 5% of ``rate_events_per_s``)."""
    retry_after_ms: float = 150.0
    burst_s: float = 0.1
    """The token bucket holds this many seconds of the admitted rate."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "score_column":
                if value is not None and not (isinstance(value, str) and value):
                    raise ConfigError(f"anomaly policy: score_column must be a column name, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"anomaly policy: {f.name} must be a number, got {value!r}")
        if not isinstance(self.consecutive, int):
            raise ConfigError(f"anomaly policy: consecutive must be a whole number, got {self.consecutive!r}")
        if not math.isfinite(self.score_threshold):
            raise ConfigError(f"anomaly policy: score_threshold must be finite, got {self.score_threshold}")
        for name in ("rate_events_per_s", "window_s", "step_s", "retry_after_ms", "burst_s"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise ConfigError(f"anomaly policy: {name} must be a number > 0, got {value}")
        if self.step_s > self.window_s:
            raise ConfigError(f"anomaly policy: step_s ({self.step_s}) must be <= window_s ({self.window_s})")
        if self.window_s / self.step_s > 3600:
            raise ConfigError("anomaly policy: window_s / step_s must be <= 3600")
        if not 0 < self.decrease < 1:
            raise ConfigError(f"anomaly policy: decrease must be in (0, 1), got {self.decrease}")
        if self.consecutive < 1:
            raise ConfigError(f"anomaly policy: consecutive must be >= 1, got {self.consecutive}")
        for name in ("max_events_per_s", "max_score_share", "max_p99_ms", "increase_events_per_s",
                     "min_rate_events_per_s"):  # fmt: skip
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"anomaly policy: {name} must be a number >= 0, got {value}")
        if self.min_rate_events_per_s > self.rate_events_per_s:
            raise ConfigError(
                f"anomaly policy: min_rate_events_per_s ({self.min_rate_events_per_s:g}) must be <="
                f" rate_events_per_s ({self.rate_events_per_s:g})"
            )
        if self.max_score_share > 1:
            raise ConfigError(f"anomaly policy: max_score_share is a share, 0..1, got {self.max_score_share}")
        if self.max_score_share and not self.score_column:
            raise ConfigError("anomaly policy: max_score_share needs score_column")
        if not (self.max_events_per_s or self.max_score_share or self.max_p99_ms):
            raise ConfigError(
                "anomaly policy: set at least one part of the condition (max_events_per_s,"
                " max_score_share with score_column, max_p99_ms)"
            )

    @classmethod
    def from_config(cls, table: Mapping[str, Any]) -> AnomalyPolicy:
        """From a TOML table or JSON object; unknown keys are an error that names them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(f"anomaly policy: unknown setting(s) {unknown}; known: {sorted(known)}")
        try:
            return cls(**dict(table))
        except TypeError as exc:
            raise ConfigError(f"anomaly policy: {exc}") from None

    @property
    def floor(self) -> float:
        return self.min_rate_events_per_s or 0.05 * self.rate_events_per_s

    @property
    def step_up(self) -> float:
        return self.increase_events_per_s or 0.05 * self.rate_events_per_s


class _Buckets:
    """One slot per step of the window: counts and a latency histogram."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.offered = np.zeros(n, dtype=np.int64)
        self.admitted = np.zeros(n, dtype=np.int64)
        self.written = np.zeros(n, dtype=np.int64)
        self.high = np.zeros(n, dtype=np.int64)
        self.scored = np.zeros(n, dtype=np.int64)
        self.latency = [LatencyHistogram() for _ in range(n)]

    def clear(self, i: int) -> None:
        for arr in (self.offered, self.admitted, self.written, self.high, self.scored):
            arr[i] = 0
        self.latency[i] = LatencyHistogram()


class AnomalyControl:
    """The monitor and the AIMD-controlled token bucket of one pipeline (thread-safe)."""

    def __init__(self, policy: AnomalyPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.RLock()
        self.triggered = 0
        """Times the condition lowered the rate (``aisp_anomaly_triggered_total``)."""
        self._install(policy, policy.rate_events_per_s)

    def _install(self, policy: AnomalyPolicy, rate: float) -> None:
        self.policy = policy
        self.rate = min(max(rate, policy.floor), policy.rate_events_per_s)
        self._bucket = TokenBucket(self.rate, max(1.0, self.rate * policy.burst_s), clock=self._clock)
        self._b = _Buckets(max(1, round(policy.window_s / policy.step_s)))
        self._step = math.floor(self._clock() / policy.step_s)
        self._streak = 0
        self.window: dict[str, float] = {}
        """The last complete window's statistics."""

    def update(self, changes: Mapping[str, Any]) -> AnomalyPolicy:
        """Change the policy at run time (the window starts afresh; the rate is kept within the
        new bounds)."""
        with self._lock:
            policy = AnomalyPolicy.from_config({**asdict(self.policy), **changes})
            self._install(policy, self.rate)
            return policy

    # -- the hot path: a few array updates per chunk or batch ---------------------------------------
    def offered(self, rows: int) -> None:
        """``rows`` events arrived (admitted or not): the load."""
        with self._lock:
            self._advance()
            self._b.offered[self._step % self._b.n] += rows

    def take(self, rows: int) -> float:
        """Admit ``rows`` events: 0.0, or the seconds until the bucket would have them."""
        with self._lock:
            self._advance()
            wait = self._bucket.take(min(rows, self._bucket.burst))  # a chunk over the burst: a full bucket
            if not wait:
                self._b.admitted[self._step % self._b.n] += rows
            return wait

    def admit(self, rows: int) -> float:
        """``offered`` then ``take``."""
        self.offered(rows)
        return self.take(rows)

    def wait_for(self, rows: int, stop: threading.Event) -> None:
        """(A source, before it hands on ``rows`` events) wait until the admitted rate has room
        for them, or ``stop`` is set: how a broker or file source slows its reads."""
        self.offered(rows)
        while (wait := self.take(rows)) and not stop.wait(wait):
            pass

    def retry_after_s(self) -> float:
        """About ``retry_after_ms``, longer (up to +30%) the more the load exceeds the rate."""
        with self._lock:
            recent = [(self._step - k) % self._b.n for k in range(min(3, self._b.n))]
            load = float(self._b.offered[recent].sum()) / (len(recent) * self.policy.step_s * self.rate)
            return self.policy.retry_after_ms / 1000 * min(1.3, max(0.7, load))

    def observe(self, batch: Batch) -> None:
        """Results written: their e2e latencies and, with a score column, their scores."""
        if not batch.num_rows:
            return
        now = time.monotonic_ns()
        column = self.policy.score_column
        scores = batch.numpy(column) if column and column in batch else None
        with self._lock:
            self._advance()
            i = self._step % self._b.n
            self._b.written[i] += batch.num_rows
            self._b.latency[i].record(now - batch.ingest_ns)
            if scores is not None:
                self._count_scores(i, scores)

    def observe_scores(self, scores: npt.NDArray[Any]) -> None:
        """Scores seen outside a batch (tests, a model server's outputs)."""
        with self._lock:
            self._advance()
            self._count_scores(self._step % self._b.n, scores)

    def _count_scores(self, i: int, scores: npt.NDArray[Any]) -> None:
        values = np.asarray(scores, dtype=np.float64).reshape(-1)
        self._b.scored[i] += values.shape[0]
        self._b.high[i] += int(np.count_nonzero(values > self.policy.score_threshold))

    # -- once a step -------------------------------------------------------------------------------
    def _advance(self) -> None:
        step = math.floor(self._clock() / self.policy.step_s)
        if step <= self._step:
            return
        self._evaluate()  # the step that just ended completes a window
        quiet = step - self._step - 1  # whole steps without any call: windows without traffic
        self._step += 1
        self._b.clear(self._step % self._b.n)
        for _ in range(min(quiet, self._b.n)):
            self._evaluate()
            self._step += 1
            self._b.clear(self._step % self._b.n)
        if quiet > self._b.n:  # long idle: the rest of the windows were empty too
            self._relax(quiet - self._b.n)
            self._step = step
            self._b.clear(self._step % self._b.n)

    def _evaluate(self) -> None:
        """The window ending with the current step: statistics, condition, AIMD."""
        b, p = self._b, self.policy
        span = b.n * p.step_s
        latency = LatencyHistogram()
        for h in b.latency:
            latency.merge(h)
        scored = int(b.scored.sum())
        share = float(b.high.sum()) / scored if scored else 0.0
        p99 = latency.percentile(99) / 1e6 if latency.count else 0.0
        self.window = {
            "offered_events_per_s": float(b.offered.sum()) / span,
            "admitted_events_per_s": float(b.admitted.sum()) / span,
            "written_events_per_s": float(b.written.sum()) / span,
            "score_share": share,
            "latency_p50_ms": latency.percentile(50) / 1e6 if latency.count else 0.0,
            "latency_p99_ms": p99,
        }
        parts = []
        if p.max_events_per_s:
            parts.append(self.window["offered_events_per_s"] > p.max_events_per_s)
        if p.max_score_share:
            parts.append(scored > 0 and share > p.max_score_share)
        if p.max_p99_ms:
            parts.append(p99 > p.max_p99_ms)
        if all(parts):
            self._streak += 1
            if self._streak >= p.consecutive:
                self._streak = 0  # the next decrease needs another run of windows
                self.triggered += 1
                self._set_rate(self.rate * p.decrease)
        else:
            self._streak = 0
            self._relax(1)

    def _relax(self, windows: int) -> None:
        if self.rate < self.policy.rate_events_per_s:
            self._set_rate(self.rate + windows * self.policy.step_up)

    def _set_rate(self, rate: float) -> None:
        self.rate = min(max(rate, self.policy.floor), self.policy.rate_events_per_s)
        self._bucket.rate = self.rate
        self._bucket.burst = max(1.0, self.rate * self.policy.burst_s)

    def status(self) -> dict[str, Any]:
        """The policy, the admitted rate, the condition's streak and the last window."""
        with self._lock:
            self._advance()
            return {
                "policy": asdict(self.policy),
                "rate_events_per_s": round(self.rate, 3),
                "triggered": self.triggered,
                "streak": self._streak,
                "window": dict(self.window),
            }


class AnomalyTap:
    """The executor's ``Lineage`` hook for a run (not served): the results written by the
    ``primary`` sink go to the control's monitor."""

    def __init__(self, control: AnomalyControl, primary: str) -> None:
        self.control, self.primary = control, primary

    def forwarded(self, step: str, batch: Batch, outs: Any) -> None:
        pass

    def written(self, step: str, batch: Batch) -> None:
        if step == self.primary:
            self.control.observe(batch)

    def failed(self, step: str, batch: Batch, reason: str, *, closes: bool = True) -> None:
        pass


def control_run(executor: Any, graph: Any, policy: AnomalyPolicy) -> AnomalyControl:
    """An anomaly policy on a run (``aisp run``, not served): the executor's sources read no
    faster than the controlled rate (``LocalExecutor.throttle``), and what its primary sink
    writes feeds the monitor."""
    sinks = [n.step_id for n in graph.nodes if n.kind == "sink"]
    control = AnomalyControl(policy)
    executor.throttle = control.wait_for
    executor.lineage = AnomalyTap(control, "out" if "out" in sinks else sinks[0])
    return control
