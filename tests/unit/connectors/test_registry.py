"""One registry resolves every URL to its connector; the connector owns the scheme's parsing."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest

from aisp import CollectSink, Pipeline, WorkloadFSource
from aisp.connectors import (
    Connector,
    connector_for,
    dead_letter_sink,
    register,
    registry,
    schemes,
    sink_for,
    source_for,
)
from aisp.connectors.file import JsonlFileSink, JsonlFileSource
from aisp.connectors.kafka import KafkaSink, KafkaSource
from aisp.connectors.nats import JetStreamSink, JetStreamSource
from aisp.connectors.redis import RedisStreamSink, RedisStreamSource
from aisp.errors import ConfigError
from aisp.ingest.base import Source
from aisp.sinks import NullSink
from aisp.sinks.base import Sink

ROOT = Path(__file__).resolve().parents[3]


class Ev(msgspec.Struct):
    id: int


class _Piped:
    name = "p"
    input_schema = Ev
    output_columns = ["id"]


def test_every_builtin_scheme_has_its_folder_and_resolves_to_its_connector() -> None:
    for scheme in ("file", "kafka", "nats", "redis"):
        assert (ROOT / "src" / "aisp" / "connectors" / scheme / "__init__.py").is_file()
        assert connector_for(f"{scheme}://127.0.0.1/x").scheme == scheme
    assert {"file", "kafka", "nats", "null", "redis"} <= set(schemes())


@pytest.mark.parametrize(
    ("url", "source", "sink"),
    [
        ("events.jsonl", JsonlFileSource, JsonlFileSink),
        ("file:///tmp/events.jsonl", JsonlFileSource, JsonlFileSink),
        ("C:/data/events.jsonl", JsonlFileSource, JsonlFileSink),
        ("redis://127.0.0.1:6379/s?group=g", RedisStreamSource, RedisStreamSink),
        ("kafka://127.0.0.1:9092/t", KafkaSource, KafkaSink),
        ("nats://127.0.0.1:4222/S", JetStreamSource, JetStreamSink),
    ],
)
def test_urls_resolve_to_their_source_and_sink(url: str, source: type, sink: type) -> None:
    base = url.split("?")[0]
    assert isinstance(source_for(_Piped(), url), source)
    assert isinstance(sink_for(_Piped(), base), sink)


def test_parsed_addresses_and_options_reach_the_source_and_sink() -> None:
    src = source_for(_Piped(), "redis://10.0.0.2:7000/in?group=g&claim_idle_ms=5&idle_stop_s=1.5")
    assert isinstance(src, RedisStreamSource)
    assert (src.host, src.port, src.stream, src.group, src.claim_idle_ms, src.stop_when_idle_s) == (
        "10.0.0.2", 7000, "in", "g", 5, 1.5,
    )  # fmt: skip
    sink = sink_for(_Piped(), "kafka://broker/out?partitions=3")
    assert isinstance(sink, KafkaSink)
    assert (sink.bootstrap, sink.topic, sink.partitions, list(sink.columns or [])) == (
        "broker:9092", "out", 3, ["id"],
    )  # fmt: skip
    nats = source_for(_Piped(), "nats://h/S?durable=d&subject=S.x")
    assert isinstance(nats, JetStreamSource)
    assert (nats.servers, nats.stream, nats.durable, nats.subject) == ("nats://h:4222", "S", "d", "S.x")
    assert isinstance(sink_for(_Piped(), "null:"), NullSink)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:6379/s?grop=g", "unknown option 'grop'"),
        ("redis://127.0.0.1:6379/s?claim_idle_ms=soon", "is not a int"),
        ("kafka://127.0.0.1:9092/", "name the topic"),
        ("nats://127.0.0.1:4222", "name the stream"),
        ("ftp://host/x", "unsupported URL 'ftp://host/x'"),
        ("null:", "cannot be used as an input"),
    ],
)
def test_bad_urls_fail_clearly(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        source_for(_Piped(), url)


def test_dead_letters_go_to_a_file_or_a_stream_and_alerts_only_to_a_stream() -> None:
    assert dead_letter_sink("dl.jsonl").path == "dl.jsonl"
    assert isinstance(dead_letter_sink("redis://127.0.0.1:6379/dl?field=f").stream, RedisStreamSink)
    assert isinstance(dead_letter_sink("nats://127.0.0.1:4222/DL").stream, JetStreamSink)
    with pytest.raises(ConfigError, match="cannot be used for dead letters"):
        dead_letter_sink("kafka://127.0.0.1:9092/dl")
    with pytest.raises(ConfigError, match="cannot be used for dead letters"):
        connector_for("alerts.jsonl").record_sink("alerts.jsonl")


class _Memory(Connector):
    """A scheme added from outside: ``mem://NAME`` reads generated events, writes to a list."""

    scheme = "mem"

    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []

    def source(self, url: str, schema: type[msgspec.Struct]) -> Source:
        return WorkloadFSource(events=10)

    def sink(self, url: str, columns: Sequence[str] | None) -> Sink:
        return CollectSink(rows=self.rows, columns=columns)


def test_a_new_scheme_is_one_registration() -> None:
    mem = _Memory()
    register("mem", mem)
    try:
        p = Pipeline("mem")
        p.source("events", WorkloadFSource(events=1)).sink("out", CollectSink())
        assert isinstance(connector_for("mem://x").source("mem://x", Ev), WorkloadFSource)
        assert sink_for(p, "mem://y") == CollectSink(rows=mem.rows, columns=p.output_columns)
    finally:
        registry._LOADED.pop("mem")


def test_no_module_outside_connectors_dispatches_on_a_broker_scheme() -> None:
    """Schemes are resolved by the registry: no comparison with, or prefix test for, a broker
    scheme outside aisp.connectors."""
    offenders = []
    for path in sorted((ROOT / "src" / "aisp").rglob("*.py")):
        if "connectors" in path.relative_to(ROOT / "src" / "aisp").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if text in ("redis://", "nats://", "kafka://") or text.startswith(
                    ("redis://", "nats://", "kafka://")
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {text!r}")
    assert offenders == []
