from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from aisp.ingest.decode import ColumnarDecoder


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


DECODER_PROCESS_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.unit.test_decode import Ev, LINES
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
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-c", DECODER_PROCESS_CHECK, str(root)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
        timeout=60,
    )
    assert res.stdout.strip() == "ok", res.stderr
