"""Sinks: the contract (``Sink``/``SinkPartition``), in-process sinks, the dead-letter sink and
process offload. Sinks addressed by URL (files, brokers) are in ``aisp.connectors``."""

from aisp.sinks.base import RowEncoder, Sink, SinkPartition
from aisp.sinks.deadletter import DeadLetterSink, DeadLetterWriter
from aisp.sinks.memory import CollectSink, NullSink

__all__ = [
    "CollectSink",
    "DeadLetterSink",
    "DeadLetterWriter",
    "NullSink",
    "RowEncoder",
    "Sink",
    "SinkPartition",
]
