"""A worker process of a run on several workers (``schedule/workers/pool.py`` has the design).

The worker runs the whole graph in a ``LocalExecutor`` whose source is its ``_Inbox`` (the
parts of every block, in block order) and whose sinks and dead letters relay to the
coordinator. Its source's thread also reads and decodes the blocks handed to this worker, each
time it takes a part (and while the part it needs is not there yet): one thread does the
GIL-bound work, so the worker uses one core, and peers get their parts early. A block left
waiting 10 ms (a paced source sleeps between batches) is decoded by a helper thread instead.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from aisp.batch import Batch
from aisp.errors import AispError
from aisp.graph import Graph, graph_from
from aisp.infer.models.versions import VersionWatcher
from aisp.ingest.base import DeadLetterRecord, Source, SourceContext, SourcePartition
from aisp.ipc import report_error, worker_init
from aisp.observe.remote import snapshot
from aisp.observe.stats import peak_rss_mb
from aisp.schedule.config import ExecutorOptions
from aisp.schedule.executor import LocalExecutor
from aisp.schedule.workers.exchange import (
    ACK,
    LINES,
    ONE,
    PAIR,
    READ,
    SINK,
    ExchangePlan,
    Pipes,
    batch_from_bytes,
    batch_to_bytes,
    key_owner,
)
from aisp.sinks.base import RowEncoder, Sink, SinkPartition
from aisp.sinks.deadletter import DeadLetterSink, DeadLetterWriter
from aisp.state.checkpoint import CheckpointStore

__all__ = ["WorkerSpec", "worker_main"]

_EMPTY = Batch.from_columns({}, ids=np.empty(0, dtype=np.int64), ingest_ns=0)


class _Inbox:
    """The parts of blocks this worker processes, handed out in block order."""

    def __init__(
        self, first: int, step: int, on_taken: Callable[[int], None], work: Callable[[], bool]
    ) -> None:
        self._cond = threading.Condition()
        self._parts: dict[int, Batch] = {}
        self.next, self._step = first, step
        self._end: int | None = None
        self._on_taken, self._work = on_taken, work
        self.closed = False

    def put(self, block: int, batch: Batch) -> None:
        with self._cond:
            self._parts[block] = batch
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def end_at(self, blocks: int) -> None:
        with self._cond:
            self._end = blocks
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def take(self) -> Batch | None:
        """The next block's part; None after the last block. First ``work()`` decodes the
        blocks handed to this worker (parts peers wait for); when the part is not there and
        there is nothing to decode either, an empty batch after a short wait (so the source
        can pause for a checkpoint)."""
        waited = False
        while self._work():
            pass
        while True:
            with self._cond:
                if self.next in self._parts:
                    block = self.next
                    part = self._parts.pop(block)
                    self.next += self._step
                    self._cond.notify_all()
                    break
                if self.closed or (self._end is not None and self.next >= self._end):
                    return None
            if self._work():
                continue
            if waited:
                return _EMPTY
            with self._cond:
                self._cond.wait(0.02)
            waited = True
        self._on_taken(block)
        return part

    def wait_taken(self, blocks: int, stop: threading.Event) -> bool:
        """Wait until every part of the blocks before ``blocks`` was taken."""
        with self._cond:
            while self.next < blocks:
                if stop.is_set() or self.closed:
                    return False
                self._cond.wait(0.05)
        return True


@dataclass(frozen=True, kw_only=True)
class _InboxSource(Source):
    inbox: _Inbox

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return _InboxPartition(self.inbox)

    def describe(self) -> str:
        return "exchange"


class _InboxPartition(SourcePartition):
    def __init__(self, inbox: _Inbox) -> None:
        self._inbox = inbox

    def next_batch(self, max_rows: int) -> Batch | None:
        return self._inbox.take()


class _Outbox:
    """The pipe to the coordinator, shared by the worker's threads."""

    def __init__(self, conn: Connection) -> None:
        self._conn, self._lock = conn, threading.Lock()

    def send(self, data: bytes) -> None:
        with self._lock:
            self._conn.send_bytes(data)


@dataclass(frozen=True, kw_only=True)
class _RelaySink(Sink):
    index: int
    outbox: _Outbox
    encoder: RowEncoder | None

    def open(self) -> SinkPartition:
        return _RelayPartition(self)

    def resume(self, position: Any) -> SinkPartition:
        return _RelayPartition(self)


class _RelayPartition(SinkPartition):
    def __init__(self, cfg: _RelaySink) -> None:
        self._cfg = cfg

    def write(self, batch: Batch) -> None:
        cfg = self._cfg
        if cfg.encoder is not None:
            cfg.outbox.send(b"O" + LINES.pack(cfg.index, batch.num_rows) + cfg.encoder.encode(batch))
        else:
            cfg.outbox.send(b"A" + SINK.pack(cfg.index) + batch_to_bytes(batch))


class _RelayDeadLetters(DeadLetterWriter):
    """Counts dead letters here and sends them to the coordinator, which writes them."""

    def __init__(self, outbox: _Outbox) -> None:
        super().__init__(DeadLetterSink())
        self._outbox = outbox
        self._enc = msgspec.json.Encoder()

    def records(self, records: Any) -> None:
        recs = list(records)
        if recs:
            super().records(recs)
            self._outbox.send(b"D" + self._enc.encode(recs))


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is told when it is forked: which worker it is, of how many, the
    graph and its plan, the executor options, where its checkpoints go (None: none) and which
    to restore, the sinks' line encoders, and whether to send snapshots for observers."""

    index: int
    workers: int
    graph: Graph
    plan: ExchangePlan
    options: ExecutorOptions
    store_root: str | None
    keep: int
    restore_id: int | None
    encoders: dict[str, RowEncoder | None]
    observe: bool
    repository_poll_s: float = 1.0
    """How often versioned models (``ServedModel``) look for a new version (0: never)."""


class _Worker:
    def __init__(self, spec: WorkerSpec, pipes: Pipes, store: CheckpointStore | None) -> None:
        index, graph, plan, workers, options = spec.index, spec.graph, spec.plan, spec.workers, spec.options
        restore_id, encoders = spec.restore_id, spec.encoders
        self.index, self.plan, self.workers, self.pipes = index, plan, workers, pipes
        self._observe = spec.observe
        self._poll_s = spec.repository_poll_s
        self.outbox = _Outbox(pipes.results)
        keyed = plan.key is not None
        self.inbox = _Inbox(0 if keyed else index, 1 if keyed else workers, self._taken, self._decode_next)
        self.store = store
        restore = None
        if store is not None:
            store.discard_from(1 if restore_id is None else restore_id + 1)
            restore = store.load(restore_id) if restore_id is not None else None
        nodes = []
        for n in graph.nodes:
            if n.step_id == plan.source_step:
                n = replace(n, spec=_InboxSource(inbox=self.inbox))
            elif n.kind == "sink":
                i = plan.sinks.index(n.step_id)
                n = replace(n, spec=_RelaySink(index=i, outbox=self.outbox, encoder=encoders[n.step_id]))
            nodes.append(n)
        self.ex = LocalExecutor(
            graph_from(graph.name, nodes),
            dead_letter=_RelayDeadLetters(self.outbox),
            options=replace(
                options,
                offload_sources=False,
                offload_sinks=False,
                workers=1,
                rate_events_per_s=options.rate_events_per_s / workers,  # each paces its share
            ),
            restore=restore,
        )
        self._reads: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self._reads_cond = threading.Condition()
        self._decoding = threading.Lock()  # one block at a time: parts go out whole, in order
        self._dead: list[DeadLetterRecord] = []
        ctx = SourceContext(plan.source_step, self._dead.extend, options.source_batch_rows)
        self._read_split = plan.source.split_reader(ctx)
        self._dec = msgspec.json.Decoder()
        self._enc = msgspec.json.Encoder()
        self._barriers: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._stop = threading.Event()

    def _taken(self, block: int) -> None:
        self.outbox.send(b"C" + ONE.pack(block))

    # threads
    def _control(self) -> None:
        conn = self.pipes.control
        try:
            while True:
                msg = conn.recv_bytes()
                tag = msg[:1]
                if tag == b"R":
                    (block,) = READ.unpack_from(msg, 1)
                    with self._reads_cond:
                        self._reads.append((time.monotonic_ns(), block, msg[1 + READ.size :]))
                        self._reads_cond.notify()
                    self.inbox.wake()
                elif tag == b"K":
                    self._barriers.put(PAIR.unpack_from(msg, 1))
                elif tag == b"E":
                    (blocks,) = ONE.unpack_from(msg, 1)
                    self.inbox.end_at(blocks)
        except (EOFError, OSError):  # the coordinator is gone: stop
            self._stop.set()
            self.ex.request_stop()
            self.inbox.close()

    def _decode_next(self) -> bool:
        """Read and decode this worker's next block, send each peer its part and keep this
        worker's; False when no block is waiting. The source's thread does it when it takes a
        part (one thread doing the GIL-bound work is fastest), ``_late_reads`` when that thread
        is slow to come back."""
        with self._decoding:
            try:
                _, block, split = self._reads.popleft()
            except IndexError:
                return False
            self._decode(block, self._dec.decode(split))
        return True

    def _late_reads(self, grace_ns: int = 10_000_000) -> None:
        """(A thread) decode a block the source's thread left waiting for ``grace_ns``: a paced
        source sleeps between its batches, and a peer would wait for its part meanwhile."""
        while not self._stop.is_set():
            with self._reads_cond:
                if not self._reads:
                    self._reads_cond.wait(0.1)
                    continue
                late = self._reads[0][0] + grace_ns - time.monotonic_ns()
            if late > 0:
                self._stop.wait(late / 1e9)
                continue
            try:
                self._decode_next()
            except Exception as exc:  # noqa: BLE001 - the run cannot go on without this block
                report_error(self.pipes.results, exc)
                self._stop.set()
                self.ex.request_stop()
                self.inbox.close()
                return

    def _decode(self, block: int, split: dict[str, Any]) -> None:
        self._dead.clear()
        batches = self._read_split(split)
        batch = batches[0] if len(batches) == 1 else Batch.concat(batches) if batches else _EMPTY
        dead, plan, n = self._dead, self.plan, self.workers
        if dead:  # counted by the coordinator as read
            self.outbox.send(b"S" + self._enc.encode(dead))
        if plan.key is None:
            self._deliver(block, None, batch)
        elif not batch.num_rows:
            self._deliver(block, [batch] * n, batch)
        else:
            owner = key_owner(batch.column(plan.key), n)
            order = np.argsort(owner, kind="stable")
            bounds = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=n))])
            grouped = batch.take(order)
            parts = [grouped.slice(int(bounds[v]), int(bounds[v + 1] - bounds[v])) for v in range(n)]
            self._deliver(block, parts, parts[self.index])

    def _deliver(self, block: int, parts: list[Batch] | None, own: Batch) -> None:
        if parts is not None:
            for v, conn in self.pipes.to_peers.items():
                part = parts[v]
                conn.send_bytes(b"P" + ONE.pack(block) + (batch_to_bytes(part) if part.num_rows else b""))
        self.inbox.put(block, own)

    def _publish(self) -> None:
        """A snapshot of this worker's pipeline for the coordinator's observer, every second."""
        enc = msgspec.json.Encoder()
        while not self._stop.wait(1.0):
            self.outbox.send(b"M" + enc.encode(snapshot(self.ex)))

    def _peer(self, conn: Connection) -> None:
        try:
            while True:
                msg = conn.recv_bytes()
                (block,) = ONE.unpack_from(msg, 1)
                head = 1 + ONE.size
                part = batch_from_bytes(memoryview(msg)[head:]) if len(msg) > head else _EMPTY
                self.inbox.put(block, part)
        except (EOFError, OSError):
            return

    def run(self) -> None:
        threads = [
            threading.Thread(target=self._control, name="aisp-worker-control", daemon=True),
        ]
        threads += [
            threading.Thread(target=self._peer, args=(c,), name=f"aisp-worker-peer-{v}", daemon=True)
            for v, c in self.pipes.from_peers.items()
        ]
        threads.append(threading.Thread(target=self._late_reads, name="aisp-worker-decode", daemon=True))
        if self._observe:
            threads.append(threading.Thread(target=self._publish, name="aisp-worker-observe", daemon=True))
        self.ex.start()
        for t in threads:
            t.start()
        versions = VersionWatcher([b.runtime for b in self.ex.batchers.values()], self._poll_s)
        while not self.ex.join(timeout_s=0):
            versions.poll()
            try:
                checkpoint_id, blocks = self._barriers.get(timeout=0.02)
            except queue.Empty:
                continue
            ok = False
            if self.store is not None and self.inbox.wait_taken(blocks, self._stop):
                self.store.discard_from(checkpoint_id)
                ok = (
                    self.ex.checkpoints.checkpoint(self.store, checkpoint_id=checkpoint_id, timeout_s=60.0)
                    is not None
                )
            self.outbox.send(b"K" + ACK.pack(checkpoint_id, ok))
        self._stop.set()
        for conn in self.pipes.to_peers.values():
            conn.close()
        if self.ex.errors:
            err = self.ex.errors[0]
            raise err if isinstance(err, AispError) else AispError(f"{type(err).__name__}: {err}")
        self.outbox.send(b"F" + msgspec.json.encode(self._result()))

    def _result(self) -> dict[str, Any]:
        st = self.ex.stats
        return {
            "events_out": st.events_out,
            "e2e": st.e2e.to_dict(),
            "first_read_ns": st.first_read_ns,
            "last_written_ns": st.last_written_ns,
            "stages": [s.as_dict() for s in st.stages.values()],
            "models": {
                sid: {
                    "rows": b.stats.rows,
                    "batches": b.stats.batches,
                    "errors": b.stats.errors,
                    "swaps": getattr(b.runtime, "swaps", 0),
                }
                for sid, b in self.ex.batchers.items()
            },
            "checkpoints": st.checkpoints,
            "peak_rss_mb": peak_rss_mb(),
        }


def worker_main(spec: WorkerSpec, pipes: Pipes, others: list[Connection]) -> None:
    """The forked worker process: close ``others`` (the pipe ends it does not own), run, and
    report an error to the coordinator."""
    worker_init(*others)
    try:
        store = CheckpointStore(spec.store_root, keep=spec.keep) if spec.store_root is not None else None
        _Worker(spec, pipes, store).run()
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, which raises it
        report_error(pipes.results, exc)
    finally:
        pipes.results.close()
