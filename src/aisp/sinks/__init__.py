"""Sinks: JSON-lines files, null/counting, in-memory collection, and the dead-letter sink."""

from aisp.sinks.base import RowEncoder, Sink, SinkPartition
from aisp.sinks.deadletter import DeadLetterSink, DeadLetterWriter
from aisp.sinks.files import CollectSink, JsonlFileSink, NullSink

__all__ = [
    "CollectSink",
    "DeadLetterSink",
    "DeadLetterWriter",
    "JsonlFileSink",
    "NullSink",
    "RowEncoder",
    "Sink",
    "SinkPartition",
]
