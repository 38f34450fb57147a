"""Adaptive batching: try batching settings online, keep the throughput/latency Pareto front over
a sliding window, serve the highest-throughput setting whose p99 meets the target.

The tuner is a pure state machine fed with completed batches (``observe``) and a clock the
caller supplies. It explores each candidate setting for ``trial_s`` (and at least
``trial_batches`` batches), then exploits the best one; it explores again when the offered load
moves by more than ``retune_change`` or the p99 of the setting in use breaks the target.
Settings are ``(max_batch_size, max_queue_delay_ms)``; a delay of 0 means eager dispatch.

Latency per row is approximated per batch by its oldest row's queue wait plus the compute time
(an upper bound for the batch's rows), weighted by the batch's rows.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["AdaptiveConfig", "AdaptiveTuner", "Setting", "TrialResult"]

log = logging.getLogger("aisp.adaptive")


@dataclass(frozen=True, order=True)
class Setting:
    max_batch_size: int
    max_queue_delay_ms: float

    @property
    def eager(self) -> bool:
        return self.max_queue_delay_ms == 0


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig:
    """Targets and pacing of the tuner (times in seconds unless named otherwise)."""

    p99_target_ms: float = 20.0
    batch_sizes: Sequence[int] = (32, 64, 128, 256, 512)
    delays_ms: Sequence[float] = (0.0, 1.0, 2.0)
    trial_s: float = 0.5
    trial_batches: int = 20
    window_s: float = 30.0
    retune_change: float = 0.3
    bail_out: float = 3.0


@dataclass(frozen=True)
class TrialResult:
    setting: Setting
    rows_per_s: float
    p99_ms: float
    at_ns: int


@dataclass
class _Trial:
    setting: Setting
    started_ns: int
    batches: int = 0
    rows: list[int] = field(default_factory=list)
    latencies_ns: list[int] = field(default_factory=list)
    rows_total: int = 0
    rows_within: int = 0  # rows of batches within the bail-out limit (see observe)


def weighted_p99(latencies_ns: Sequence[int], rows: Sequence[int]) -> float:
    """p99 in ms of per-batch latencies, each counted once per row of its batch."""
    if not latencies_ns:
        return 0.0
    lat = np.asarray(latencies_ns, dtype=np.float64)
    w = np.asarray(rows, dtype=np.float64)
    order = np.argsort(lat)
    cum = np.cumsum(w[order])
    i = int(np.searchsorted(cum, 0.99 * cum[-1]))
    return float(lat[order][min(i, len(lat) - 1)] / 1e6)


class AdaptiveTuner:
    """Chooses batching settings online (see the module docstring).

    >>> t = AdaptiveTuner(AdaptiveConfig(batch_sizes=(8,), delays_ms=(0.0,)), max_batch_size=8, now_ns=0)
    >>> t.current
    Setting(max_batch_size=8, max_queue_delay_ms=0.0)
    """

    def __init__(self, config: AdaptiveConfig, *, max_batch_size: int, now_ns: int) -> None:
        self.config = config
        sizes = sorted({min(s, max_batch_size) for s in config.batch_sizes})
        self.candidates = [Setting(b, float(d)) for b in sizes for d in sorted(set(config.delays_ms))]
        self.results: deque[TrialResult] = deque()
        self.decisions = 0
        self._queue = list(self.candidates)
        self._trial = _Trial(self._queue.pop(0), now_ns)
        self._exploring = True
        self._chosen_rate: float | None = None
        self._arrived = 0
        self._arrived_at_trial = 0
        self._chosen_met_target = False

    @property
    def current(self) -> Setting:
        return self._trial.setting

    @property
    def exploring(self) -> bool:
        return self._exploring

    def observe(self, now_ns: int, rows: int, latency_ns: int) -> Setting | None:
        """Record a finished batch; returns a new setting to apply, or None to keep the current."""
        t = self._trial
        t.batches += 1
        t.rows.append(rows)
        t.latencies_ns.append(latency_ns)
        t.rows_total += rows
        if latency_ns / 1e6 <= self.config.bail_out * self.config.p99_target_ms:
            t.rows_within += rows
        elapsed_s = (now_ns - t.started_ns) / 1e9
        if t.batches < self.config.trial_batches or elapsed_s < self.config.trial_s:
            if not self._exploring or t.batches < max(3, self.config.trial_batches // 2):
                return None
            # bail out of a setting that is already far over the target: exploring it longer
            # would only build a backlog the next settings inherit
            # (the row-weighted p99 is within the limit exactly when 99% of the rows are: O(1)
            # per batch, under the batcher's lock, instead of a sort)
            if t.rows_within >= 0.99 * t.rows_total:
                return None
        result = TrialResult(
            t.setting, t.rows_total / max(elapsed_s, 1e-9), weighted_p99(t.latencies_ns, t.rows), now_ns
        )
        self._remember(result)
        if self._exploring:
            if self._queue:
                return self._start(self._queue.pop(0), now_ns)
            return self._settle(now_ns)
        if self._needs_retune(result):
            log.info(
                "adaptive batching: load or latency changed (%.0f rows/s, p99 %.1f ms); re-tuning",
                result.rows_per_s,
                result.p99_ms,
            )
            self._exploring = True
            self._queue = [c for c in self.candidates if c != t.setting]
            return self._start(self._queue.pop(0), now_ns) if self._queue else self._settle(now_ns)
        self._trial = _Trial(t.setting, now_ns)  # keep measuring the chosen setting
        self._arrived_at_trial = self._arrived
        return None

    def arrived(self, rows: int) -> None:
        """Count offered rows (the load signal for re-tuning, unlike throughput, which a backlog
        inflates while it drains)."""
        self._arrived += rows

    def front(self) -> list[TrialResult]:
        """The Pareto front of the window: no other result has higher throughput and lower p99."""
        best: dict[Setting, TrialResult] = {}
        for r in self.results:
            best[r.setting] = r  # latest measurement of each setting
        pts = list(best.values())
        return sorted(
            (
                p
                for p in pts
                if not any(
                    q.rows_per_s >= p.rows_per_s
                    and q.p99_ms < p.p99_ms
                    or q.rows_per_s > p.rows_per_s
                    and q.p99_ms <= p.p99_ms
                    for q in pts
                )
            ),
            key=lambda r: (-r.rows_per_s, r.p99_ms),
        )

    def _remember(self, result: TrialResult) -> None:
        self.results.append(result)
        horizon = result.at_ns - int(self.config.window_s * 1e9)
        while self.results and self.results[0].at_ns < horizon:
            self.results.popleft()

    def _start(self, setting: Setting, now_ns: int) -> Setting:
        self._trial = _Trial(setting, now_ns)
        self._arrived_at_trial = self._arrived
        return setting

    def _settle(self, now_ns: int) -> Setting:
        front = self.front()
        ok = [r for r in front if r.p99_ms <= self.config.p99_target_ms]
        # highest throughput meeting the target; rates within 5% count as equal, then lowest p99
        if ok:
            top = max(r.rows_per_s for r in ok)
            choice = min((r for r in ok if r.rows_per_s >= 0.95 * top), key=lambda r: r.p99_ms)
        else:
            choice = min(front, key=lambda r: r.p99_ms)
        self._exploring = False
        self._chosen_rate = None  # set from the offered load of the first exploit window
        self._chosen_met_target = bool(ok)
        self.decisions += 1
        log.info(
            "adaptive batching: max_batch_size=%d max_queue_delay_ms=%g "
            "(%.0f rows/s, p99 %.2f ms, target %g ms%s)",
            choice.setting.max_batch_size,
            choice.setting.max_queue_delay_ms,
            choice.rows_per_s,
            choice.p99_ms,
            self.config.p99_target_ms,
            "" if ok else "; no setting meets it, lowest p99 chosen",
        )
        return self._start(choice.setting, now_ns)

    def _needs_retune(self, result: TrialResult) -> bool:
        t = self._trial
        offered = (self._arrived - self._arrived_at_trial) / max((result.at_ns - t.started_ns) / 1e9, 1e-9)
        if self._chosen_rate is None:
            self._chosen_rate = offered
            return False
        chosen = self._chosen_rate
        moved = abs(offered - chosen) > self.config.retune_change * max(chosen, 1.0)
        broke = self._chosen_met_target and result.p99_ms > self.config.p99_target_ms * 1.5
        return moved or broke

    def describe(self) -> dict[str, object]:
        s = self.current
        return {
            "max_batch_size": s.max_batch_size,
            "max_queue_delay_ms": s.max_queue_delay_ms,
            "exploring": self._exploring,
            "decisions": self.decisions,
            "front": [
                {
                    "max_batch_size": r.setting.max_batch_size,
                    "max_queue_delay_ms": r.setting.max_queue_delay_ms,
                    "rows_per_s": round(r.rows_per_s),
                    "p99_ms": round(r.p99_ms, 3),
                }
                for r in self.front()
            ],
        }
