"""``file://PATH`` (or a plain path): JSON lines; ``null:``: an output that only counts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from aisp.connectors.base import DEFAULT_SHAPE, Connector, ScenarioShape
from aisp.connectors.file.sink import JsonlFileSink
from aisp.connectors.file.source import JsonlFileSource
from aisp.connectors.url import file_path, scheme_of
from aisp.ingest.base import Source
from aisp.sinks.base import Sink
from aisp.sinks.deadletter import DeadLetterSink
from aisp.sinks.memory import NullSink

__all__ = ["FileConnector"]


class FileConnector(Connector):
    """JSON-lines files: a source, a sink, dead letters in a file, files for scenarios."""

    scheme = "file"

    def source(self, url: str, schema: type[msgspec.Struct]) -> Source:
        if scheme_of(url) == "null":
            raise self._cannot("as an input")
        return JsonlFileSource(path=file_path(url), schema=schema)

    def sink(self, url: str, columns: Sequence[str] | None) -> Sink:
        if scheme_of(url) == "null":
            return NullSink()
        return JsonlFileSink(path=file_path(url), columns=columns)

    def dead_letter_sink(self, url: str) -> DeadLetterSink:
        if scheme_of(url) == "null":
            return DeadLetterSink()
        return DeadLetterSink(path=file_path(url))

    def scenario_urls(self, address: str, tag: str, shape: ScenarioShape = DEFAULT_SHAPE) -> tuple[str, str]:
        self._one_partition(shape)
        return str(Path(address) / f"in-{tag}.jsonl"), str(Path(address) / f"out-{tag}.jsonl")

    def fill(self, url: str, lines: Sequence[bytes], shape: ScenarioShape = DEFAULT_SHAPE) -> None:
        self._one_partition(shape)
        Path(file_path(url)).write_bytes(b"".join(x + b"\n" for x in lines))

    def read(self, url: str) -> list[bytes]:
        return Path(file_path(url)).read_bytes().splitlines()

    def drop(self, url: str) -> None:
        Path(file_path(url)).unlink(missing_ok=True)
