"""Connectors addressed by URL, as the command line names them (``--input``, ``--output``).

Today: plain paths and ``file://`` URLs (JSON lines), and ``null:`` for a counting sink.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlparse

from aisp.errors import ConfigError
from aisp.ingest.base import Source
from aisp.ingest.jsonl import JsonlFileSource
from aisp.sinks.base import Sink
from aisp.sinks.files import JsonlFileSink, NullSink

if TYPE_CHECKING:
    from aisp.pipeline import Pipeline

__all__ = ["sink_from_url", "source_for"]


def _file_path(url: str) -> str | None:
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return parsed.path if parsed.scheme == "file" else url
    if len(parsed.scheme) == 1:  # a Windows drive letter
        return url
    return None


def source_for(pipeline: Pipeline, url: str) -> Source:
    """A source for ``url`` that decodes the pipeline's declared input schema."""
    schema = pipeline.input_schema
    if schema is None:
        raise ConfigError(f"pipeline {pipeline.name!r} declares no input schema; pass schema= to source()")
    path = _file_path(url)
    if path is None:
        raise ConfigError(f"unsupported input URL {url!r}; supported: a file path or file://PATH")
    return JsonlFileSource(path=path, schema=schema)


def sink_from_url(url: str, pipeline: Pipeline) -> Sink:
    """A sink for ``url`` writing the pipeline's declared output columns."""
    if url in ("null:", "null://"):
        return NullSink()
    path = _file_path(url)
    if path is None:
        raise ConfigError(f"unsupported output URL {url!r}; supported: a file path, file://PATH or null:")
    return JsonlFileSink(path=path, columns=pipeline.output_columns)
