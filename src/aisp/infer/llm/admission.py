"""Admission of an ``llm`` step by time to first token (TTFT): what the step measured recently and
what it is doing now, turned into a prediction, a decision and a Retry-After that holds.

The step measures three times: the server's time to a first token, a whole generation, and the
time events take to reach the step (the steps before it). Each counts for ``LlmSlo.memory_s``
(and only the last ``LlmSlo.window`` of each), so a slow answer is forgotten in time whatever
comes after it. The prediction takes the ``LlmSlo.quantile`` (p99 by default) of each:

    TTFT = before + wait for a slot + first token

where the wait comes from the running generations' expected ends (when sent + the generation
quantile) and the requests ahead of the event (each slot serves them one whole generation after
another). An event is admitted when that is within ``LlmSlo.margin`` of the target; with nothing
measured (yet, or any more), when fewer than the slots are ahead of it.

A step that only measures what it admits would never learn again after a refusal: when it has
been idle (nothing running, queued or on its way) for ``LlmSlo.probe_ms`` since its last
generation ended, one event is admitted whatever the prediction (a *probe*), and what it measures
joins the estimate.

``retry_after_ns``: the first time at which the same event would be admitted if nothing else
arrived and the running generations ended when predicted: the wait has shrunk enough, measured
times that held it back have expired, or the step has been idle long enough for a probe.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from aisp.errors import ConfigError

__all__ = ["LlmSlo", "Load", "RecentTimes", "TtftPredictor"]

_MS = 1_000_000
_INF = math.inf


@dataclass(frozen=True, kw_only=True)
class LlmSlo:
    """Targets admission enforces (None: not enforced) and how it measures."""

    ttft_ms: float | None = None
    """Time to first token at p99, from the event's ingest: what its client waits, the steps
    before this one and the queueing here included."""
    jitter: float | None = None
    """Jitter of the gaps between pieces (stdev / mean), averaged over recent requests."""
    margin: float = 0.9
    """Admit only when the predicted TTFT is within this share of the target."""
    quantile: float = 0.99
    """The share of recent times each part of the prediction covers."""
    window: int = 32
    """Recent requests the estimates and the jitter control look at."""
    memory_s: float = 10.0
    """How long a measured time counts."""
    probe_ms: float = 1000.0
    """Idle this long (nothing running, queued or on its way since the last generation ended),
    the step admits one event whatever the prediction."""

    def __post_init__(self) -> None:
        checks = (
            ("ttft_ms", self.ttft_ms is None or self.ttft_ms > 0, "> 0"),
            ("margin", 0 < self.margin <= 1, "in (0, 1]"),
            ("quantile", 0 < self.quantile <= 1, "in (0, 1]"),
            ("window", self.window >= 1, ">= 1"),
            ("memory_s", self.memory_s > 0, "> 0"),
            ("probe_ms", self.probe_ms >= 0, ">= 0"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ConfigError(f"LlmSlo.{name} must be {what}, got {getattr(self, name)!r}")


class RecentTimes:
    """Durations (ns) measured at times (ns): the last ``window`` of them, each for ``memory_ns``."""

    def __init__(self, window: int, memory_ns: int) -> None:
        self.memory_ns = memory_ns
        self._samples: deque[tuple[int, int]] = deque(maxlen=window)

    def add(self, at_ns: int, value_ns: int) -> None:
        self._samples.append((at_ns, value_ns))

    def values(self, at_ns: int) -> list[int]:
        """The durations that still count at ``at_ns``."""
        cutoff = at_ns - self.memory_ns
        return [v for t, v in list(self._samples) if t > cutoff]

    def quantile(self, q: float, at_ns: int) -> int | None:
        """The ``q`` quantile of what counts at ``at_ns``; None when nothing does."""
        values = self.values(at_ns)
        return int(np.percentile(values, q * 100)) if values else None

    def expiries(self, after_ns: int) -> list[int]:
        """When each duration that counts at ``after_ns`` stops counting."""
        return [t + self.memory_ns for t, _ in list(self._samples) if t + self.memory_ns > after_ns]

    def __len__(self) -> int:
        return len(self._samples)


@dataclass(frozen=True, slots=True)
class Load:
    """What a step is doing, as admission sees it."""

    running_sent_ns: tuple[int, ...]
    """When each running generation was sent."""
    waiting: int
    """Requests ahead of a new one that are not running: queued, or on their way."""
    limit: int
    """Generations at a time."""
    reserved_until_ns: tuple[int, ...] = ()
    """When each of the ``waiting`` that an admission let in stops counting, if it has not come."""
    idle_since_ns: int | None = None
    """When the last generation ended (None: none has)."""

    def at(self, t_ns: int) -> Load:
        """This load at ``t_ns``, the admitted requests that have not come by then not counted."""
        gone = sum(1 for u in self.reserved_until_ns if u <= t_ns)
        if not gone:
            return self
        kept = tuple(u for u in self.reserved_until_ns if u > t_ns)
        return replace(self, waiting=max(0, self.waiting - gone), reserved_until_ns=kept)

    @property
    def ahead(self) -> int:
        """Requests a new one waits behind, beyond the free slots."""
        return max(0, self.waiting + len(self.running_sent_ns) - max(1, self.limit))

    @property
    def idle(self) -> bool:
        return not self.running_sent_ns and not self.waiting


class TtftPredictor:
    """Predicts an event's TTFT from recent times and a ``Load`` (see the module docstring)."""

    def __init__(self, slo: LlmSlo) -> None:
        self.slo = slo
        memory_ns = int(slo.memory_s * 1e9)
        self.first = RecentTimes(slo.window, memory_ns)
        """Request sent -> first piece."""
        self.generation = RecentTimes(slo.window, memory_ns)
        """Request sent -> last piece."""
        self.upstream = RecentTimes(slo.window, memory_ns)
        """Ingest -> arrival at the step."""

    def record(self, at_ns: int, first_ns: int, generation_ns: int) -> None:
        self.first.add(at_ns, first_ns)
        self.generation.add(at_ns, generation_ns)

    def _parts(self, elapsed_ns: int | None, at_ns: int) -> tuple[int, int, int] | None:
        """(before, generation, first token) quantiles at ``at_ns``; None with nothing measured."""
        q = self.slo.quantile
        first, service = self.first.quantile(q, at_ns), self.generation.quantile(q, at_ns)
        if first is None or service is None:
            return None
        before = elapsed_ns if elapsed_ns is not None else (self.upstream.quantile(q, at_ns) or 0)
        return before, service, first

    @staticmethod
    def wait_ns(load: Load, service_ns: int, at_ns: int) -> int:
        """How long a new request waits for a slot at ``at_ns``."""
        limit = max(1, load.limit)
        ends = sorted(max(0, sent + service_ns - at_ns) for sent in load.running_sent_ns)
        ends = ([0] * max(0, limit - len(ends)) + ends)[:limit]
        ahead = load.ahead
        return ends[ahead % limit] + (ahead // limit) * service_ns

    def predict_ns(self, load: Load, elapsed_ns: int | None, at_ns: int) -> int | None:
        """The TTFT of an event ``elapsed_ns`` after its ingest (None: one not yet through the
        steps before, which recently took their quantile) arriving at ``at_ns``; None while
        nothing counts."""
        parts = self._parts(elapsed_ns, at_ns)
        if parts is None:
            return None
        before, service, first = parts
        return before + self.wait_ns(load, service, at_ns) + first

    @property
    def target_ns(self) -> int | None:
        return None if self.slo.ttft_ms is None else int(self.slo.ttft_ms * _MS)

    @property
    def allowed_ns(self) -> int:
        return int((self.slo.ttft_ms or 0.0) * self.slo.margin * _MS)

    def over(self, load: Load, elapsed_ns: int | None, at_ns: int) -> tuple[int, int] | None:
        """(predicted, target) when an event would miss the target; None admits it."""
        target = self.target_ns
        if target is None:
            return None
        predicted = self.predict_ns(load, elapsed_ns, at_ns)
        if predicted is None:  # nothing counts: only as many as run at once may wait
            return (target + 1, target) if load.ahead >= max(1, load.limit) else None
        return (predicted, target) if predicted > self.allowed_ns else None

    def may_probe(self, load: Load, at_ns: int) -> bool:
        """Whether the step has been idle long enough to admit one event whatever the prediction."""
        since = load.idle_since_ns
        return load.idle and since is not None and at_ns - since >= int(self.slo.probe_ms * _MS)

    def _probe_at(self, load: Load, now_ns: int) -> float:
        """When a probe would be let in, if nothing else arrived (inf: cannot tell)."""
        probe_ns = int(self.slo.probe_ms * _MS)
        if load.idle:
            return (load.idle_since_ns if load.idle_since_ns is not None else now_ns) + probe_ns
        service = self.generation.quantile(self.slo.quantile, now_ns)
        if service is None:
            return _INF
        limit = max(1, load.limit, len(load.running_sent_ns))
        free = [now_ns] * (limit - len(load.running_sent_ns))
        free += [max(now_ns, sent + service) for sent in load.running_sent_ns]
        heapq.heapify(free)
        for _ in range(load.waiting):  # each slot serves those ahead one after another
            heapq.heappush(free, heapq.heappop(free) + service)
        return max(free) + probe_ns

    def _admitted_from(self, load: Load, elapsed_ns: int | None, now_ns: int, t0: int) -> float:
        """The first time from ``t0`` at which the event is admitted, with what counts at ``t0``
        (inf: not while that holds)."""
        parts = self._parts(elapsed_ns, t0)
        if parts is None:
            return t0 if load.ahead < max(1, load.limit) else _INF
        before, service, first = parts
        slack = self.allowed_ns - before - first
        if slack < 0:
            return _INF
        return max(t0, now_ns + self.wait_ns(load, service, now_ns) - slack)

    def retry_after_ns(self, load: Load, elapsed_ns: int | None, now_ns: int) -> int | None:
        """How long until an event refused now would be admitted (see the module docstring);
        None when that cannot be told (nothing counts and every slot is busy)."""
        changes = {*load.reserved_until_ns, *self.first.expiries(now_ns), *self.generation.expiries(now_ns)}
        if elapsed_ns is None:
            changes.update(self.upstream.expiries(now_ns))
        starts = [now_ns, *sorted(t for t in changes if t > now_ns)]
        probe = self._probe_at(load, now_ns)
        for i, t0 in enumerate(starts):
            t1 = starts[i + 1] if i + 1 < len(starts) else _INF
            first_ok = min(self._admitted_from(load.at(t0), elapsed_ns, now_ns, t0), probe)
            if first_ok < t1:
                return int(first_ok) - now_ns
        return None if probe == _INF else int(probe) - now_ns
