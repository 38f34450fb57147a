"""One registry of connectors by URL scheme, and what the rest of AISP resolves through it.

The built-in schemes load on first use (a run that reads a file imports no broker client):
``file`` (also a plain path, and ``null:``), ``kafka``, ``nats``, ``redis`` (``rediss``: with
TLS). ``register`` adds a scheme, or replaces one.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from aisp.connectors.base import Connector, Pipeline
from aisp.connectors.url import mask, scheme_of
from aisp.errors import ConfigError
from aisp.ingest.base import Source
from aisp.sinks.base import Sink
from aisp.sinks.deadletter import DeadLetterSink

__all__ = [
    "alert_to",
    "connector_for",
    "dead_letter_sink",
    "register",
    "schemes",
    "sink_for",
    "source_for",
]

_BUILTIN = {
    "file": "aisp.connectors.file",
    "null": "aisp.connectors.file",
    "kafka": "aisp.connectors.kafka",
    "nats": "aisp.connectors.nats",
    "redis": "aisp.connectors.redis",
    "rediss": "aisp.connectors.redis",  # redis with TLS
}
_LOADED: dict[str, Connector] = {}
_LOCK = threading.Lock()


def register(scheme: str, connector: Connector) -> None:
    """Resolve ``scheme://`` URLs with ``connector``."""
    with _LOCK:
        _LOADED[scheme] = connector


def schemes() -> list[str]:
    """The schemes a URL can have."""
    return sorted({*_BUILTIN, *_LOADED})


def connector_for(url: str) -> Connector:
    """The connector of ``url``'s scheme; an unknown scheme is an error naming the known ones."""
    scheme = scheme_of(url)
    with _LOCK:
        if scheme not in _LOADED and scheme in _BUILTIN:
            _LOADED[scheme] = importlib.import_module(_BUILTIN[scheme]).CONNECTOR
        connector = _LOADED.get(scheme)
    if connector is None:
        known = ", ".join(f"{s}://…" for s in schemes() if s not in ("file", "null"))
        raise ConfigError(
            f"unsupported URL {mask(url)!r}; supported: a file path, file://PATH, {known}, null:"
        )
    return connector


def source_for(pipeline: Pipeline, url: str) -> Source:
    """A source for ``url`` that decodes the pipeline's declared input schema."""
    schema: type[msgspec.Struct] | None = pipeline.input_schema
    if schema is None:
        raise ConfigError(f"pipeline {pipeline.name!r} declares no input schema; pass schema= to source()")
    return connector_for(url).source(url, schema)


def sink_for(pipeline: Pipeline, url: str) -> Sink:
    """A sink for ``url`` writing the pipeline's declared output columns."""
    return connector_for(url).sink(url, pipeline.output_columns)


def dead_letter_sink(url: str | None) -> DeadLetterSink:
    """Where ``--dead-letter`` sends dead letters: a file path, or a broker stream that stores
    each record once, by its idempotency key (``redis://HOST:PORT/STREAM``,
    ``nats://HOST:PORT/STREAM``). None: dead letters are only counted."""
    if url is None:
        return DeadLetterSink()
    return connector_for(url).dead_letter_sink(url)


def alert_to(url: str) -> Callable[[dict[str, Any]], None]:
    """An alert function that adds each alert (a JSON object) to the stream ``url``, once per
    (stage, feature or alert type, window); connected now, so an unreachable target fails here."""
    writer: Any = connector_for(url).record_sink(url).open()  # has write_lines (record_sink)
    lock = threading.Lock()

    def send(alert: dict[str, Any]) -> None:
        key = f"alert:{alert.get('stage')}:{alert.get('feature', alert.get('type'))}:{alert.get('window')}"
        with lock:
            writer.write_lines([key], [msgspec.json.encode(alert)])

    return send
