"""Configuration of the dynamic batcher (sizes in rows, times in milliseconds)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aisp.errors import ConfigError

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
