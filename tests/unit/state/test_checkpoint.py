"""Checkpoint store: atomic writes, verification, fallback past a corrupt checkpoint, pruning."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from aisp.state.checkpoint import CheckpointStore, CorruptCheckpoint
from aisp.state.keyed import KeyIndex


def table(n: int) -> pa.Table:
    return pa.table({"count": np.arange(n, dtype=np.int64), "sum": np.linspace(0, 1, n)})


def test_write_then_latest_round_trips(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.latest() is None and store.next_id() == 1
    store.write(1, {"op.stats": table(5)}, {"sources": {"events": {"offset": 10}}, "sinks": {}})
    store.write(2, {"op.stats": table(7)}, {"sources": {"events": {"offset": 20}}, "sinks": {}})
    latest = store.latest()
    assert latest is not None and latest.id == 2 and store.next_id() == 3
    assert latest.meta["sources"] == {"events": {"offset": 20}}
    assert latest.tables["op.stats"].equals(table(7))


def test_a_corrupt_or_partial_latest_checkpoint_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    for i in (1, 2, 3):
        store.write(i, {"op.stats": table(i)}, {"n": i})
    data = tmp_path / "chk-0000000003" / "op.stats.arrow"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="aisp.checkpoint"):
        latest = store.latest()
    assert latest is not None and latest.id == 2
    assert "chk-0000000003" in caplog.text and "SHA-256" in caplog.text
    with pytest.raises(CorruptCheckpoint):
        store.load(3)
    (tmp_path / "chk-0000000002" / "manifest.json").unlink()  # as if killed before the manifest
    latest = store.latest()
    assert latest is not None and latest.id == 1 and latest.meta == {"n": 1}


def test_only_the_newest_are_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for i in range(1, 6):
        store.write(i, {}, {})
    assert store.ids() == [4, 5]
    with pytest.raises(Exception, match="keep at least 2"):
        CheckpointStore(tmp_path, keep=1)


def test_key_index_restores_codes_in_order() -> None:
    idx = KeyIndex()
    idx.encode(pa.array(["u3", "u1", "u3", "u7"]))
    restored = KeyIndex()
    restored.restore(pa.array(idx.keys()))
    assert restored.encode(pa.array(["u7", "u1", "u3", "u9"])).tolist() == [2, 1, 0, 3]
    with pytest.raises(ValueError, match="empty key index"):
        restored.restore(pa.array(["x"]))


def test_state_store_reads_each_key_as_of_a_version(tmp_path: Path) -> None:
    from aisp.state.store import LmdbStateStore, decode_rows, encode_rows

    store = LmdbStateStore(tmp_path / "state")
    try:
        names, values, descr = encode_rows(
            b"op\x1f", ["u1", "u2"], {"n": np.array([1, 1]), "s": np.array([0.5, 2.0])}
        )
        store.write(1, names, values)
        names, values, _ = encode_rows(b"op\x1f", ["u1"], {"n": np.array([2]), "s": np.array([1.5])})
        store.write(2, names, values)
        names, values, _ = encode_rows(b"op\x1f", ["u3"], {"n": np.array([1]), "s": np.array([9.0])})
        store.write(3, names, values)
        names, values, _ = encode_rows(b"op\x1f", ["u2"], {"n": np.array([2]), "s": np.array([3.0])})
        store.write(4, names, values, before=1)  # kept checkpoints start at 1: u2's 1 stays

        def state(version: int) -> dict[str, tuple[int, float]]:
            keys, cols = decode_rows(b"op\x1f", list(store.read(version, b"op\x1f")), descr)
            return {k: (int(n), float(s)) for k, n, s in zip(keys, cols["n"], cols["s"], strict=True)}

        assert state(1) == {"u1": (1, 0.5), "u2": (1, 2.0)}
        assert state(2) == {"u1": (2, 1.5), "u2": (1, 2.0)}
        assert state(3) == {"u1": (2, 1.5), "u2": (1, 2.0), "u3": (1, 9.0)}
        assert state(4) == {"u1": (2, 1.5), "u2": (2, 3.0), "u3": (1, 9.0)}
        names, values, _ = encode_rows(b"op\x1f", ["u1"], {"n": np.array([3]), "s": np.array([4.0])})
        store.write(5, names, values, before=3)  # u1's 1 is superseded by its 2, which 3 still reads
        assert state(1) == {"u2": (1, 2.0)} and state(3)["u1"] == (2, 1.5)
        assert store.discard_after(3) == 2  # a restart from checkpoint 3 abandons versions 4 and 5
        assert state(9) == {"u1": (2, 1.5), "u2": (1, 2.0), "u3": (1, 9.0)}
    finally:
        store.close()


WRITE_ROWS = """
import json, sys
import numpy as np, pyarrow as pa
from aisp.state.store import LmdbStateStore, decode_rows
store = LmdbStateStore(sys.argv[1], writer_process=sys.argv[2] == "1")
forked = store._proc is not None
first = {"n": np.array([1, 1]), "s": np.array([0.5, 2.0])}
layout = store.write_rows(1, {"op\\x1f": (pa.array(["u1", "u2"]), first)})
store.write_rows(2, {"op\\x1f": (pa.array(["u2"]), {"n": np.array([2]), "s": np.array([3.0])})})
keys, cols = decode_rows(b"op\\x1f", list(store.read(2, b"op\\x1f")), layout["op\\x1f"])
store.close()
print(json.dumps({"forked": forked, "layout": layout, "exit": None if not forked else store._proc.exitcode,
                  "state": dict(zip(keys, zip(cols["n"].tolist(), cols["s"].tolist())))}))
"""


@pytest.mark.parametrize("writer_process", [False, True], ids=["in-process", "writer-process"])
def test_state_store_writes_rows_in_a_writer_process_the_same(tmp_path: Path, writer_process: bool) -> None:
    # a fresh interpreter: forking the writer needs a process with no other thread
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", WRITE_ROWS, str(tmp_path / "state"), "1" if writer_process else "0"],
        env={**os.environ, "PYTHONPATH": str(root / "src")},
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(done.stdout)
    assert result["forked"] == writer_process
    assert result["layout"] == {"op\x1f": [["n", "<i8"], ["s", "<f8"]]}
    assert result["state"] == {"u1": [1, 0.5], "u2": [2, 3.0]}
    if writer_process:
        assert result["exit"] is not None  # the writer is gone with the store


def test_a_checkpoint_directory_is_claimed_by_one_process_until_it_ends(tmp_path: Path) -> None:
    from aisp.errors import AispError

    code = (
        "import sys, time; from aisp.state.checkpoint import CheckpointStore;"
        " CheckpointStore(sys.argv[1]).lock(); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(AispError, match=f"in use by another process \\(pid {holder.pid}\\)"):
            CheckpointStore(tmp_path).lock()
    finally:
        holder.kill()  # SIGKILL: the lock goes with the process
        holder.communicate()
    store = CheckpointStore(tmp_path)
    store.lock()
    with pytest.raises(AispError, match="in use"):  # nor twice in one process
        CheckpointStore(tmp_path).lock()
    store.unlock()
    store.lock()
    store.unlock()
