"""The key hash that places keys on workers, the file's blocks, and batches as bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from aisp.batch import Batch
from aisp.connectors.file.blocks import FileBlocks
from aisp.schedule.workers.exchange import batch_from_bytes, batch_to_bytes, key_hash, key_owner

M = (1 << 64) - 1
P = 0x100000001B3


def reference_hash(data: bytes) -> int:
    """The same hash, one key at a time, in plain Python."""
    h = 0
    for i, b in enumerate(data):
        h = (h + b * pow(P, i, 1 << 64)) & M
    h = (h + len(data) * 0x9E3779B97F4A7C15) & M
    return finalise(h)


def finalise(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & M
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & M
    return h ^ (h >> 33)


@given(st.lists(st.text(max_size=30), min_size=1, max_size=40), st.integers(0, 10))
def test_a_string_hashes_the_same_wherever_it_sits(keys: list[str], cut: int) -> None:
    arr = pa.array(keys)
    expected = [reference_hash(k.encode()) for k in keys]
    assert key_hash(arr).tolist() == expected
    cut = min(cut, len(keys))
    assert key_hash(arr.slice(cut)).tolist() == expected[cut:]  # an offset into shared buffers
    assert key_hash(arr.cast(pa.large_string())).tolist() == expected
    assert key_hash(pa.chunked_array([arr[:cut], arr[cut:]])).tolist() == expected


@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=40))
def test_integers_hash_their_value(keys: list[int]) -> None:
    assert key_hash(pa.array(keys, pa.int64())).tolist() == [finalise(k & M) for k in keys]


def test_other_types_hash_their_text_and_nulls_hash_as_empty() -> None:
    assert key_hash(pa.array([1.5, 2.0])).tolist() == [reference_hash(b"1.5"), reference_hash(b"2")]
    assert key_hash(pa.array(["a", None])).tolist() == [reference_hash(b"a"), reference_hash(b"")]


def test_owners_are_spread_and_in_range() -> None:
    keys = pa.array([f"u{i}" for i in range(10_000)])
    owners = key_owner(keys, 3)
    counts = np.bincount(owners, minlength=3)
    assert owners.min() >= 0 and owners.max() <= 2
    assert counts.min() > 3000, counts


def file_lines(path: Path) -> int:
    """Lines as the file source counts them: every line, a last one without a newline too."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


@settings(max_examples=60, deadline=None)
# a first line that opens with a BOM's bytes
@example(lines=[b"\xef\xbb\xbf"], newline_at_end=False, bom=False, block_bytes=1)
@given(
    st.lists(st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"")), max_size=60),
    st.booleans(),
    st.booleans(),
    st.integers(1, 300),
)
def test_blocks_cover_the_file_in_whole_lines(
    tmp_path_factory: pytest.TempPathFactory,
    lines: list[bytes],
    newline_at_end: bool,
    bom: bool,
    block_bytes: int,
) -> None:
    path = tmp_path_factory.mktemp("blocks") / "f.jsonl"
    data = (
        (b"\xef\xbb\xbf" if bom else b"") + b"\n".join(lines) + (b"\n" if newline_at_end and lines else b"")
    )
    path.write_bytes(data)
    blocks = FileBlocks(str(path), block_bytes=block_bytes, read_bytes=7)
    found = []
    while (b := blocks.next()) is not None:
        found.append(b)
    blocks.close()
    skip = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # a first line may begin with a BOM's bytes
    pos, line = skip, 0
    for b in found:
        assert (b.offset, b.line) == (pos, line)
        assert b.end > b.offset
        assert b.end == len(data) or data[b.end - 1 : b.end] == b"\n"  # ends at a line end
        assert data[b.offset : b.end].count(b"\n") <= b.lines
        pos, line = b.end, line + b.lines
    assert pos == max(len(data), skip)
    assert line == file_lines(path)


def test_blocks_resume_from_a_position(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"a\nbb\nccc\ndddd\n")
    blocks = FileBlocks(str(path), offset=5, line=2, block_bytes=1)
    first = blocks.next()
    blocks.close()
    assert first is not None and (first.offset, first.end, first.line, first.lines) == (5, 9, 2, 1)


def test_a_batch_survives_the_pipe() -> None:
    b = Batch.from_columns({"x": np.arange(5), "s": pa.array(["a", "b", None, "d", "e"])}, ingest_ns=7)
    back = batch_from_bytes(memoryview(b"xx" + batch_to_bytes(b.slice(1, 3)))[2:])
    assert back.record_batch.equals(b.slice(1, 3).record_batch)
