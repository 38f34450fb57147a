"""The Kafka connector's URLs: every option reaches the source or sink, defaults stay theirs."""

from __future__ import annotations

import msgspec

from aisp.connectors.kafka.connector import KafkaConnector, KafkaInput, KafkaOutput
from aisp.connectors.kafka.sink import KafkaSink
from aisp.connectors.kafka.source import KafkaSource
from tests.support.url_options import check_options_reach


class Event(msgspec.Struct):
    id: int


def test_every_input_and_output_option_reaches_the_source_and_the_sink() -> None:
    c = KafkaConnector()
    check_options_reach(KafkaInput, lambda url: c.source(url, Event), "kafka://h:1/t", KafkaSource)
    check_options_reach(KafkaOutput, lambda url: c.sink(url, None), "kafka://h:1/t", KafkaSink)
