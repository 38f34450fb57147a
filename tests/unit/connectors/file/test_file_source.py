from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from aisp.connectors.file import JsonlFileSource
from aisp.errors import SourceError
from aisp.ingest import SourceContext, WorkloadFSource


def drain(source: object, rows: int) -> list[dict[str, object]]:
    part = source.open(SourceContext("s", lambda r: None, rows))  # type: ignore[attr-defined]
    out: list[dict[str, object]] = []
    while (b := part.next_batch(rows)) is not None:
        out.extend(b.record_batch.to_pylist())
    part.close()
    return out


def test_workload_f_is_deterministic_whatever_the_batch_size() -> None:
    a = drain(WorkloadFSource(events=5000, seed=3), 512)
    b = drain(WorkloadFSource(events=5000, seed=3), 77)
    assert [r["id"] for r in a] == list(range(5000))
    for x, y in zip(a, b, strict=True):
        assert {k: v for k, v in x.items() if k != "_ingest_ns"} == {
            k: v for k, v in y.items() if k != "_ingest_ns"
        }
    assert a[0] != drain(WorkloadFSource(events=1, seed=4), 1)[0]
    users = {r["user"] for r in a}
    assert all(isinstance(u, str) and u.startswith("u") for u in users)
    assert all(len(r["f"]) == 16 for r in a)  # type: ignore[arg-type]


def test_workload_f_resumes_from_snapshot() -> None:
    src = WorkloadFSource(events=1000, seed=1)
    part = src.open(SourceContext("s", lambda r: None, 300))
    first = part.next_batch(300)
    assert first is not None
    rest = src.open(SourceContext("s", lambda r: None, 300), resume_from=part.snapshot())
    b = rest.next_batch(10)
    assert b is not None and b.numpy("id").tolist() == list(range(300, 310))


class Ev(msgspec.Struct):
    id: int


def test_jsonl_reads_in_small_blocks_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(f'{{"id": {i}}}\n' for i in range(100)) + '{"id": 100}')  # no final newline
    src = JsonlFileSource(path=str(path), schema=Ev, read_block_bytes=7)
    rows = drain(src, 9)
    assert [r["id"] for r in rows] == list(range(101))
    assert [r["_id"] for r in rows] == list(range(1, 102))  # engine ids are line numbers
    part = src.open(SourceContext("s", lambda r: None, 40))
    part.next_batch(40)
    pos = part.snapshot()
    part.close()
    resumed = src.open(SourceContext("s", lambda r: None, 40), resume_from=pos)
    b = resumed.next_batch(5)
    assert b is not None and b.numpy("id").tolist() == [40, 41, 42, 43, 44]
    resumed.close()


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot open input"):
        JsonlFileSource(path=str(tmp_path / "nope.jsonl"), schema=Ev).open(SourceContext("s", print, 1))


def test_dead_letters_carry_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1}\n{"id": "x"}\n\n{"id": 4}\n')
    dead: list[dict[str, object]] = []
    part = JsonlFileSource(path=str(path), schema=Ev).open(SourceContext("src", dead.extend, 10))
    b = part.next_batch(10)
    part.close()
    assert b is not None and b.numpy("id").tolist() == [1, 4]
    assert [(d["line"], d["step"]) for d in dead] == [(2, "src"), (3, "src")]
    assert dead[1]["reason"] == "empty line" and np.all(b.numpy("_id") == [1, 4])


def _read_all(src: JsonlFileSource, rows: int) -> tuple[list[int], list[dict[str, object]], int]:
    """(ids read, dead letters, final offset), reading ``rows`` at a time and resuming from a
    snapshot after every batch (as a restart from a checkpoint would)."""
    dead: list[dict[str, object]] = []
    ids: list[int] = []
    pos = None
    while True:
        part = src.open(SourceContext("src", dead.extend, rows), resume_from=pos)
        b = part.next_batch(rows)
        pos = part.snapshot()
        part.close()
        if b is None:
            return ids, dead, int(pos["offset"]) if pos else 0
        ids += b.numpy("id").tolist()


@pytest.mark.parametrize("rows", [1, 3, 512])
def test_blank_and_whitespace_lines_anywhere_are_dead_letters(tmp_path: Path, rows: int) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\n  \n{"id": 3}\n\t\r\n{"id": 5}\n\n')  # ends in two newlines
    ids, dead, offset = _read_all(JsonlFileSource(path=str(path), schema=Ev), rows)
    assert ids == [3, 5]
    assert [(d["line"], d["reason"]) for d in dead] == [(n, "empty line") for n in (1, 2, 4, 6)]
    assert offset == path.stat().st_size


@pytest.mark.parametrize("block", [5, 64, 1 << 20])
def test_a_line_longer_than_the_limit_is_skipped_without_holding_it(tmp_path: Path, block: int) -> None:
    path = tmp_path / "in.jsonl"
    long_value = b'{"id": 2, "pad": "' + b"x" * 5000 + b'"}'  # valid JSON, but over the limit
    path.write_bytes(b'{"id": 1}\n' + long_value + b'\n{"id": 3}\n' + b"y" * 3000 + b'\n{"id": 5}')
    src = JsonlFileSource(path=str(path), schema=Ev, read_block_bytes=block, max_line_bytes=2000)
    for rows in (1, 2, 10):
        ids, dead, offset = _read_all(src, rows)
        assert ids == [1, 3, 5]
        assert [d["line"] for d in dead] == [2, 4]
        assert "longer than max_line_bytes (2000)" in str(dead[0]["reason"])
        assert f"line of {len(long_value)} bytes" in str(dead[0]["reason"])
        assert len(str(dead[1]["raw"])) <= 1024
        assert offset in (path.stat().st_size, path.stat().st_size + 1)  # no newline at the end


def test_a_byte_order_mark_at_the_start_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": 1}\n{"id": 2}\n')
    ids, dead, offset = _read_all(JsonlFileSource(path=str(path), schema=Ev), 1)
    assert ids == [1, 2] and not dead and offset == path.stat().st_size
