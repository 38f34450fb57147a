"""JSON-lines decoding in a forked worker process, for callers that receive lines themselves.

``ProcessSource`` moves a whole source (reading and decoding) to a child. A server receives the
lines on its own sockets instead; ``DecoderProcess`` takes blocks of lines from it and answers
each with the decoded columns (``ColumnarDecoder``), so the GIL-bound parsing runs on another
core. Lines go to the child as raw bytes; columns come back as one Arrow IPC record batch (the
``_kept`` column holds the line indices it came from) and errors as JSON: nothing is pickled.

The child is forked at construction, which must happen while the caller's process runs no other
thread (the same rule as ``ProcessSource``). ``decode`` is thread-safe: the child takes one block
at a time; small blocks, and blocks that would wait for it, are decoded in the caller's thread.
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import threading
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import pyarrow as pa

from aisp.errors import ConfigError, SourceError
from aisp.ingest.decode import ColumnarDecoder, Decoded, DecodeError
from aisp.ipc import worker_init

__all__ = ["DecoderProcess"]

_HEADER = struct.Struct("<I")
_KEPT = "_kept"


def _child_main(schema: type[msgspec.Struct], conn: Connection, parent_end: Connection) -> None:
    worker_init(parent_end)  # else the parent closing its end would never reach us as EOF
    decoder = ColumnarDecoder(schema)
    encode = msgspec.json.Encoder().encode
    try:
        while True:
            block = conn.recv_bytes()
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
            conn.send_bytes(_HEADER.pack(len(errors)) + errors + sink.getvalue().to_pybytes())
    except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
        return  # the parent closed the pipe: done
    finally:
        conn.close()


class DecoderProcess:
    """A forked child decoding JSON lines into the columns of ``schema`` (see module docstring)."""

    def __init__(self, schema: type[msgspec.Struct], *, min_lines: int = 256) -> None:
        if threading.active_count() > 1:
            raise ConfigError(
                "DecoderProcess must be started before any other thread (fork safety); "
                f"{threading.active_count()} threads are running"
            )
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_child_main, args=(schema, child, self._conn), name="aisp-decoder", daemon=True
        )
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._errors = msgspec.json.Decoder(list[tuple[int, str]])
        self._schema = schema
        self._local = threading.local()
        self.min_lines = min_lines
        self.blocks_in_child = 0
        self.blocks_here = 0

    def _here(self, lines: list[bytes]) -> Decoded:
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:
            decoder = self._local.decoder = ColumnarDecoder(self._schema)
        self.blocks_here += 1
        return decoder.decode(lines)

    def decode(self, lines: list[bytes]) -> Decoded:
        """Decode ``lines`` (without newlines), in the child when that pays: a block of fewer
        than ``min_lines`` lines costs less to decode here than the round trip, and while the
        child is busy with another caller's block this one is decoded here instead of waiting
        behind it. Same result as ``ColumnarDecoder`` either way."""
        if len(lines) < self.min_lines or not self._lock.acquire(blocking=False):
            return self._here(lines)
        try:
            self.blocks_in_child += 1
            self._conn.send_bytes(b"\n".join(lines))
            msg = self._conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise SourceError("the decoder process died") from exc
        finally:
            self._lock.release()
        (n,) = _HEADER.unpack_from(msg, 0)
        errors = [DecodeError(i, reason) for i, reason in self._errors.decode(msg[4 : 4 + n])]
        rb = pa.ipc.open_stream(pa.py_buffer(msg)[4 + n :]).read_next_batch()
        columns = {name: rb.column(i) for i, name in enumerate(rb.schema.names) if name != _KEPT}
        kept = None if not errors else rb.column(_KEPT).to_numpy()
        return Decoded(columns, kept, errors)

    def close(self) -> None:
        self._conn.close()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
