"""Retrieval confidence of a vector search step: how well the queries it answers match what its
index holds.

A query whose best hit scores low (cosine similarity under ``RetrievalConfidence.threshold``)
found nothing close: a RAG answer built on it quotes passages that do not answer the question.
One such query says little; a rising share of them says the questions moved away from the
corpus (a new topic, a missing document set, an embedding model that changed on one side).

``RetrievalCounters`` counts every query, the distribution of its scores (the best one and
all top k, in fixed buckets), the time spent searching and the index's size and kind (exact or
a graph), exported as ``aisp_retrieval_*`` metrics. With a
``RetrievalConfidence``, ``ConfidenceWindow`` keeps the last ``window_queries`` queries' verdicts
in a ring and evaluates the share of low ones every ``hop_queries``; ``consecutive`` windows in a
row over ``target_share`` raise one alert (a dict: stage, share, threshold, windows, window
number, Unix ms) to ``alert`` (a log line, a webhook, a Redis or NATS stream, a callable, as
drift alerts); it is raised again only after the share has come back under. ``aisp diagnose``
names ``retrieval_confidence`` from the same counters.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.errors import ConfigError
from aisp.observe.clock import wall_ms

__all__ = ["SCORE_BUCKETS", "ConfidenceWindow", "RetrievalConfidence", "RetrievalCounters"]

SCORE_BUCKETS: tuple[float, ...] = tuple(round(-1.0 + 0.1 * i, 1) for i in range(21))
"""Upper bounds of the score histograms: -1.0 to 1.0 by 0.1 (cosine similarity's range)."""


@dataclass(frozen=True, kw_only=True)
class RetrievalConfidence:
    """When a vector search step's queries stop matching its index (see the module docstring).

    Args:
        threshold: a query whose best score is under this is low-confidence.
        target_share: the share of low-confidence queries a window may hold.
        window_queries: queries per window.
        hop_queries: queries between evaluations (the window slides by this; default a quarter
            of the window).
        consecutive: windows in a row over the target before an alert.
        alert: ``log``, an ``http(s)://`` webhook, a ``redis://`` or ``nats://`` stream, or a
            callable taking the alert dict.
    """

    threshold: float = 0.5
    target_share: float = 0.2
    window_queries: int = 200
    hop_queries: int | None = None
    consecutive: int = 3
    alert: str | Callable[[dict[str, Any]], None] = "log"

    def __post_init__(self) -> None:
        if not -1.0 <= self.threshold <= 1.0:
            raise ConfigError(f"retrieval confidence threshold must be in [-1, 1], got {self.threshold}")
        if not 0.0 <= self.target_share < 1.0:
            raise ConfigError(f"target_share must be in [0, 1), got {self.target_share}")
        if self.window_queries < 1 or self.consecutive < 1:
            raise ConfigError("window_queries and consecutive must be >= 1")
        if self.hop_queries is not None and not 1 <= self.hop_queries <= self.window_queries:
            raise ConfigError(f"hop_queries must be in [1, window_queries], got {self.hop_queries}")

    @property
    def hop(self) -> int:
        return self.hop_queries or max(1, self.window_queries // 4)


class RetrievalCounters:
    """Every query a vector search step answered: counts and score histograms (``stats``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._edges = np.asarray(SCORE_BUCKETS)
        self.queries = 0
        self.low = 0
        self.alerts = 0
        self.share = 0.0  # the last evaluated window's share of low queries
        self.threshold: float | None = None
        self.target_share: float | None = None
        self._best = np.zeros(len(SCORE_BUCKETS) + 1, dtype=np.int64)
        self._all = np.zeros(len(SCORE_BUCKETS) + 1, dtype=np.int64)
        self._best_sum = 0.0
        self._all_sum = 0.0
        self.search_ns = 0  # time spent searching (exact or in the graph)
        self.index: dict[str, float] = {}  # documents, exact (1/0), exact_below, expansion_search

    def add(self, best: npt.NDArray[Any], scores: npt.NDArray[Any], low: int) -> None:
        """``best``: each answered query's best score (NaN: no hit); ``scores``: all their top-k
        scores; ``low``: how many were low-confidence."""
        hit = best[~np.isnan(best)]
        best_counts = np.bincount(np.searchsorted(self._edges, hit, side="left"), minlength=len(self._best))
        all_counts = np.bincount(np.searchsorted(self._edges, scores, side="left"), minlength=len(self._all))
        with self._lock:
            self.queries += len(best)
            self.low += low
            self._best += best_counts
            self._all += all_counts
            self._best_sum += float(hit.sum())
            self._all_sum += float(scores.sum())

    def searched(self, ns: int, index: dict[str, float]) -> None:
        """A search took ``ns``; ``index``: the index as it is now (documents, exact, ...)."""
        with self._lock:
            self.search_ns += ns
            self.index = index

    def window(self, share: float, *, alerted: bool) -> None:
        with self._lock:
            self.share = share
            self.alerts += int(alerted)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "queries": self.queries,
                "low": self.low,
                "alerts": self.alerts,
                "share": self.share,
                "threshold": self.threshold,
                "target_share": self.target_share,
                "search_seconds": self.search_ns / 1e9,
                "index": dict(self.index),
                "best": {"buckets": self._best.tolist(), "sum": self._best_sum},
                "topk": {"buckets": self._all.tolist(), "sum": self._all_sum},
            }


class ConfidenceWindow:
    """The sliding window of one running step's queries (see the module docstring)."""

    def __init__(
        self,
        stage: str,
        config: RetrievalConfidence,
        counters: RetrievalCounters,
        alert: Callable[[dict[str, Any]], None],
    ) -> None:
        self.stage, self.config, self.counters = stage, config, counters
        counters.threshold, counters.target_share = config.threshold, config.target_share
        self._ring = np.zeros(config.window_queries, dtype=bool)
        self._at = 0  # next slot of the ring
        self._seen = 0  # queries ever seen (the ring is full once this reaches its size)
        self._since = 0  # queries since the last evaluation
        self._over = 0
        self._alerted = False
        self.windows = 0
        self.alerts: list[dict[str, Any]] = []
        self._alert = alert

    def observe(self, low: npt.NDArray[np.bool_]) -> None:
        """Add queries' verdicts (True: low-confidence), in order; due windows are evaluated."""
        size, hop = len(self._ring), self.config.hop
        start = 0
        while start < len(low):
            take = min(len(low) - start, hop - self._since, size - self._at)
            self._ring[self._at : self._at + take] = low[start : start + take]
            self._at = (self._at + take) % size
            self._seen += take
            self._since += take
            start += take
            if self._since == hop:
                self._since = 0
                if self._seen >= size:
                    self._evaluate()

    def _evaluate(self) -> None:
        cfg = self.config
        self.windows += 1
        share = float(self._ring.mean())
        over = share > cfg.target_share
        self._over = self._over + 1 if over else 0
        self._alerted &= over  # back under: a later run of windows may alert again
        raise_now = self._over >= cfg.consecutive and not self._alerted
        self.counters.window(share, alerted=raise_now)
        if raise_now:
            self._alerted = True
            alert = {
                "type": "retrieval_confidence",
                "stage": self.stage,
                "share": round(share, 4),
                "threshold": cfg.threshold,
                "target_share": cfg.target_share,
                "windows": self._over,
                "window": self.windows,
                "time_unix_ms": wall_ms(),
            }
            self.alerts.append(alert)
            self._alert(alert)
