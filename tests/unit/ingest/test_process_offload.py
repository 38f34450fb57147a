from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from aisp.batch import Batch
from aisp.connectors.file import JsonlFileSink, JsonlFileSource
from aisp.errors import SinkError, SourceError
from aisp.ingest import SourceContext
from aisp.ingest.process import ProcessSource
from aisp.sinks.process import ProcessSink


class Ev(msgspec.Struct):
    id: int
    x: float


def drain(source: Any, batch_rows: int = 3) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Any]:
    dead: list[dict[str, Any]] = []
    part = source.open(SourceContext("src", dead.extend, batch_rows))
    rows: list[dict[str, Any]] = []
    try:
        while (b := part.next_batch(batch_rows)) is not None:
            rows.extend(b.select(["id", "x", "_id"]).record_batch.to_pylist())
        pos = part.snapshot()
    finally:
        part.close()
    return rows, dead, pos


def test_process_source_equals_in_thread_source(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": i, "x": i / 2}) for i in range(10)]
    lines[4] = "{broken"
    path.write_text("\n".join(lines) + "\n")
    inner = JsonlFileSource(path=str(path), schema=Ev)
    assert drain(ProcessSource(inner=inner)) == drain(inner)
    rows, dead, pos = drain(ProcessSource(inner=inner))
    assert [r["id"] for r in rows] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert dead[0]["line"] == 5 and dead[0]["raw"] == "{broken"
    assert pos == {"offset": path.stat().st_size, "line": 10}


def test_process_source_reports_child_failure(tmp_path: Path) -> None:
    src = ProcessSource(inner=JsonlFileSource(path=str(tmp_path / "missing.jsonl"), schema=Ev))
    with pytest.raises(SourceError, match="cannot open input"):
        drain(src)


def test_process_sink_writes_and_acknowledges(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    part = ProcessSink(inner=JsonlFileSink(path=str(out), columns=["a"])).open()
    seen: list[tuple[list[int], int]] = []
    part.on_written = lambda ingest, ns: seen.append((ingest.tolist(), ns))
    for k in range(3):
        part.write(Batch.from_columns({"a": np.arange(k * 2, k * 2 + 2)}, ingest_ns=np.array([k, k])))
    part.flush()
    part.close()
    assert [json.loads(x)["a"] for x in out.read_text().splitlines()] == [0, 1, 2, 3, 4, 5]
    assert [ing for ing, _ in seen] == [[0, 0], [1, 1], [2, 2]]
    assert all(ns > 0 for _, ns in seen)


def test_process_sink_failure_is_raised(tmp_path: Path) -> None:
    part = ProcessSink(inner=JsonlFileSink(path=str(tmp_path / "no" / "dir.jsonl"))).open()
    with pytest.raises(SinkError, match="cannot open output"):
        part.write(Batch.from_columns({"a": [1]}, ingest_ns=0))
        part.close()
