"""Run a sink's encoding and writing in a child process, off the pipeline's GIL.

Encoding rows as JSON builds Python objects; ``ProcessSink`` forks a child that opens the wrapped
sink and receives batches as Arrow IPC messages over a pipe. The child acknowledges each batch
once the wrapped sink wrote it, with the time of the write, and the parent reports those rows as
written (``on_written``), so end-to-end latency still ends at the real write. A full pipe blocks
``write``: that is the backpressure from a slow sink.

The child is forked when the sink is opened, which the executor does before it starts any thread.

Parent -> child: ``S`` schema, ``B`` record batch, ``F`` flush, ``E`` end.
Child -> parent: ``A`` + int64 ns (one batch written), ``F`` flushed, ``C`` closed, ``X`` error.
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import INGEST_NS, Batch
from aisp.errors import SinkError
from aisp.ipc import report_error, set_pipe_size, worker_init
from aisp.sinks.base import Sink, SinkPartition

__all__ = ["ProcessSink"]

_NS = struct.Struct("<q")


@dataclass(frozen=True, kw_only=True)
class ProcessSink(Sink):
    """Wraps ``inner`` so that it encodes and writes in a forked child process."""

    inner: Sink
    pipe_bytes: int = 1 << 20

    def open(self) -> SinkPartition:
        if threading.active_count() > 1:
            raise SinkError(
                "ProcessSink must be opened before any other thread starts (fork safety); "
                f"{threading.active_count()} threads are running"
            )
        return _ParentSink(self)

    def describe(self) -> str:
        return f"process({self.inner.describe()})"


def _child_main(cfg: ProcessSink, rx: Connection, ack: Connection, *parent_ends: Connection) -> None:
    worker_init(*parent_ends)
    part: SinkPartition | None = None
    schema: pa.Schema | None = None
    try:
        part = cfg.inner.open()
        while True:
            msg = rx.recv_bytes()
            tag = msg[:1]
            if tag == b"B":
                part.write(Batch(pa.ipc.read_record_batch(pa.py_buffer(msg)[1:], schema)))
                ack.send_bytes(b"A" + _NS.pack(time.monotonic_ns()))
            elif tag == b"S":
                schema = pa.ipc.read_schema(pa.py_buffer(msg[1:]))
            elif tag == b"F":
                part.flush()
                ack.send_bytes(b"F")
            elif tag == b"E":
                part.close()
                part = None
                ack.send_bytes(b"C")
                return
    except EOFError:
        return  # the parent went away
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        report_error(ack, exc)
    finally:
        if part is not None:
            part.close()


class _ParentSink(SinkPartition):
    reports_written: ClassVar[bool] = True

    def __init__(self, cfg: ProcessSink) -> None:
        ctx = mp.get_context("fork")
        rx, self._tx = ctx.Pipe(duplex=False)
        self._ack, ack_tx = ctx.Pipe(duplex=False)
        set_pipe_size(self._tx, cfg.pipe_bytes)
        self._proc = ctx.Process(
            target=_child_main, args=(cfg, rx, ack_tx, self._tx, self._ack), name="aisp-sink", daemon=True
        )
        self._proc.start()
        rx.close()
        ack_tx.close()
        self._schema: pa.Schema | None = None
        self._pending: deque[npt.NDArray[np.int64]] = deque()
        self._flushed = threading.Semaphore(0)
        self._closed = threading.Event()
        self._error: str | None = None
        self._reader: threading.Thread | None = None
        self._name = cfg.inner.describe()

    def _read_acks(self) -> None:
        try:
            while True:
                msg = self._ack.recv_bytes()
                tag = msg[:1]
                if tag == b"A":
                    ingest = self._pending.popleft()
                    if self.on_written is not None:
                        self.on_written(ingest, _NS.unpack_from(msg, 1)[0])
                elif tag == b"F":
                    self._flushed.release()
                elif tag == b"C":
                    return
                elif tag == b"X":
                    self._error = msg[1:].decode()
                    return
        except (EOFError, OSError):
            self._error = self._error or "sink process exited"
        finally:
            self._closed.set()
            self._flushed.release()

    def _send(self, data: bytes) -> None:
        if self._error is not None:
            raise SinkError(f"sink {self._name} failed: {self._error}")
        try:
            self._tx.send_bytes(data)
        except OSError as exc:  # the child went: its reason, if it sent one, is on the ack pipe
            if self._reader is not None:
                self._reader.join(timeout=5)
            raise SinkError(f"sink {self._name} failed: {self._error or exc}") from exc

    def write(self, batch: Batch) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_acks, name="aisp-sink-acks", daemon=True)
            self._reader.start()
        rb = batch.record_batch
        if self._schema is None or not rb.schema.equals(self._schema):
            self._schema = rb.schema
            self._send(b"S" + rb.schema.serialize().to_pybytes())
        self._pending.append(batch.numpy(INGEST_NS))
        self._send(b"B" + rb.serialize().to_pybytes())

    def flush(self) -> None:
        if self._reader is None or self._closed.is_set():
            return
        self._send(b"F")
        self._flushed.acquire()

    def close(self) -> None:
        try:
            if not self._closed.is_set() and self._error is None:
                self._send(b"E")
            if self._reader is not None:
                self._reader.join()
            else:  # never written: read the close acknowledgement here
                self._read_acks()
        finally:
            self._tx.close()
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        if self._error is not None:
            raise SinkError(f"sink {self._name} failed: {self._error}")
