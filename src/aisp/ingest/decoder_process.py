"""JSON-lines decoding in a forked worker process, for callers that receive lines themselves.

``ProcessSource`` moves a whole source (reading and decoding) to a child. A server receives the
lines on its own sockets instead; ``DecoderProcess`` takes blocks of lines from it and answers
each with the decoded columns (``ColumnarDecoder``), so the GIL-bound parsing runs on another
core. Lines go to the child as raw bytes; columns come back as one Arrow IPC record batch (the
``_kept`` column holds the line indices it came from) and errors as JSON: nothing is pickled.

The decoder never raises on input, and the child answers a block it could not decode with an
error instead of dying. Should the child die all the same (killed, out of memory, a crash in
native code) or take longer than ``block_timeout_s`` on one block, that block fails with
``DecoderDied`` (retriable: HTTP 503, gRPC UNAVAILABLE) and the next block gets a new child.
New children are forked by a small spawner process, itself forked at construction, which must
happen while the caller's process runs no other thread (the same rule as ``ProcessSource``): so
the multi-threaded server never forks. ``decode`` is thread-safe: the child takes one block at a
time; small blocks, and blocks that would wait for it, are decoded in the caller's thread.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from aisp.errors import ConfigError, SourceError, Unavailable
from aisp.ingest.decode import ColumnarDecoder, Decoded, DecodeError
from aisp.ipc import worker_init

__all__ = ["DecoderDied", "DecoderProcess"]

log = logging.getLogger("aisp.ingest")

_HEADER = struct.Struct("<I")
_PID = struct.Struct("<q")
_KEPT = "_kept"


class DecoderDied(SourceError, Unavailable):
    """The decoder process died (or hung) on a block; the block's request may be retried."""


def _child_main(schema: type[msgspec.Struct], conn: Connection) -> None:
    """The decoder: blocks of lines in, ``K`` + errors + Arrow IPC out (``X`` + a message if a
    block could not be decoded: a bug, reported rather than fatal)."""
    decoder = ColumnarDecoder(schema)
    encode = msgspec.json.Encoder().encode
    try:
        while True:
            block = conn.recv_bytes()
            try:
                reply = _decode_block(decoder, encode, block)
            except Exception as exc:  # noqa: BLE001 - the child outlives one bad block
                reply = b"X" + f"{type(exc).__name__}: {exc}".encode()
            conn.send_bytes(reply)
    except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
        return  # the parent closed the pipe: done
    finally:
        conn.close()


def _decode_block(decoder: ColumnarDecoder, encode: Callable[[Any], bytes], block: bytes) -> bytes:
    lines = block.split(b"\n") if block else []
    decoded = decoder.decode(lines)
    kept = np.arange(len(lines), dtype=np.int64) if decoded.kept is None else decoded.kept
    rb = pa.RecordBatch.from_arrays(
        [*decoded.columns.values(), pa.array(kept)], names=[*decoded.columns, _KEPT]
    )
    errors = encode([[e.index, e.reason] for e in decoded.errors])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rb.schema) as writer:
        writer.write_batch(rb)
    payload: bytes = sink.getvalue().to_pybytes()
    return b"K" + _HEADER.pack(len(errors)) + errors + payload


def _spawner_main(schema: type[msgspec.Struct], ctl: Connection, parent_end: Connection) -> None:
    """Fork a decoder child for each request on ``ctl``; send back its pid and pipe end."""
    worker_init(parent_end)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    parent = os.getppid()
    ctx = mp.get_context("fork")
    try:
        while ctl.recv_bytes():
            mine, theirs = ctx.Pipe(duplex=True)
            pid = os.fork()
            if pid == 0:  # the decoder child
                code = 0
                try:
                    worker_init(ctl, mine)
                    _child_main(schema, theirs)
                except BaseException:  # noqa: BLE001 - a forked child must never return
                    code = 1
                finally:
                    os._exit(code)
            theirs.close()
            ctl.send_bytes(_PID.pack(pid))
            send_handle(ctl, mine.fileno(), parent)
            mine.close()
    except (EOFError, OSError):
        return  # the parent is gone or closed us
    finally:
        ctl.close()


class DecoderProcess:
    """A forked child decoding JSON lines into the columns of ``schema`` (see module docstring)."""

    def __init__(
        self, schema: type[msgspec.Struct], *, min_lines: int = 256, block_timeout_s: float = 30.0
    ) -> None:
        if threading.active_count() > 1:
            raise ConfigError(
                "DecoderProcess must be started before any other thread (fork safety); "
                f"{threading.active_count()} threads are running"
            )
        ctx = mp.get_context("fork")
        self._ctl, spawner_end = ctx.Pipe(duplex=True)
        self._spawner = ctx.Process(
            target=_spawner_main, args=(schema, spawner_end, self._ctl), name="aisp-decoder", daemon=True
        )
        self._spawner.start()
        spawner_end.close()
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._pid = 0
        self._errors = msgspec.json.Decoder(list[tuple[int, str]])
        self._schema = schema
        self._local = threading.local()
        self.min_lines = min_lines
        self.block_timeout_s = block_timeout_s
        self.blocks_in_child = 0
        self.blocks_here = 0
        self.restarts = 0
        self._spawn()  # the first child, at once

    def _here(self, lines: list[bytes]) -> Decoded:
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            decoder = self._local.decoder = ColumnarDecoder(self._schema)
        self.blocks_here += 1
        return decoder.decode(lines)

    def _spawn(self) -> Connection | None:
        """A new decoder child from the spawner (under the lock); None if the spawner is gone."""
        try:
            self._ctl.send_bytes(b"spawn")
            (self._pid,) = _PID.unpack(self._ctl.recv_bytes())
            self._conn = Connection(recv_handle(self._ctl))
        except (EOFError, OSError):
            log.warning("the decoder spawner is gone: request lines are decoded in-process")
            self._conn = None
        return self._conn

    def _drop_child(self, *, kill: bool) -> None:
        """Forget the child (a new one is spawned for the next block); ``kill`` a hung one."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if kill:  # it is alive (it hangs), so its pid is still its own
            with contextlib.suppress(OSError):
                os.kill(self._pid, signal.SIGKILL)
        self.restarts += 1

    def decode(self, lines: list[bytes]) -> Decoded:
        """Decode ``lines`` (without newlines), in the child when that pays: a block of fewer
        than ``min_lines`` lines costs less to decode here than the round trip, and while the
        child is busy with another caller's block this one is decoded here instead of waiting
        behind it. Same result as ``ColumnarDecoder`` either way; ``DecoderDied`` if the child
        dies on this block."""
        if len(lines) < self.min_lines or not self._lock.acquire(blocking=False):
            return self._here(lines)
        try:
            conn = self._conn or self._spawn()
            if conn is None:
                return self._here(lines)
            self.blocks_in_child += 1
            msg = self._round_trip(conn, b"\n".join(lines))
        finally:
            self._lock.release()
        if msg[:1] == b"X":
            raise SourceError(f"the decoder process failed on a block: {msg[1:].decode(errors='replace')}")
        (n,) = _HEADER.unpack_from(msg, 1)
        errors = [DecodeError(i, reason) for i, reason in self._errors.decode(msg[5 : 5 + n])]
        rb = pa.ipc.open_stream(pa.py_buffer(msg)[5 + n :]).read_next_batch()
        columns = {name: rb.column(i) for i, name in enumerate(rb.schema.names) if name != _KEPT}
        kept = None if not errors else rb.column(_KEPT).to_numpy()
        return Decoded(columns, kept, errors)

    def _round_trip(self, conn: Connection, block: bytes) -> bytes:
        try:
            conn.send_bytes(block)
            if not conn.poll(self.block_timeout_s):
                self._drop_child(kill=True)
                raise DecoderDied(
                    f"the decoder process took over {self.block_timeout_s:g} s on a block and was"
                    " restarted; retry"
                )
            return conn.recv_bytes()
        except (EOFError, OSError) as exc:
            self._drop_child(kill=False)
            raise DecoderDied(
                "the decoder process died while decoding this block and was restarted; retry"
            ) from exc

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        self._ctl.close()
        self._spawner.join(timeout=5)
        if self._spawner.is_alive():
            self._spawner.kill()
            self._spawner.join()
