"""Request options that arrive as HTTP headers or gRPC metadata, parsed strictly for both.

A deadline is a finite, positive number of milliseconds of at most ``MAX_DEADLINE_MS`` (one
hour); anything else is a ``BadRequest`` naming where the value came from. A request's tier is
parsed the same way, by ``aisp.admission.tiers``.
"""

from __future__ import annotations

import math
from typing import Any

from starlette.types import Scope

from aisp.errors import BadRequest

__all__ = [
    "DEADLINE_HEADER",
    "MAX_DEADLINE_MS",
    "Headers",
    "parse_deadline_ms",
]

DEADLINE_HEADER = "X-Request-Deadline-Ms"
"""Milliseconds the client will wait: rows still queued after that are dropped, the request 504s."""
MAX_DEADLINE_MS = 3_600_000.0


def parse_deadline_ms(value: str | None, source: str = DEADLINE_HEADER) -> float | None:
    """Milliseconds from ``value`` (None: not given).

    >>> parse_deadline_ms("250"), parse_deadline_ms(None)
    (250.0, None)
    """
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        raise BadRequest(f"{source} must be a number of milliseconds, got {value[:40]!r}") from None
    if not (math.isfinite(ms) and 0 < ms <= MAX_DEADLINE_MS):
        raise BadRequest(
            f"{source} must be more than 0 and at most {MAX_DEADLINE_MS:.0f} ms, got {value[:40]!r}"
        )
    return ms


class Headers(dict[str, str]):
    """An ASGI request's headers (``of(scope)``) by lower-case name, looked up in any case."""

    @classmethod
    def of(cls, scope: Scope) -> Headers:
        return cls({k.lower().decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})

    def get(self, key: str, default: Any = None) -> Any:
        return dict.get(self, key.lower(), default)
