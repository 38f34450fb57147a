"""QoS tiers: their names and levels, and a request's tier as a header or gRPC metadata names it.

A higher level is served first and shed last. Pipelines set a row's tier with
``transform.operators.AssignTier``; a served request names its tier in ``X-Tier`` (HTTP),
``x-tier`` (gRPC metadata) or the OIP ``priority`` parameter.

>>> parse_tier("gold"), parse_tier(None)
(2, None)
"""

from __future__ import annotations

from aisp.errors import BadRequest

__all__ = ["DEFAULT_TIERS", "TIER_HEADER", "TIER_KEY", "parse_tier"]

DEFAULT_TIERS = {"bronze": 0, "silver": 1, "gold": 2}
"""Tier names and their levels: higher levels are served first and shed last."""
TIER_HEADER = "X-Tier"
"""QoS tier name of a request (gold, silver, bronze); the OIP ``priority`` parameter otherwise."""
TIER_KEY = "x-tier"
"""The same as gRPC metadata."""


def parse_tier(name: str | None, source: str = TIER_KEY) -> int | None:
    """The level of tier ``name`` (None: not given); an unknown name is a ``BadRequest`` naming where
    it came from (``source``: a header or metadata key)."""
    if name is None:
        return None
    if name not in DEFAULT_TIERS:
        raise BadRequest(f"{source} must be one of {sorted(DEFAULT_TIERS)}, got {name[:40]!r}")
    return DEFAULT_TIERS[name]
