"""Redis Streams (``redis://HOST:PORT/STREAM``)."""

from aisp.connectors.redis.connector import RedisConnector
from aisp.connectors.redis.sink import RedisStreamSink
from aisp.connectors.redis.source import RedisStreamSource, entry_id_to_int

CONNECTOR = RedisConnector()

__all__ = ["CONNECTOR", "RedisConnector", "RedisStreamSink", "RedisStreamSource", "entry_id_to_int"]
