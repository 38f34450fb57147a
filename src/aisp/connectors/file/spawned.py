"""A JSON-lines file read and decoded in a fresh child interpreter that imports only msgspec.

``ProcessSource`` forks the pipeline's process to decode beside it; the fork starts with the
parent's page tables and touches its libraries, so it adds ~70 MB to the process tree's summed
RSS. For a schema of plain fields (``ingest/plain.py``) the child can be a new interpreter that
runs ``ingest/plain.py`` alone (about 20 MB) and sends each batch as raw column buffers, which
the parent wraps as Arrow arrays without copying. Lines, line numbers, positions and dead
letters are the same as ``JsonlFileSource`` read in the parent, since both use the same code.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import numpy as np
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import SourceError
from aisp.ingest import plain
from aisp.ingest.base import Source, SourceContext, SourcePartition
from aisp.ipc import set_pipe_size

__all__ = ["SpawnedJsonlSource"]

_LENGTH = struct.Struct("<I")
_BOOT = (
    "import importlib.util as u, sys\n"
    "s = u.spec_from_file_location('aisp_plain', sys.argv[1])\n"
    "m = u.module_from_spec(s); sys.modules['aisp_plain'] = m; s.loader.exec_module(m)\n"
    "m.child_main(sys.argv[2:])\n"
)
_NUMBERS = {"int": pa.int64(), "float": pa.float64()}


@dataclass(frozen=True, kw_only=True)
class SpawnedJsonlSource(Source):
    """Reads ``path`` like ``JsonlFileSource`` (same positions and dead letters) in a child
    interpreter; ``schema`` is the file source's, described by ``PlainSchema``."""

    path: str
    schema: plain.PlainSchema
    read_block_bytes: int
    max_line_bytes: int
    pipe_bytes: int = 1 << 20
    catch_up: int = 4
    """While the pipeline falls behind, batches grow up to this many times ``batch_rows``
    (``plain.BatchSizer``); 1: always ``batch_rows``."""

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return _SpawnedPartition(self, ctx, resume_from)

    def describe(self) -> str:
        return f"spawned(jsonl:{self.path})"


class _SpawnedPartition(SourcePartition):
    def __init__(self, cfg: SpawnedJsonlSource, ctx: SourceContext, resume_from: Any) -> None:
        if not Path(cfg.path).is_file():
            raise SourceError(f"cannot open input {cfg.path!r}: no such file")
        self._ctx, self._schema = ctx, cfg.schema
        self._position: Any = resume_from
        self._done = False
        config = {
            "path": cfg.path,
            "schema": cfg.schema.desc,
            "position": resume_from,
            "block_bytes": cfg.read_block_bytes,
            "max_line_bytes": cfg.max_line_bytes,
            "batch_rows": ctx.batch_rows,
            "max_batch_rows": cfg.catch_up * ctx.batch_rows,  # when the pipeline falls behind
            "step": ctx.step_id,
        }
        rx, tx = os.pipe()
        set_pipe_size(tx, cfg.pipe_bytes)
        try:
            argv = [sys.executable, "-I", "-c", _BOOT, plain.__file__, msgspec.json.encode(config).decode()]
            self._proc = subprocess.Popen([*argv, str(tx)], pass_fds=(tx,), stdin=subprocess.DEVNULL)
        finally:
            os.close(tx)
        self._rx = os.fdopen(rx, "rb")
        # ends the child and closes the pipe once: at close(), or when a partition nobody closed
        # is collected
        self._end = weakref.finalize(self, _end_child, self._proc, self._rx)

    def _message(self) -> bytes:
        head = self._rx.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            raise SourceError(f"source process of {self._ctx.step_id!r} died")
        (n,) = _LENGTH.unpack(head)
        msg = self._rx.read(n)
        if len(msg) < n:
            raise SourceError(f"source process of {self._ctx.step_id!r} died")
        return msg

    def next_batch(self, max_rows: int) -> Batch | None:
        while not self._done:
            msg = self._message()
            tag = msg[:1]
            if tag == b"B":
                return self._batch(msg)
            if tag == b"D":
                self._ctx.dead_letter(msgspec.json.decode(msg[1:]))
            elif tag == b"E":
                self._done = True
            else:
                self._done = True
                raise SourceError(f"source {self._ctx.step_id!r} failed: {msg[1:].decode()}")
        return None

    def _batch(self, msg: bytes) -> Batch:
        (hlen,) = _LENGTH.unpack_from(msg, 1)
        header = msgspec.json.decode(msg[5 : 5 + hlen])
        self._position = header["position"]
        buf = pa.py_buffer(msg)
        at = _aligned(5 + hlen)
        parts = []
        for size in header["sizes"]:
            parts.append(buf.slice(at, size))
            at = _aligned(at + size)
        n, first = header["rows"], header["first"]
        ids = np.frombuffer(parts[0], dtype=np.int64) if parts[0].size else np.arange(first, first + n)
        return Batch.from_columns(self._columns(n, parts[1:]), ids=ids, ingest_ns=header["ns"])

    def _columns(self, n: int, parts: list[pa.Buffer]) -> dict[str, pa.Array]:
        columns: dict[str, pa.Array] = {}
        i = 0
        for f in self._schema.fields:
            kind = f["kind"]
            if kind in _NUMBERS:
                columns[f["name"]] = pa.Array.from_buffers(_NUMBERS[kind], n, [None, parts[i]])
                i += 1
            elif kind == "bool":
                columns[f["name"]] = pa.array(np.frombuffer(parts[i], dtype=np.bool_))
                i += 1
            elif kind == "str":
                columns[f["name"]] = pa.StringArray.from_buffers(n, parts[i], parts[i + 1])
                i += 2
            else:
                columns[f["name"]] = _list_column(f, n, parts[i], parts[i + 1])
                i += 2
        return columns

    def snapshot(self) -> Any:
        return self._position

    def close(self) -> None:
        self._end()


def _end_child(proc: subprocess.Popen[bytes], rx: BinaryIO) -> None:
    rx.close()  # a child still writing gets a broken pipe and ends
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _aligned(at: int) -> int:
    return at + (-at % 8)


def _list_column(f: dict[str, Any], n: int, offsets: pa.Buffer, values: pa.Buffer) -> pa.Array:
    item = _NUMBERS[f["item"]["kind"]]
    flat = pa.Array.from_buffers(item, values.size // 8, [None, values])
    rules = f["rules"]
    width = rules.get("min_length")
    if width is not None and width == rules.get("max_length"):  # as ``ColumnarDecoder`` types it
        return pa.FixedSizeListArray.from_arrays(flat, width)
    return pa.Array.from_buffers(pa.list_(item), n, [None, offsets], children=[flat])
