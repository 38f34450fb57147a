"""Vectorised operators: map, filter, key-by, keyed state, routing, union."""

from aisp.transform.operators import (
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
