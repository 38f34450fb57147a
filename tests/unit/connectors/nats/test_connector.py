"""The NATS connector's URLs: every option reaches the source or sink, defaults stay theirs."""

from __future__ import annotations

import msgspec
import pytest

from aisp.connectors.nats.connector import NatsConnector, NatsInput, NatsOutput, _JetStreamLoad
from aisp.connectors.nats.sink import JetStreamSink
from aisp.connectors.nats.source import JetStreamSource
from aisp.errors import ConfigError
from tests.support.url_options import check_options_reach


class Event(msgspec.Struct):
    id: int


def test_every_input_and_output_option_reaches_the_source_and_the_sink() -> None:
    c = NatsConnector()
    check_options_reach(NatsInput, lambda url: c.source(url, Event), "nats://h:1/S", JetStreamSource)
    check_options_reach(NatsOutput, lambda url: c.sink(url, None), "nats://h:1/S", JetStreamSink)
    assert c.record_sink("nats://h:1/S?subject=S.dl").subject == "S.dl"  # type: ignore[attr-defined]


def test_a_load_target_needs_its_output_stream_and_names_its_subjects() -> None:
    with pytest.raises(ConfigError, match="give the output stream"):
        _JetStreamLoad("nats://h:1/IN")
    load = _JetStreamLoad("nats://h:1/IN?output=OUT")
    assert (load.stream, load.output, load.subject, load.output_subject) == (
        "IN",
        "OUT",
        "IN.bench",
        "OUT.out",
    )
    load = _JetStreamLoad("nats://h:1/IN?output=OUT&subject=a&output_subject=b")
    assert (load.subject, load.output_subject) == ("a", "b")
