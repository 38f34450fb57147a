"""NATS JetStream (``nats://HOST:PORT/STREAM``)."""

from aisp.connectors.nats.connector import NatsConnector
from aisp.connectors.nats.sink import JetStreamSink, ensure_stream
from aisp.connectors.nats.source import JetStreamSource

CONNECTOR = NatsConnector()

__all__ = ["CONNECTOR", "JetStreamSink", "JetStreamSource", "NatsConnector", "ensure_stream"]
