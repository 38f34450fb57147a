"""Vectorised operators: map, filter, key-by, keyed state, routing, union."""

from aisp.transform.operators import (
    DEFAULT_TIERS,
    AssignTier,
    Filter,
    KeyBy,
    MapBatch,
    MapRows,
    Operator,
    OperatorContext,
    Passthrough,
    Route,
)
from aisp.transform.stateful import RunningStats, Stateful, StateView

__all__ = [
    "AssignTier",
    "DEFAULT_TIERS",
    "Filter",
    "KeyBy",
    "MapBatch",
    "MapRows",
    "Operator",
    "OperatorContext",
    "Passthrough",
    "Route",
    "RunningStats",
    "StateView",
    "Stateful",
]
