"""Kafka (``kafka://HOST:PORT/TOPIC``), and Tansu as this machine's own Kafka-protocol broker."""

from aisp.connectors.kafka.connector import KafkaConnector, fill_topic, read_topic, tansu_broker
from aisp.connectors.kafka.sink import KafkaSink
from aisp.connectors.kafka.source import KafkaSource, kafka_event_id

CONNECTOR = KafkaConnector()

__all__ = [
    "CONNECTOR",
    "KafkaConnector",
    "KafkaSink",
    "KafkaSource",
    "fill_topic",
    "kafka_event_id",
    "read_topic",
    "tansu_broker",
]
