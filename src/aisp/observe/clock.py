"""Clocks. Every timing in AISP uses ``time.monotonic_ns()`` (or ``perf_counter_ns()``); a wall-
clock time is only ever derived from a monotonic reading, for what protocols and people read
(Triton's ``last_inference``, a manifest's creation time, an alert's time).

The offset between the two clocks is read once, when the module is imported, so a wall-clock
step (NTP, a manual change) later on moves no duration and no ordering.
"""

from __future__ import annotations

import time

__all__ = ["wall_ms", "wall_ns"]

_WALL_MINUS_MONOTONIC_NS = time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_ns: int | None = None) -> int:
    """Nanoseconds since the Unix epoch of a ``time.monotonic_ns()`` reading (default: now).

    >>> abs(wall_ns() - time.time_ns()) < 5_000_000_000
    True
    """
    return (time.monotonic_ns() if monotonic_ns is None else monotonic_ns) + _WALL_MINUS_MONOTONIC_NS


def wall_ms(monotonic_ns: int | None = None) -> int:
    """Milliseconds since the Unix epoch of a monotonic reading (default: now)."""
    return wall_ns(monotonic_ns) // 1_000_000
