"""The Redis connector's URLs: every option reaches the source or sink, defaults stay theirs."""

from __future__ import annotations

import msgspec
import pytest

from aisp.connectors.redis.connector import RedisConnector, RedisInput, RedisOutput, _RedisLoad
from aisp.connectors.redis.sink import RedisStreamSink
from aisp.connectors.redis.source import RedisStreamSource
from aisp.errors import ConfigError
from tests.support.url_options import check_options_reach


class Event(msgspec.Struct):
    id: int


def test_every_input_and_output_option_reaches_the_source_and_the_sink() -> None:
    c = RedisConnector()
    check_options_reach(RedisInput, lambda url: c.source(url, Event), "redis://h:1/s", RedisStreamSource)
    check_options_reach(RedisOutput, lambda url: c.sink(url, None), "redis://h:1/s", RedisStreamSink)
    assert c.record_sink("redis://h:1/s?field=f").field == "f"  # type: ignore[attr-defined]


def test_a_load_target_needs_its_output_stream() -> None:
    with pytest.raises(ConfigError, match="give the output stream"):
        _RedisLoad("redis://h:1/in")
    load = _RedisLoad("redis://h:1/in?output=out&field=f")
    assert (load.stream, load.output, load.field) == ("in", "out", "f")
