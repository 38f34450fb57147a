"""Backoff and time-bounded retries: the one policy of waits every retry loop in AISP uses.

``Backoff`` is exponential backoff, with full jitter where several clients may retry at once
(brokers, model servers, LLM endpoints) and without where one waiter polls (an inbox with room,
a server that is starting). ``call_with_retry`` retries a call for connectors: a broker that goes
away for a while is waited for; one that stays away past the limit stops the pipeline with an
error that says where and for how long, never a silent hang.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from aisp.errors import AispError

__all__ = ["RETRIES", "Backoff", "RetryCounts", "call_with_retry"]

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """The wait before retry ``k`` (0, 1, ...): ``min(max_s, base_s * 2**k)``, or, with ``jitter``
    (full jitter), a uniform draw below it.

    >>> [Backoff(0.1, 0.5, jitter=False).delay(k) for k in range(4)]
    [0.1, 0.2, 0.4, 0.5]
    >>> Backoff(0.02, 1.0).delay(3, rand=lambda: 1.0)
    0.16
    """

    base_s: float
    max_s: float
    jitter: bool = True

    def delay(self, k: int, rand: Callable[[], float] = random.random) -> float:
        ceiling = min(self.max_s, self.base_s * 2.0 ** min(k, 64))
        return rand() * ceiling if self.jitter else ceiling

    def delays(self, rand: Callable[[], float] = random.random) -> Iterator[float]:
        """``delay(0)``, ``delay(1)``, ... for good."""
        k = 0
        while True:
            yield self.delay(k, rand)
            k += 1


class RetryCounts:
    """Retries in this process by (target, reason), for ``aisp_retries_total``; targets are the
    configured brokers and models, reasons exception types or status codes (both bounded)."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def note(self, target: str, reason: str) -> None:
        with self._lock:
            self._counts[(target, reason)] += 1

    def items(self) -> list[tuple[tuple[str, str], int]]:
        with self._lock:
            return sorted(self._counts.items())


RETRIES = RetryCounts()


def call_with_retry(
    fn: Callable[..., T],
    *args: Any,
    retry_on: tuple[type[BaseException], ...],
    give_up_after_s: float,
    what: str,
    error: type[AispError] = AispError,
    base_s: float = 0.05,
    max_s: float = 2.0,
    final: Callable[[BaseException], str | None] | None = None,
) -> T:
    """``fn(*args)``; on ``retry_on`` sleep uniform(0, min(max_s, base_s * 2**k)) and try again,
    until ``give_up_after_s`` passed: then raise ``error`` naming ``what``. ``final(exc)``: the
    reason an error will not pass by waiting (authentication refused, a certificate not
    trusted), raised as ``error`` at once; None to retry it.

    >>> calls = []
    >>> def flaky() -> str:
    ...     calls.append(1)
    ...     if len(calls) < 3:
    ...         raise ConnectionError("down")
    ...     return "up"
    >>> call_with_retry(flaky, retry_on=(ConnectionError,), give_up_after_s=5, what="x", base_s=0.001)
    'up'
    """
    deadline = time.monotonic() + give_up_after_s
    waits = Backoff(base_s, max_s).delays()
    while True:
        try:
            return fn(*args)
        except retry_on as exc:
            reason = final(exc) if final is not None else None
            if reason is not None:
                raise error(f"{what}: {reason}: {exc}") from exc
            if time.monotonic() >= deadline:
                raise error(f"{what} unreachable for {give_up_after_s:g} s: {exc}") from exc
            RETRIES.note(what, type(exc).__name__)
            time.sleep(next(waits))
