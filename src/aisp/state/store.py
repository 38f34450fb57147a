"""Keyed state on disk: a versioned LMDB store behind a narrow interface.

The hot layer stays in memory (``KeyedState``'s numpy columns, so the hot path never touches the
disk); at each checkpoint only the keys whose state changed since the previous one are written,
as one LMDB transaction under the checkpoint's id (its *version*): checkpoints cost what changed,
not the whole state. Every value is stored under ``name + version``, so the state of any kept
checkpoint can be read back (``read(version)``: the newest value of each key at or before it) —
which is what lets a restore fall back to an older checkpoint when the newest is corrupt. A write
also drops the written keys' values that no kept checkpoint can read any more.

A checkpoint hands the changed rows over as Arrow (``write_rows``); with ``writer_process``
a forked child builds and writes the entries, off the pipeline's GIL.

LMDB was chosen over RocksDB (``rocksdict``) by measurement (``benchmarks/bench_state_store.py``):
writing 100k 16-byte rows per version costs the same (70-73 ms, mostly building the entries),
reading 300k back for a restore takes 42-43 ms vs 73 ms, and LMDB runs no background compaction
threads beside the pipeline's (BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import struct
import threading
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from aisp.errors import StateError

__all__ = ["LmdbStateStore", "decode_keys", "decode_rows", "encode_names", "encode_rows"]

log = logging.getLogger("aisp.state")
_VERSION = struct.Struct(">Q")
_SIZE = struct.Struct("<I")


def _open(path: str | Path, map_size: int) -> Any:
    import lmdb

    return lmdb.open(str(path), map_size=map_size, sync=True, metasync=True)


def _put(env: Any, version: int, names: Sequence[bytes], values: Sequence[bytes]) -> None:
    suffix = _VERSION.pack(version)
    with env.begin(write=True) as txn:
        txn.cursor().putmulti([(n + suffix, v) for n, v in zip(names, values, strict=True)])


def _drop_superseded(env: Any, names: Sequence[bytes], before: int) -> None:
    """Drop each name's values that its newest value at or before ``before`` (the oldest
    checkpoint still kept) supersedes: no kept checkpoint reads them. Done for the names a write
    just wrote, the store holds about one value per name and kept checkpoint without a scan of
    the whole store."""
    if before <= 0:
        return
    with env.begin(write=True) as txn:
        cursor = txn.cursor()
        for name in names:
            old: list[bytes] = []  # this name's keys at or before ``before``, oldest first
            if cursor.set_range(name):
                for key in cursor.iternext(values=False):
                    if not key.startswith(name) or _VERSION.unpack(key[-_VERSION.size :])[0] > before:
                        break
                    if len(key) == len(name) + _VERSION.size:
                        old.append(key)
            for key in old[:-1]:
                txn.delete(key)


def _put_rows(env: Any, version: int, parts: dict[str, pa.RecordBatch]) -> list[bytes]:
    """``write_rows``'s work: each part's rows (a ``key`` column and state columns) as entries;
    returns the names written."""
    names: list[bytes] = []
    values: list[bytes] = []
    for prefix, rb in parts.items():
        columns = {c: rb.column(c).to_numpy(zero_copy_only=False) for c in rb.schema.names if c != "key"}
        n, v, _ = encode_rows(prefix.encode(), rb.column("key").to_pylist(), columns)
        names += n
        values += v
    _put(env, version, names, values)
    return names


def _writer_main(path: str, map_size: int, conn: Connection, parent_end: Connection) -> None:
    """The state writer process: versions in (Arrow IPC), entries into LMDB, ``OK`` back."""
    from aisp.ipc import report_error, worker_init

    worker_init(parent_end)
    env = _open(path, map_size)
    try:
        while True:
            message = conn.recv_bytes()
            try:
                version, before, parts = _decode_parts(message)
                names = _put_rows(env, version, parts)
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
                report_error(conn, exc)
                continue
            conn.send_bytes(b"OK")
            _drop_superseded(env, names, before)  # after the reply: off the checkpoint's path
    except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
        return  # the parent closed the pipe: done
    finally:
        env.close()
        conn.close()


def _encode_parts(version: int, before: int, parts: dict[str, pa.RecordBatch]) -> bytes:
    blobs = []
    for prefix, rb in parts.items():
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, rb.schema) as writer:
            writer.write_batch(rb)
        blobs.append((prefix, sink.getvalue().to_pybytes()))
    header = msgspec.json.encode([version, before, [[prefix, len(blob)] for prefix, blob in blobs]])
    return _SIZE.pack(len(header)) + header + b"".join(blob for _, blob in blobs)


def _decode_parts(message: bytes) -> tuple[int, int, dict[str, pa.RecordBatch]]:
    (size,) = _SIZE.unpack_from(message)
    version, before, layout = msgspec.json.decode(message[_SIZE.size : _SIZE.size + size])
    at, parts = _SIZE.size + size, {}
    for prefix, length in layout:
        parts[prefix] = pa.ipc.open_stream(pa.py_buffer(message[at : at + length])).read_next_batch()
        at += length
    return int(version), int(before), parts


class LmdbStateStore:
    """Versioned key-value state in an LMDB environment at ``path`` (a directory).

    With ``writer_process`` the entries of ``write_rows`` are built and written by a forked
    child (Arrow IPC in, nothing pickled): a checkpoint that touched every key of a big state
    costs the pipeline a serialisation instead of a Python loop per key under its GIL. It must
    be created while the process runs no other thread (else writes stay in-process, with a
    warning); reads, pruning and discarding use the parent's own environment (LMDB serialises
    writers across processes).
    """

    def __init__(self, path: str | Path, *, map_size: int = 1 << 36, writer_process: bool = False) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self._conn: Connection | None = None
        self._proc: Any = None
        if writer_process and threading.active_count() > 1:
            log.warning("state store %s writes in-process: %d threads run, forking is unsafe", path,
                        threading.active_count())  # fmt: skip
        elif writer_process:
            ctx = mp.get_context("fork")
            self._conn, child = ctx.Pipe(duplex=True)
            self._proc = ctx.Process(
                target=_writer_main,
                args=(str(path), map_size, child, self._conn),
                name="aisp-state",
                daemon=True,
            )
            self._proc.start()  # before the parent opens its environment: the child opens its own
            child.close()
        self._env: Any = _open(path, map_size)

    def write(self, version: int, names: Sequence[bytes], values: Sequence[bytes], before: int = 0) -> None:
        """Store ``values`` under ``names`` at ``version``, atomically and durably; ``before``:
        the oldest version still needed (older values of these names are dropped, see
        ``_drop_superseded``)."""
        _put(self._env, version, names, values)
        _drop_superseded(self._env, names, before)

    def write_rows(
        self, version: int, parts: dict[str, tuple[pa.Array, dict[str, Any]]], before: int = 0
    ) -> dict[str, Any]:
        """Store each part's rows (by prefix: the keys and their state columns) at ``version``,
        atomically and durably, as ``encode_rows`` entries (dropping what ``before`` makes
        superseded, as ``write``); returns each part's row layout (for ``decode_rows``)."""
        batches = {
            prefix: pa.RecordBatch.from_arrays(
                [keys, *map(pa.array, columns.values())], names=["key", *columns]
            )
            for prefix, (keys, columns) in parts.items()
        }
        if self._conn is None:
            _drop_superseded(self._env, _put_rows(self._env, version, batches), before)
        else:
            self._conn.send_bytes(_encode_parts(version, before, batches))
            reply = self._conn.recv_bytes()
            if reply != b"OK":
                raise StateError(f"state writer failed: {reply[1:].decode(errors='replace')}")
        return {prefix: [[name, np.asarray(col).dtype.str] for name, col in columns.items()]
                for prefix, (_, columns) in parts.items()}  # fmt: skip

    def read(self, version: int, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """(name, value) for every name under ``prefix``: its newest value at or before ``version``."""
        with self._env.begin() as txn:
            cursor = txn.cursor()
            if not cursor.set_range(prefix):
                return
            last_name, last_value = None, None
            for key, value in cursor:
                if not key.startswith(prefix):
                    break
                name, (ver,) = key[:-8], _VERSION.unpack(key[-8:])
                if name != last_name:
                    if last_name is not None and last_value is not None:
                        yield last_name, last_value
                    last_name, last_value = name, None
                if ver <= version:
                    last_value = value
            if last_name is not None and last_value is not None:
                yield last_name, last_value

    def latest(self, names: Sequence[bytes]) -> list[bytes | None]:
        """The newest value of each name (None: never written), read in one transaction: what
        a bounded hot layer reads back for a key it evicted (values after the newest complete
        checkpoint cannot be there for such a key: it was not seen since it was written)."""
        out: list[bytes | None] = []
        with self._env.begin() as txn:
            cursor = txn.cursor()
            for name in names:
                value = None
                if cursor.set_range(name):  # a name's versions follow it, oldest first
                    for key, v in cursor:
                        if not key.startswith(name):
                            break
                        if len(key) == len(name) + _VERSION.size:
                            value = v
                out.append(value)
        return out

    def delete_range(self, start: bytes, end: bytes) -> int:
        """Delete every value of the names from ``start`` up to (not including) ``end``;
        returns how many."""
        dropped = 0
        with self._env.begin(write=True) as txn:
            cursor = txn.cursor()
            if cursor.set_range(start):
                while cursor.key() < end and cursor.delete():  # delete moves to the next key
                    dropped += 1
        return dropped

    def discard_after(self, version: int) -> int:
        """Delete every value written after ``version`` (an abandoned timeline: the run restarted
        from ``version``, or from nothing with 0); returns how many."""
        dropped = 0
        with self._env.begin(write=True) as txn:
            for key in list(txn.cursor().iternext(values=False)):
                if _VERSION.unpack(key[-8:])[0] > version:
                    txn.delete(key)
                    dropped += 1
        return dropped

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()  # the writer sees EOF and exits
            self._proc.join(timeout=10)
            self._conn = None
        self._env.close()


def encode_rows(
    prefix: bytes, keys: Sequence[Any], columns: dict[str, Any]
) -> tuple[list[bytes], list[bytes], list[list[str]]]:
    """Store names (``prefix`` + the msgpack of each key) and value bytes (one packed row of
    ``columns`` each), and the row dtype to decode them with."""
    dtype = np.dtype([(name, col.dtype) for name, col in columns.items()])
    rows = np.empty(len(keys), dtype=dtype)
    for name, col in columns.items():
        rows[name] = col
    blob, size = rows.tobytes(), dtype.itemsize
    values = [blob[i * size : (i + 1) * size] for i in range(len(keys))]
    return encode_names(prefix, keys), values, [[name, dtype[name].str] for name in dtype.names or ()]


def encode_names(prefix: bytes, keys: Sequence[Any]) -> list[bytes]:
    """The store names of ``keys`` under ``prefix`` (``decode_keys`` reverses it)."""
    encode = msgspec.msgpack.encode
    return [prefix + encode(k) for k in keys]


def decode_rows(
    prefix: bytes, entries: Sequence[tuple[bytes, bytes]], descr: Sequence[Sequence[str]]
) -> tuple[list[Any], dict[str, Any]]:
    """The keys and columns of ``entries`` written by ``encode_rows``."""
    dtype = np.dtype([(str(name), str(code)) for name, code in descr])
    keys = decode_keys(prefix, [name for name, _ in entries])
    rows = np.frombuffer(b"".join(v for _, v in entries), dtype=dtype)
    return keys, {name: rows[name].copy() for name in dtype.names or ()}


def decode_keys(prefix: bytes, names: Sequence[bytes]) -> list[Any]:
    """The keys of store names written by ``encode_rows``."""
    decode = msgspec.msgpack.decode
    return [decode(name[len(prefix) :]) for name in names]
