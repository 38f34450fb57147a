"""Measurement: latency histograms and per-stage statistics."""

from aisp.observe.latency import LatencyHistogram
from aisp.observe.stats import RunStats, StageStats

__all__ = ["LatencyHistogram", "RunStats", "StageStats"]
