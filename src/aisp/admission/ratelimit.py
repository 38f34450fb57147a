"""Token-bucket rate limits, keyed (per API key, per tier), over an injectable clock.

A bucket holds up to ``burst`` tokens and refills at ``rate_per_s``; a request of ``n`` rows
takes ``n`` tokens or is refused with the time until they will be there (``Retry-After``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aisp.errors import ConfigError

__all__ = ["Limiter", "RateLimits", "TokenBucket"]


class TokenBucket:
    """``rate_per_s`` tokens a second, at most ``burst`` saved up.

    >>> now = [0.0]
    >>> b = TokenBucket(rate_per_s=10, burst=5, clock=lambda: now[0])
    >>> b.take(5), b.take(1)
    (0.0, 0.1)
    >>> now[0] = 0.1; b.take(1)
    0.0
    """

    def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or burst <= 0:
            raise ConfigError(f"rate_per_s and burst must be > 0, got {rate_per_s} and {burst}")
        self.rate, self.burst = rate_per_s, burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()
        self._lock = threading.Lock()

    def take(self, n: float = 1.0) -> float:
        """Take ``n`` tokens: 0.0 when granted, else the seconds until they would be."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if n <= self._tokens:
                self._tokens -= n
                return 0.0
            return round((n - self._tokens) / self.rate, 9)


@dataclass(frozen=True, kw_only=True)
class RateLimits:
    """Limits in rows per second: per API key (``per_key_rps``) and per tier (``per_tier_rps``).

    0 means unlimited. Buckets hold ``burst_s`` seconds worth of rate.
    """

    per_key_rps: float = 0.0
    per_tier_rps: dict[int, float] | None = None
    burst_s: float = 1.0

    @classmethod
    def from_config(cls, section: Mapping[str, Any], tier_levels: Mapping[str, int]) -> RateLimits:
        """From a ``[limits]`` table: ``per_key_rps``, ``burst_s`` and ``[limits.tiers] name = rps``."""
        tiers = {}
        for name, rps in dict(section.get("tiers", {})).items():
            if name not in tier_levels:
                raise ConfigError(f"[limits.tiers]: unknown tier {name!r}; tiers are {sorted(tier_levels)}")
            tiers[tier_levels[name]] = float(rps)
        return cls(
            per_key_rps=float(section.get("per_key_rps", 0.0)),
            per_tier_rps=tiers,
            burst_s=float(section.get("burst_s", 1.0)),
        )

    @property
    def enabled(self) -> bool:
        return self.per_key_rps > 0 or any(v > 0 for v in (self.per_tier_rps or {}).values())


class Limiter:
    """Applies ``RateLimits``: a bucket per key seen and per limited tier."""

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._keys: dict[str, TokenBucket] = {}
        self._tiers = {
            tier: TokenBucket(rps, max(1.0, rps * limits.burst_s), clock)
            for tier, rps in (limits.per_tier_rps or {}).items()
            if rps > 0
        }
        self._lock = threading.Lock()

    def admit(self, key: str, tier: int, rows: int) -> float:
        """0.0 if the request may go, else seconds to wait (for ``Retry-After``, rounded up)."""
        wait = 0.0
        if self.limits.per_key_rps > 0:
            with self._lock:
                bucket = self._keys.get(key)
                if bucket is None:
                    rps = self.limits.per_key_rps
                    bucket = self._keys[key] = TokenBucket(
                        rps, max(1.0, rps * self.limits.burst_s), self._clock
                    )
            wait = bucket.take(rows)
        tier_bucket = self._tiers.get(tier)
        if not wait and tier_bucket is not None:
            wait = tier_bucket.take(rows)
        return wait

    @staticmethod
    def retry_after(wait_s: float) -> str:
        return str(max(1, math.ceil(wait_s)))
