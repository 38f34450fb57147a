"""Run a source's reading and decoding in a child process, so parsing uses the second core.

JSON decoding builds Python objects and so holds the GIL; in a thread it would compete with every
other stage. ``ProcessSource`` forks a child that opens the wrapped source and streams its batches
back as Arrow IPC messages over a pipe (no pickling: Arrow buffers, JSON for dead letters and
positions). The parent maps each message onto the received bytes without copying columns.

The child is forked when the source is opened, which the executor does before it starts any
thread, so the child never inherits a lock held by another thread. The pipe is enlarged to hold
several batches; when it is full the child blocks, which is the backpressure on the reader.

Messages (first byte is the tag): ``S`` an Arrow schema; ``B`` a JSON position header then a
record batch; ``D`` JSON dead-letter records; ``E`` end of input; ``X`` an error message.
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import SourceError
from aisp.ingest.base import DeadLetterRecord, Source, SourceContext, SourcePartition
from aisp.ipc import report_error, set_pipe_size, worker_init

__all__ = ["ProcessSource"]

_HEADER = struct.Struct("<I")


@dataclass(frozen=True, kw_only=True)
class ProcessSource(Source):
    """Wraps ``inner`` so that it reads and decodes in a forked child process.

    Args:
        inner: the source to run in the child.
        pipe_bytes: pipe capacity; about this much decoded data may be in flight.
    """

    inner: Source
    pipe_bytes: int = 1 << 20

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        if threading.active_count() > 1:
            raise SourceError(
                "ProcessSource must be opened before any other thread starts (fork safety); "
                f"{threading.active_count()} threads are running"
            )
        return _ParentPartition(self, ctx, resume_from)

    def describe(self) -> str:
        return f"process({self.inner.describe()})"


def _child_main(
    cfg: ProcessSource, ctx_step: str, batch_rows: int, resume_from: Any, conn: Connection, rx: Connection
) -> None:
    worker_init(rx)
    enc = msgspec.json.Encoder()

    def dead_letter(records: list[DeadLetterRecord]) -> None:
        conn.send_bytes(b"D" + enc.encode(records))

    part: SourcePartition | None = None
    schema: pa.Schema | None = None
    try:
        part = cfg.inner.open(SourceContext(ctx_step, dead_letter, batch_rows), resume_from)
        while (batch := part.next_batch(batch_rows)) is not None:
            rb = batch.record_batch
            if schema is None or not rb.schema.equals(schema):
                schema = rb.schema
                conn.send_bytes(b"S" + schema.serialize().to_pybytes())
            traced = list(batch.traceparents.items()) if batch.traceparents else None
            pos = enc.encode([part.snapshot(), traced])  # the position, the producers' traceparents
            conn.send_bytes(b"B" + _HEADER.pack(len(pos)) + pos + rb.serialize().to_pybytes())
        conn.send_bytes(b"E")
    except (BrokenPipeError, ConnectionResetError):
        return  # the parent stopped reading: a stop, not an error
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        report_error(conn, exc)
    finally:
        if part is not None:
            part.close()
        conn.close()


class _ParentPartition(SourcePartition):
    def __init__(self, cfg: ProcessSource, ctx: SourceContext, resume_from: Any) -> None:
        self._ctx = ctx
        ctx_mp = mp.get_context("fork")
        self._rx, tx = ctx_mp.Pipe(duplex=False)
        set_pipe_size(tx, cfg.pipe_bytes)
        self._proc = ctx_mp.Process(
            target=_child_main,
            args=(cfg, ctx.step_id, ctx.batch_rows, resume_from, tx, self._rx),
            name=f"aisp-source-{ctx.step_id}",
            daemon=True,
        )
        self._proc.start()
        tx.close()
        self._schema: pa.Schema | None = None
        self._position: Any = resume_from
        self._done = False
        self._dec = msgspec.json.Decoder()

    def next_batch(self, max_rows: int) -> Batch | None:
        while not self._done:
            try:
                msg = self._rx.recv_bytes()
            except EOFError:
                raise SourceError(f"source process of {self._ctx.step_id!r} died") from None
            tag = msg[:1]
            if tag == b"B":
                (hlen,) = _HEADER.unpack_from(msg, 1)
                self._position, traced = self._dec.decode(msg[5 : 5 + hlen])
                buf = pa.py_buffer(msg)[5 + hlen :]
                batch = Batch(pa.ipc.read_record_batch(buf, self._schema))
                if traced:
                    batch.traceparents = {int(eid): str(tp) for eid, tp in traced}
                return batch
            if tag == b"S":
                self._schema = pa.ipc.read_schema(pa.py_buffer(msg[1:]))
            elif tag == b"D":
                self._ctx.dead_letter(self._dec.decode(msg[1:]))
            elif tag == b"E":
                self._done = True
            elif tag == b"X":
                self._done = True
                raise SourceError(f"source {self._ctx.step_id!r} failed: {msg[1:].decode()}")
        return None

    def snapshot(self) -> Any:
        return self._position

    def close(self) -> None:
        self._rx.close()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
