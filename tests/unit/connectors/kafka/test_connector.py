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


def test_a_login_comes_with_its_mechanism_and_reaches_the_clients_settings() -> None:
    import pytest

    from aisp.connectors.kafka.client import security_settings
    from aisp.errors import ConfigError

    c = KafkaConnector()
    with pytest.raises(ConfigError, match="a login needs its mechanism") as info:
        c.source("kafka://app:s3cr3t@h:1/t", Event)
    assert "s3cr3t" not in str(info.value) and "app:***@" in str(info.value)
    with pytest.raises(ConfigError, match="sasl=GSSAPI: give one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"):
        c.sink("kafka://app:pw@h:1/t?sasl=GSSAPI", None)
    with pytest.raises(ConfigError, match="needs a user and a password"):
        c.sink("kafka://h:1/t?sasl=PLAIN", None)
    source = c.source("kafka://app:pw@h:1/t?sasl=scram-sha-512&tls=1", Event)
    assert isinstance(source, KafkaSource) and "pw" not in repr(source)
    assert security_settings(source.access, source.sasl) == {
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "app", "sasl.password": "pw",
        "security.protocol": "SASL_SSL",
    }  # fmt: skip
    sink = c.sink("kafka://h:1/t?tls=1", None)
    assert isinstance(sink, KafkaSink) and security_settings(sink.access, sink.sasl) == {
        "security.protocol": "SSL"
    }
    assert security_settings(c.sink("kafka://h:1/t", None).access, None) == {}  # type: ignore[attr-defined]


def test_a_fetch_wait_out_of_librdkafkas_range_is_refused_when_the_url_is_read() -> None:
    import pytest

    from aisp.errors import ConfigError

    c = KafkaConnector()
    assert isinstance(c.source("kafka://h:1/t?fetch_wait_ms=0", Event), KafkaSource)
    for bad in ("-1", "300001"):
        with pytest.raises(ConfigError, match=f"fetch_wait_ms must be 0 to 300000, got {bad}"):
            c.source(f"kafka://h:1/t?fetch_wait_ms={bad}", Event)
