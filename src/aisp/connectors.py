"""Connectors addressed by URL, as the command line names them (``--input``, ``--output``).

* a plain path or ``file://PATH``: JSON lines (``null:`` for a counting sink);
* ``redis://HOST:PORT/STREAM``: a Redis stream of JSON events in a field. Input options:
  ``group`` (default ``aisp``), ``consumer`` (``aisp-1``), ``field`` (``data``),
  ``claim_idle_ms`` (30000), ``idle_stop_s`` (end the input after that long without an entry;
  default: never), ``retry_s`` (how long a lost connection is retried before the run fails;
  30). Output options: ``field`` (``data``), ``dedupe_ttl_s`` (604800), ``retry_s`` (30).
* ``kafka://HOST:PORT/TOPIC``: a Kafka topic of JSON events (``confluent-kafka``). Input options:
  ``group`` (default ``aisp``), ``idle_stop_s``, ``retry_s``. Output options: ``partitions`` (1;
  the topic is created if missing), ``retry_s``, ``transactional_id`` (write in transactions,
  one per checkpoint, with the source's offsets).
* ``nats://HOST:PORT/STREAM``: a NATS JetStream stream of JSON events. Input options:
  ``durable`` (the pull consumer, default ``aisp``), ``subject`` (a filter), ``idle_stop_s``,
  ``retry_s``. Output options: ``subject`` (default ``STREAM.out``; the stream is created if
  missing), ``duplicate_window_s`` (3600, for a stream it creates).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import parse_qs, urlparse

import msgspec

from aisp.errors import ConfigError
from aisp.ingest.base import Source
from aisp.ingest.jsonl import JsonlFileSource
from aisp.sinks.base import Sink
from aisp.sinks.deadletter import DeadLetterSink
from aisp.sinks.files import JsonlFileSink, NullSink


class Pipeline(Protocol):
    """What a connector needs of a pipeline (``aisp.Pipeline`` has it): its name, the schema its
    input decodes to, and the columns its output writes."""

    @property
    def name(self) -> str: ...
    @property
    def input_schema(self) -> type[msgspec.Struct] | None: ...
    @property
    def output_columns(self) -> list[str] | None: ...


__all__ = ["alert_to", "dead_letter_sink", "sink_from_url", "source_for"]


def _file_path(url: str) -> str | None:
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return parsed.path if parsed.scheme == "file" else url
    if len(parsed.scheme) == 1:  # a Windows drive letter
        return url
    return None


def _options(url: str, allowed: dict[str, type]) -> dict[str, object]:
    """The query options of ``url``, typed; an unknown one is an error naming the known ones."""
    out: dict[str, object] = {}
    for key, values in parse_qs(urlparse(url).query, strict_parsing=False).items():
        if key not in allowed:
            raise ConfigError(f"{url!r}: unknown option {key!r}; options are {sorted(allowed)}")
        try:
            out[key] = allowed[key](values[-1])
        except ValueError:
            raise ConfigError(
                f"{url!r}: option {key}={values[-1]!r} is not a {allowed[key].__name__}"
            ) from None
    return out


def _redis_address(url: str) -> tuple[str, int, str]:
    parsed = urlparse(url)
    stream = parsed.path.lstrip("/")
    if not stream:
        raise ConfigError(f"{url!r}: name the stream, as redis://HOST:PORT/STREAM")
    return parsed.hostname or "127.0.0.1", parsed.port or 6379, stream


def _kafka_address(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    topic = parsed.path.lstrip("/")
    if not topic:
        raise ConfigError(f"{url!r}: name the topic, as kafka://HOST:PORT/TOPIC")
    return f"{parsed.hostname or '127.0.0.1'}:{parsed.port or 9092}", topic


def _nats_address(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    stream = parsed.path.lstrip("/")
    if not stream:
        raise ConfigError(f"{url!r}: name the stream, as nats://HOST:PORT/STREAM")
    return f"nats://{parsed.hostname or '127.0.0.1'}:{parsed.port or 4222}", stream


def source_for(pipeline: Pipeline, url: str) -> Source:
    """A source for ``url`` that decodes the pipeline's declared input schema."""
    schema = pipeline.input_schema
    if schema is None:
        raise ConfigError(f"pipeline {pipeline.name!r} declares no input schema; pass schema= to source()")
    if urlparse(url).scheme == "redis":
        from aisp.ingest.redis_streams import RedisStreamSource

        host, port, stream = _redis_address(url)
        opts = _options(
            url,
            {
                "group": str,
                "consumer": str,
                "field": str,
                "claim_idle_ms": int,
                "idle_stop_s": float,
                "retry_s": float,
            },
        )
        idle: Any = opts.pop("idle_stop_s", None)
        return RedisStreamSource(
            stream=stream,
            schema=schema,
            host=host,
            port=port,
            stop_when_idle_s=idle,
            **opts,  # type: ignore[arg-type]
        )
    if urlparse(url).scheme == "kafka":
        from aisp.ingest.kafka import KafkaSource

        bootstrap, topic = _kafka_address(url)
        opts = _options(url, {"group": str, "idle_stop_s": float, "retry_s": float})
        idle = opts.pop("idle_stop_s", None)
        return KafkaSource(topic=topic, schema=schema, bootstrap=bootstrap, stop_when_idle_s=idle, **opts)  # type: ignore[arg-type]
    if urlparse(url).scheme == "nats":
        from aisp.ingest.nats_jetstream import JetStreamSource

        servers, stream = _nats_address(url)
        opts = _options(url, {"durable": str, "subject": str, "idle_stop_s": float, "retry_s": float})
        idle = opts.pop("idle_stop_s", None)
        return JetStreamSource(stream=stream, schema=schema, servers=servers, stop_when_idle_s=idle, **opts)  # type: ignore[arg-type]
    path = _file_path(url)
    if path is None:
        raise ConfigError(
            f"unsupported input URL {url!r}; supported: a file path, file://PATH, redis://…, nats://…, kafka://…"
        )
    return JsonlFileSource(path=path, schema=schema)


def sink_from_url(url: str, pipeline: Pipeline) -> Sink:
    """A sink for ``url`` writing the pipeline's declared output columns."""
    if url in ("null:", "null://"):
        return NullSink()
    if urlparse(url).scheme == "redis":
        from aisp.sinks.redis_streams import RedisStreamSink

        host, port, stream = _redis_address(url)
        opts = _options(url, {"field": str, "dedupe_ttl_s": int, "retry_s": float})
        return RedisStreamSink(stream=stream, host=host, port=port, columns=pipeline.output_columns, **opts)  # type: ignore[arg-type]
    if urlparse(url).scheme == "kafka":
        from aisp.sinks.kafka import KafkaSink

        bootstrap, topic = _kafka_address(url)
        opts = _options(url, {"partitions": int, "retry_s": float, "transactional_id": str})
        return KafkaSink(topic=topic, bootstrap=bootstrap, columns=pipeline.output_columns, **opts)  # type: ignore[arg-type]
    if urlparse(url).scheme == "nats":
        from aisp.sinks.nats_jetstream import JetStreamSink

        servers, stream = _nats_address(url)
        opts = _options(url, {"subject": str, "duplicate_window_s": float, "retry_s": float})
        return JetStreamSink(stream=stream, servers=servers, columns=pipeline.output_columns, **opts)  # type: ignore[arg-type]
    path = _file_path(url)
    if path is None:
        raise ConfigError(
            f"unsupported output URL {url!r}; supported: a file path, file://PATH,"
            " redis://…, nats://…, kafka://…, null:"
        )
    return JsonlFileSink(path=path, columns=pipeline.output_columns)


def dead_letter_sink(url: str | None) -> DeadLetterSink:
    """Where ``--dead-letter`` sends dead letters: a file path, or ``redis://HOST:PORT/STREAM`` /
    ``nats://HOST:PORT/STREAM`` (each record once, by its idempotency key)."""
    if url is None:
        return DeadLetterSink()
    scheme = urlparse(url).scheme
    stream: Any
    if scheme == "redis":
        from aisp.sinks.redis_streams import RedisStreamSink

        host, port, name = _redis_address(url)
        field: Any = _options(url, {"field": str}).get("field", "data")
        stream = RedisStreamSink(stream=name, host=host, port=port, field=field)
        return DeadLetterSink(stream=stream)
    if scheme == "nats":
        from aisp.sinks.nats_jetstream import JetStreamSink

        servers, name = _nats_address(url)
        subject: Any = _options(url, {"subject": str}).get("subject")
        return DeadLetterSink(stream=JetStreamSink(stream=name, servers=servers, subject=subject))
    path = _file_path(url)
    if path is None:
        raise ConfigError(f"unsupported dead-letter URL {url!r}; supported: a file path, redis://…, nats://…")
    return DeadLetterSink(path=path)


def alert_to(url: str) -> Callable[[dict[str, Any]], None]:
    """An alert function that adds each alert (a JSON object) to a ``redis://`` or ``nats://``
    stream, once per (stage, feature, window)."""
    stream = dead_letter_sink(url).stream
    if stream is None:
        raise ConfigError(f"alerts go to redis://… or nats://… streams, got {url!r}")
    writer = stream.open()
    lock = threading.Lock()

    def send(alert: dict[str, Any]) -> None:
        key = f"alert:{alert.get('stage')}:{alert.get('feature')}:{alert.get('window')}"
        with lock:
            writer.write_lines([key], [msgspec.json.encode(alert)])

    return send
