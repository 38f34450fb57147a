"""A JSON-lines file read in a fresh child interpreter (``SpawnedJsonlSource``) gives the same
batches, dead letters and positions as the file source read in the pipeline's process; the plain
schema rebuilt there decodes and refuses the same JSON as the user's struct."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aisp.connectors.file import JsonlFileSource
from aisp.connectors.file.spawned import SpawnedJsonlSource
from aisp.errors import SourceError
from aisp.ingest import SourceContext
from aisp.ingest.plain import BatchSizer, PlainSchema
from benchmarks.workload import load_fraud_example
from tests.support.hostile import HOSTILE_LINES, ODD_VALID_LINES, event_line, hostile_chunks, mixed_lines

FRAUD_EVENT = load_fraud_example().Event


class Rules(msgspec.Struct, rename="camel", forbid_unknown_fields=True):
    user_id: Annotated[int, msgspec.Meta(ge=0, lt=1000)]
    score: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
    name: Annotated[str, msgspec.Meta(min_length=1, pattern="^[a-z]+$")]
    ok: bool
    xs: Annotated[list[int], msgspec.Meta(max_length=3)]


def drain(source: Any, batch_rows: int) -> tuple[list[pa.RecordBatch], list[dict[str, Any]], list[Any]]:
    dead: list[dict[str, Any]] = []
    part = source.open(SourceContext("src", dead.extend, batch_rows))
    batches, positions = [], []
    try:
        while (b := part.next_batch(batch_rows)) is not None:
            batches.append(b.record_batch.drop_columns(["_ingest_ns"]))
            positions.append(part.snapshot())
    finally:
        part.close()
    return batches, dead, positions


def both(path: Path, schema: type[msgspec.Struct], batch_rows: int = 7, **kw: Any) -> tuple[Any, Any]:
    inner = JsonlFileSource(path=str(path), schema=schema, **kw)
    spawned = inner.spawned()
    assert isinstance(spawned, SpawnedJsonlSource)
    return drain(replace(spawned, catch_up=1), batch_rows), drain(inner, batch_rows)


def test_a_file_with_hostile_lines_reads_alike_in_the_child(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [*mixed_lines(300, bad_every=4), *HOSTILE_LINES.values(), *ODD_VALID_LINES.values()]
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines))  # a BOM, no newline at the end
    child, here = both(path, FRAUD_EVENT, batch_rows=64, read_block_bytes=4096, max_line_bytes=50_000)
    assert child == here
    batches, dead, positions = child
    assert sum(b.num_rows for b in batches) + len(dead) == len(lines)
    assert any("longer than max_line_bytes" in d["reason"] for d in dead)
    assert positions[-1]["line"] == len(lines)
    assert batches[0].schema.field("f").type == pa.list_(pa.float64(), 16)


def test_a_resumed_and_a_bounded_read_match_too(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(event_line(i) for i in range(100)) + b"\n")
    _, _, positions = drain(JsonlFileSource(path=str(path), schema=FRAUD_EVENT), 10)
    start, end = positions[2], positions[6]
    for position in (start, {**start, "end": end["offset"]}):
        inner = JsonlFileSource(path=str(path), schema=FRAUD_EVENT)
        child, here = [], []
        for source, out in ((replace(inner.spawned(), catch_up=1), child), (inner, here)):  # type: ignore[type-var]
            part = source.open(SourceContext("src", lambda r: None, 10), position)  # type: ignore[union-attr]
            while (b := part.next_batch(10)) is not None:
                out.append(b.ids.tolist())
            part.close()
        assert child == here and child[0][0] == 31
    assert child[-1][-1] == 70  # "end": the lines before that offset only


def test_plain_schemas_rules_and_types(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [
        b'{"userId":1,"score":0.5,"name":"ab","ok":true,"xs":[1,2]}',
        b'{"userId":1000,"score":0.5,"name":"ab","ok":true,"xs":[]}',
        b'{"userId":2,"score":1.5,"name":"ab","ok":false,"xs":[1]}',
        b'{"userId":3,"score":1,"name":"A","ok":true,"xs":[1]}',
        b'{"userId":4,"score":0,"name":"ab","ok":true,"xs":[1,2,3,4]}',
        b'{"userId":5,"score":0,"name":"ab","ok":true,"xs":[1],"extra":1}',
        b'{"user_id":6,"score":0,"name":"ab","ok":true,"xs":[1]}',
        b'{"userId":7,"score":0,"name":"ab","ok":false,"xs":[' + str(2**64).encode() + b"]}",
        b'{"userId":8,"score":0.25,"name":"zz","ok":false,"xs":[9]}',
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    child, here = both(path, Rules, batch_rows=4)
    assert child == here
    batches, dead, _ = child
    assert [b.column("user_id").to_pylist() for b in batches] == [[1], [], [8]]
    assert [d["line"] for d in dead] == [2, 3, 4, 5, 6, 7, 8]
    assert "out of range" in dead[-1]["reason"]


class Nested(msgspec.Struct):
    a: int


@pytest.mark.parametrize(
    "fields",
    [
        [("a", int | None)],
        [("a", int, 0)],
        [("a", Nested)],
        [("a", list[str])],
        [("a", dict[str, int])],
        [("a", Any)],
    ],
)
def test_other_schemas_are_read_in_a_fork_instead(fields: list[Any]) -> None:
    schema = msgspec.defstruct("S", fields)
    assert PlainSchema.describe(schema) is None
    assert JsonlFileSource(path="x", schema=schema).spawned() is None


@given(
    st.lists(st.binary(max_size=80) | st.sampled_from([*HOSTILE_LINES.values(), event_line(1)]), max_size=30)
)
def test_the_rebuilt_struct_decodes_and_refuses_alike(lines: list[bytes]) -> None:
    for schema in (FRAUD_EVENT, Rules):
        plain = PlainSchema.describe(schema)
        assert plain is not None
        ours = msgspec.json.Decoder(plain.struct())
        theirs = msgspec.json.Decoder(schema)
        for line in lines:
            try:
                want: Any = msgspec.structs.asdict(theirs.decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                want = str(exc)
            try:
                got: Any = msgspec.structs.asdict(ours.decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                got = str(exc)
            assert got == want


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_chunks())
def test_fuzzed_files_read_alike_in_the_child(lines: list[bytes]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        child, here = both(path, FRAUD_EVENT, batch_rows=5)
        assert child == here


def test_a_missing_file_and_a_dead_child_are_source_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot open input"):
        drain(JsonlFileSource(path=str(tmp_path / "nope.jsonl"), schema=FRAUD_EVENT).spawned(), 10)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(event_line(i) for i in range(20_000)) + b"\n")
    source = JsonlFileSource(path=str(path), schema=FRAUD_EVENT).spawned()
    assert source is not None
    part = source.open(SourceContext("src", lambda r: None, 100))
    try:
        assert part.next_batch(100) is not None
        os.kill(part._proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        with pytest.raises(SourceError, match="died"):
            while part.next_batch(100) is not None:
                pass
    finally:
        part.close()


def test_batches_grow_while_the_reader_falls_behind_and_shrink_back(tmp_path: Path) -> None:
    rx, tx = os.pipe()
    try:
        sizer = BatchSizer(tx, 10, 40)
        assert sizer.next() == 10
        for _ in range(3):  # each batch still unread when the next is due: the reader fell behind
            os.write(tx, bytes(100))
            sizer.sent(100)
        assert [sizer.next(), sizer.next(), sizer.next()] == [20, 40, 40]
        os.read(rx, 50)  # part of the last batch is unread yet: no change
        assert sizer.next() == 40
        os.read(rx, 1000)  # the reader waits
        assert [sizer.next(), sizer.next(), sizer.next()] == [20, 10, 10]
    finally:
        os.close(rx)
        os.close(tx)
    with (tmp_path / "f").open("wb") as fh:  # not a pipe: a fixed size
        sizer = BatchSizer(fh.fileno(), 10, 40)
        sizer.sent(100)
        assert sizer.next() == 10


def test_a_reader_that_falls_behind_gets_the_same_rows_in_larger_batches(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(mixed_lines(3000, bad_every=7)) + b"\n")
    inner = JsonlFileSource(path=str(path), schema=FRAUD_EVENT)
    dead: list[dict[str, Any]] = []
    part = inner.spawned().open(SourceContext("src", dead.extend, 50))  # type: ignore[union-attr]
    sizes, ids = [], []
    try:
        while (b := part.next_batch(50)) is not None:
            time.sleep(0.002)  # a slow pipeline: the child's batches wait unread
            sizes.append(b.num_rows)
            ids.extend(b.ids.tolist())
        end = part.snapshot()
    finally:
        part.close()
    batches, here_dead, positions = drain(inner, 50)
    assert ids == [i for b in batches for i in b.column("_id").to_pylist()]
    assert dead == here_dead and end == positions[-1]
    assert max(sizes) > 50 * 2  # it grew (at most 4x the lines: some of them dead letters)
