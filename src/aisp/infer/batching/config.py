"""Configuration of the dynamic batcher (sizes in rows, times in milliseconds)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from aisp.errors import ConfigError
from aisp.infer.batching.adaptive import AdaptiveConfig

__all__ = ["BatcherConfig"]

_MS = 1_000_000


def _int_at_least(name: str, value: object, low: int, low_text: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low_text or low}, got {value!r}")


def _ms_at_least(name: str, value: object, low: float, strict: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):  # type: ignore[operator]
        raise ConfigError(f"{name} must be a finite number {'>' if strict else '>='} {low}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class BatcherConfig:
    """How a batcher forms batches. Sizes are in rows, times in milliseconds.

    Tiers (the ``_tier`` column, ``default_tier`` when absent) are served highest first;
    ``tier_timeout_ms`` overrides ``timeout_ms`` per tier. When the queue holds ``capacity_rows``,
    ``overload="block"`` makes ``submit`` wait (backpressure) and ``overload="shed"`` drops the
    lowest-tier rows instead (dead-lettered with reason ``shed``), so higher tiers get in.
    With ``adaptive`` set, ``max_batch_size`` and ``max_queue_delay_ms`` are only the upper
    bound and the first setting: the batcher tunes them online (``aisp.infer.batching.adaptive``).
    With ``ordered`` and several ``instances``, results leave in the order their batches were
    formed (a call that ends early waits for the ones before it), for steps after the model
    that need the input's order (a vector index applies upserts, deletes and queries in order);
    with one tier, that is the order rows arrived in.

    >>> BatcherConfig(max_batch_size=64, preferred_batch_sizes=(32, 16)).preferred_batch_sizes
    (16, 32)
    """

    max_batch_size: int = 512
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ms: float = 1.0
    timeout_ms: float | None = None
    safety_margin_ms: float = 1.0
    eager: bool = True
    capacity_rows: int = 8192
    instances: int = 1
    default_tier: int = 0
    tier_timeout_ms: Mapping[int, float] = field(default_factory=dict)
    overload: Literal["block", "shed"] = "block"
    adaptive: AdaptiveConfig | None = None
    ordered: bool = False

    def __post_init__(self) -> None:
        _int_at_least("max_batch_size", self.max_batch_size, 1)
        top = f"max_batch_size ({self.max_batch_size})"
        for size in self.preferred_batch_sizes:
            _int_at_least("preferred_batch_sizes entries", size, 1)
            if size > self.max_batch_size:
                raise ConfigError(f"preferred_batch_sizes entries must be <= {top}, got {size}")
        object.__setattr__(self, "preferred_batch_sizes", tuple(sorted(set(self.preferred_batch_sizes))))
        _ms_at_least("max_queue_delay_ms", self.max_queue_delay_ms, 0.0)
        if self.timeout_ms is not None:
            _ms_at_least("timeout_ms", self.timeout_ms, 0.0, strict=True)
        _ms_at_least("safety_margin_ms", self.safety_margin_ms, 0.0)
        if not isinstance(self.eager, bool):
            raise ConfigError(f"eager must be a bool, got {self.eager!r}")
        _int_at_least("capacity_rows", self.capacity_rows, self.max_batch_size, top)
        _int_at_least("instances", self.instances, 1)
        _int_at_least("default_tier", self.default_tier, 0)
        for tier, ms in self.tier_timeout_ms.items():
            _int_at_least("tier_timeout_ms keys", tier, 0)
            _ms_at_least(f"tier_timeout_ms[{tier}]", ms, 0.0, strict=True)
        if not isinstance(self.ordered, bool):
            raise ConfigError(f"ordered must be a bool, got {self.ordered!r}")
        if self.overload not in ("block", "shed"):
            raise ConfigError(f"overload must be 'block' or 'shed', got {self.overload!r}")

    def timeout_for(self, tier: int) -> float | None:
        """The queue timeout of rows of ``tier`` in ms (per-tier, else ``timeout_ms``)."""
        return self.tier_timeout_ms.get(tier, self.timeout_ms)
