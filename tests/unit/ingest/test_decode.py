from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings

from aisp.ingest.decode import ColumnarDecoder, Decoded
from benchmarks.workload import load_fraud_example, parse_valid
from tests.support.hostile import HOSTILE_LINES, ODD_VALID_LINES, event_line, hostile_chunks

FRAUD_EVENT = load_fraud_example().Event


class Ev(msgspec.Struct):
    id: int
    user: str
    amount: float
    f: Annotated[list[float], msgspec.Meta(min_length=3, max_length=3)]


LINES = [
    b'{"id":1,"user":"a","amount":2,"f":[1,2,3]}',
    b'{"id":2,"user":"oops","amount":"x","f":[1,2,3]}',
    b'{"id":3,"user":"c","amount":0.5,"f":[4,5,6]}',
]


def test_fast_path_builds_typed_columns() -> None:
    lines = [b'{"id":1,"user":"a","amount":2,"f":[1,2,3]}', b'{"id":2,"user":"b","amount":0.5,"f":[4,5,6]}']
    d = ColumnarDecoder(Ev).decode(lines)
    assert d.kept is None and not d.errors
    assert d.columns["id"].to_pylist() == [1, 2]
    assert d.columns["amount"].to_numpy().dtype == np.float64
    assert d.columns["f"].flatten().to_pylist() == [1, 2, 3, 4, 5, 6]


def test_each_bad_line_is_pinned_with_reason() -> None:
    lines = [
        b'{"id":1,"user":"a","amount":2,"f":[1,2,3]}',
        b"not json",
        b'{"id":2,"user":"b","f":[1,2,3]}',
        b'{"id":3,"user":"c","amount":"x","f":[1,2,3]}',
        b'{"id":4,"user":"d","amount":1,"f":[1,2]}',
        b'{"id":5,"user":"e","amount":1e999,"f":[1,2,3]}',
        b'{"id":true,"user":"e","amount":1,"f":[1,2,3]}',
        b"",
        b'{"id":8,"user":"h","amount":1,"f":[1,2,3]}',
    ]
    d = ColumnarDecoder(Ev).decode(lines)
    assert d.kept is not None and d.kept.tolist() == [0, 8]
    reasons = {e.index: e.reason for e in d.errors}
    assert sorted(reasons) == [1, 2, 3, 4, 5, 6, 7]
    assert "malformed" in reasons[1]
    assert "missing required field `amount`" in reasons[2]
    assert "Expected `float`, got `str`" in reasons[3]
    assert "length >= 3" in reasons[4]
    assert "out of range" in reasons[5]
    assert "got `bool`" in reasons[6]
    assert reasons[7] == "empty line"
    assert d.columns["id"].to_pylist() == [1, 8]


def test_ints_are_accepted_as_floats() -> None:
    class F(msgspec.Struct):
        x: float

    d = ColumnarDecoder(F).decode([b'{"x": 1.5}', b'{"x": 2}'])
    assert d.columns["x"].to_pylist() == [1.5, 2.0]


def _accounted(d: Decoded, n: int) -> list[int]:
    """The kept line indices, after checking that rows and errors account for every line once."""
    kept = list(range(n)) if d.kept is None else d.kept.tolist()
    assert sorted([*kept, *(e.index for e in d.errors)]) == list(range(n))
    assert all(len(col) == len(kept) for col in d.columns.values())
    return kept


def test_seed_corpus_is_what_it_says() -> None:
    assert all(parse_valid(line) is None for line in HOSTILE_LINES.values())
    assert all(parse_valid(line) is not None for line in ODD_VALID_LINES.values())


@pytest.mark.parametrize("kind", sorted(HOSTILE_LINES))
@pytest.mark.parametrize("where", ["alone", "first", "middle", "last"])
def test_each_hostile_line_is_one_error_and_the_rest_decode(kind: str, where: str) -> None:
    good = [event_line(i) for i in range(5)]
    lines = {"alone": [], "first": [], "middle": good[:2], "last": good}[where]
    lines = [*lines, HOSTILE_LINES[kind]]
    if where in ("first", "middle"):
        lines += good[2:] if where == "middle" else good
    d = ColumnarDecoder(FRAUD_EVENT).decode(lines)
    kept = _accounted(d, len(lines))
    bad = lines.index(HOSTILE_LINES[kind])
    assert [e.index for e in d.errors] == [bad] and d.errors[0].reason
    assert kept == [i for i in range(len(lines)) if i != bad]


@settings(max_examples=300, deadline=None)
@given(hostile_chunks())
def test_decoder_keeps_exactly_the_valid_lines(lines: list[bytes]) -> None:
    d = ColumnarDecoder(FRAUD_EVENT).decode(lines)
    kept = _accounted(d, len(lines))
    expected = [parse_valid(line) for line in lines]
    assert kept == [i for i, ev in enumerate(expected) if ev is not None]
    events = [ev for ev in expected if ev is not None]
    assert d.columns["id"].to_pylist() == [ev["id"] for ev in events]
    assert d.columns["user"].to_pylist() == [ev["user"] for ev in events]
    assert d.columns["amount"].to_pylist() == [float(ev["amount"]) for ev in events]
    assert d.columns["f"].to_pylist() == [[float(x) for x in ev["f"]] for ev in events]


def test_a_value_that_does_not_fit_its_column_is_an_error_on_its_line() -> None:
    class G(msgspec.Struct):
        id: int
        name: str

    lines = [b'{"id":1,"name":"a"}', b'{"id":1180591620717411303424,"name":"b"}', b'{"id":3,"name":"c"}']
    d = ColumnarDecoder(G).decode(lines)
    assert _accounted(d, 3) == [0, 2]
    assert d.columns["id"].to_pylist() == [1, 3]
    assert "`id`" in d.errors[0].reason and "out of range" in d.errors[0].reason


class Inner(msgspec.Struct):
    a: int
    b: list[str] = []


class Mixed(msgspec.Struct):
    opt: float | None
    tags: list[str]
    inner: Inner
    counts: dict[str, int]
    anything: Any
    either: int | str


def test_column_types_come_from_the_schema_not_the_values() -> None:
    lines = [
        b'{"opt":null,"tags":[],"inner":{"a":1},"counts":{},"anything":[1,"x"],"either":1}',
        b'{"opt":2,"tags":["t"],"inner":{"a":2,"b":["q"]},"counts":{"k":3},"anything":{"z":null},'
        b'"either":"s"}',
    ]
    d = ColumnarDecoder(Mixed).decode(lines)
    assert d.kept is None and not d.errors
    assert d.columns["opt"].to_pylist() == [None, 2.0]
    assert d.columns["tags"].to_pylist() == [[], ["t"]]
    assert d.columns["inner"].to_pylist() == [{"a": 1, "b": []}, {"a": 2, "b": ["q"]}]
    assert d.columns["counts"].to_pylist() == [[], [("k", 3)]]
    assert d.columns["anything"].to_pylist() == ['[1,"x"]', '{"z":null}']  # JSON text
    assert d.columns["either"].to_pylist() == ["1", '"s"']
    empty = ColumnarDecoder(Mixed).decode([b"{}"])  # no rows: the same column types
    assert {k: v.type for k, v in empty.columns.items()} == {k: v.type for k, v in d.columns.items()}


def run_script(script: str) -> None:
    """Run ``script`` in a fresh interpreter (a decoder process must be forked before any
    thread starts) and check that it printed ok."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    res = subprocess.run(
        [sys.executable, "-c", script, str(root)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
        timeout=60,
    )
    assert res.stdout.strip() == "ok", res.stderr


DECODER_PROCESS_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.unit.ingest.test_decode import Ev, LINES
from aisp.ingest.decode import ColumnarDecoder
from aisp.ingest.decoder_process import DecoderProcess

proc = DecoderProcess(Ev, min_lines=1)  # forked before any other thread, as the rule wants
try:
    for lines in (LINES, [l for l in LINES if b"oops" not in l], []):
        got, want = proc.decode(lines), ColumnarDecoder(Ev).decode(lines)
        assert {k: v.to_pylist() for k, v in got.columns.items()} == {
            k: v.to_pylist() for k, v in want.columns.items()
        }, lines
        same_kept = got.kept is None or list(got.kept) == list(want.kept)
        assert (got.kept is None) == (want.kept is None) and same_kept
        assert got.errors == want.errors
    assert proc.blocks_in_child == 2 and proc.blocks_here == 1  # the empty block stays here
    proc.min_lines = 10_000  # small blocks: decoded in the caller's thread, the same
    assert proc.decode(LINES).errors == ColumnarDecoder(Ev).decode(LINES).errors
    assert proc.blocks_in_child == 2 and proc.blocks_here == 2
finally:
    proc.close()
print("ok")
"""


def test_decoder_process_answers_like_the_in_process_decoder() -> None:
    run_script(DECODER_PROCESS_CHECK)


DECODER_RESTART_CHECK = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from tests.unit.ingest.test_decode import Ev, LINES
from tests.support.hostile import HOSTILE_LINES
from aisp.ingest.decode import ColumnarDecoder
from aisp.ingest.decoder_process import DecoderDied, DecoderProcess

proc = DecoderProcess(Ev, min_lines=1, block_timeout_s=2)
try:
    hostile = list(HOSTILE_LINES.values()) * 3  # the child survives every kind of bad line
    assert proc.decode(hostile).errors == ColumnarDecoder(Ev).decode(hostile).errors
    first = proc._pid
    os.kill(first, signal.SIGKILL)  # the child dies: this block fails clearly ...
    try:
        proc.decode(LINES)
        raise AssertionError("a dead child answered")
    except DecoderDied as exc:
        assert exc.retriable and exc.http_status == 503 and "restarted" in str(exc)
    assert proc.decode(LINES).errors == ColumnarDecoder(Ev).decode(LINES).errors  # ... a new one serves
    assert proc._pid != first and proc.restarts == 1
    os.kill(proc._pid, signal.SIGSTOP)  # a hung child is killed after block_timeout_s
    try:
        proc.decode(LINES)
        raise AssertionError("a hung child answered")
    except DecoderDied as exc:
        assert "took over 2 s" in str(exc)
    assert proc.decode(LINES).errors == ColumnarDecoder(Ev).decode(LINES).errors
    assert proc.restarts == 2 and proc.blocks_here == 0
finally:
    proc.close()
print("ok")
"""


def test_decoder_process_is_restarted_when_its_child_dies_or_hangs() -> None:
    run_script(DECODER_RESTART_CHECK)


class Blob(msgspec.Struct):
    id: str
    data: bytes


def test_bytes_fields_decode_from_base64_into_a_binary_column() -> None:
    d = ColumnarDecoder(Blob).decode([b'{"id": "a", "data": "AAEC"}', b'{"id": "b", "data": "not base64!"}'])
    assert d.columns["data"].type == pa.binary()
    assert d.columns["data"].to_pylist() == [b"\x00\x01\x02"] and d.kept.tolist() == [0]
    assert "base64" in d.errors[0].reason
