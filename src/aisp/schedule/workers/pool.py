"""Keyed parallelism: one pipeline run by N shared-nothing worker processes (``--workers N``).

The coordinator (the process that was started) cuts the input into blocks (the source's
``splits``: a file's blocks of whole lines, a generator's ranges of events) and hands block
``b`` to worker ``b % N``, which reads and decodes it. A keyed pipeline's rows go to the worker
that owns their key (``exchange.key_owner`` of the ``key_by`` column, one vectorised hash per
block): the decoding worker keeps its own part and sends each other worker its part, as Arrow
IPC over a pipe, so every worker takes every block's part in block order and each key's rows
stay in input order. A pipeline without keys keeps each block where it was decoded. Each worker
runs the whole graph in a ``LocalExecutor`` with its own keyed state; its sinks relay rows to
the coordinator (JSON lines already encoded, for a sink that writes them; else Arrow IPC), which
writes the real sinks and the dead letters.

Flow control: the coordinator hands out a block only while fewer than ``window`` blocks are
not yet taken by every worker, so the pipes and queues between processes hold a bounded number
of blocks. Each pipe has a thread that always drains it, so no two processes wait on each other.

Checkpoints are aligned barriers at a block boundary ``B``: the coordinator stops handing out
blocks and asks every worker for checkpoint ``k`` at ``B``; a worker waits until it has taken
the parts of every block before ``B``, takes checkpoint ``k`` of its state in its own store
(the ordinary barrier: its source pauses, its rows in flight finish) and answers. Every row of
the blocks before ``B`` has then been relayed, so the coordinator's sink and dead-letter
positions cover exactly them; it writes its manifest (the file position of block ``B``, the
sink and dead-letter positions, the number of workers) and goes on. A restart restores each
worker from checkpoint ``k`` of its store (a later one there never completed) and reads from
block ``B``'s position.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from aisp.errors import AispError
from aisp.graph import Graph
from aisp.ingest.base import Splits
from aisp.ipc import set_pipe_size
from aisp.observe.clock import wall_ms
from aisp.observe.latency import LatencyHistogram
from aisp.observe.remote import MergedTrail, merge
from aisp.schedule.config import ExecutorOptions
from aisp.schedule.workers.exchange import (
    ACK,
    LINES,
    ONE,
    PAIR,
    PIPE_BYTES,
    READ,
    SINK,
    ExchangePlan,
    Pipes,
    batch_from_bytes,
)
from aisp.schedule.workers.worker import WorkerSpec, worker_main
from aisp.sinks.base import RowEncoder, SinkPartition
from aisp.sinks.deadletter import DeadLetterWriter
from aisp.state.checkpoint import CheckpointStore

__all__ = ["WorkerPool", "WorkerResult"]

log = logging.getLogger("aisp.workers")


@dataclass
class WorkerResult:
    """What a worker reported when it ended (``_Worker._result``)."""

    events_out: int
    e2e: LatencyHistogram
    first_read_ns: int | None
    last_written_ns: int | None
    stages: list[dict[str, Any]]
    models: dict[str, dict[str, Any]]
    checkpoints: int
    peak_rss_mb: float


class WorkerPool:
    """The coordinator's side (see the module docstring): forks the workers, hands out blocks,
    writes what they relay, and takes aligned checkpoints.

    Args:
        graph, plan: the pipeline and how it is shared (``plan_exchange``).
        workers: how many processes.
        options: the executor options of each worker.
        sinks: the open sink partitions, by step id, that the workers' rows are written to.
        dead_letter: where dead letters go.
        store: the coordinator's checkpoint store (None: no checkpoints); each worker keeps its
            own in ``worker-I`` under it.
        restore: the coordinator's checkpoint to start from (its workers restore the same id).
        window: blocks handed out and not yet taken by every worker.
        block_rows: events per block (0: ``source_batch_rows`` per worker).
        observe: the workers send a snapshot of their pipelines every second (``merged``).
        repository_poll_s: how often the workers' versioned models look for a new version.
    """

    def __init__(
        self,
        graph: Graph,
        plan: ExchangePlan,
        workers: int,
        *,
        options: ExecutorOptions,
        sinks: dict[str, SinkPartition],
        encoders: dict[str, RowEncoder | None],
        dead_letter: DeadLetterWriter,
        store: CheckpointStore | None,
        restore: Any = None,
        window: int = 0,
        block_rows: int = 0,
        observe: bool = False,
        repository_poll_s: float = 1.0,
    ) -> None:
        self.graph, self.plan, self.n, self.options = graph, plan, workers, options
        self._sinks = [sinks[sid] for sid in plan.sinks]
        self._sink_locks = [threading.Lock() for _ in plan.sinks]
        self._encoders = encoders
        self.dead_letter, self.store = dead_letter, store
        self._restore = restore
        self._window = window or 2 * workers
        self._block_rows = block_rows
        self._observe = observe
        self._poll_s = repository_poll_s
        self._snapshots: dict[int, dict[str, Any]] = {}
        self._trail = MergedTrail()
        self.source_dead_letters = 0
        """Lines the workers could not decode (read, and dead-lettered)."""
        self._cond = threading.Condition()
        self._through = [0 if plan.key is not None else w for w in range(workers)]
        self._acks: dict[int, list[bool]] = {}
        self._results: dict[int, WorkerResult] = {}
        self._error: str | None = None
        self._procs: list[Any] = []
        self._control: list[Connection] = []
        self.events_in = 0
        self.checkpoints = 0
        self.started_ns = time.monotonic_ns()

    # -- processes ---------------------------------------------------------------------------
    def start(self) -> None:
        """Fork the workers (call while this process has one thread)."""
        running = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        if running:
            raise AispError(
                f"worker processes must be forked from a single thread (also running: {', '.join(running)})"
            )
        ctx = mp.get_context("fork")
        n = self.n
        control = [ctx.Pipe(duplex=False) for _ in range(n)]  # (worker reads, coordinator writes)
        results = [ctx.Pipe(duplex=False) for _ in range(n)]  # (coordinator reads, worker writes)
        peers = {(v, w): ctx.Pipe(duplex=False) for v in range(n) for w in range(n) if v != w}  # v -> w
        for _, tx in results:
            set_pipe_size(tx, PIPE_BYTES)
        for _, tx in peers.values():
            set_pipe_size(tx, PIPE_BYTES)
        every = [c for pair in control + results + list(peers.values()) for c in pair]
        restore_id = int(self._restore["id"]) if self._restore is not None else None
        keep = self.store.keep + 2 if self.store is not None else 2
        for w in range(n):
            pipes = Pipes(
                control=control[w][0],
                results=results[w][1],
                from_peers={v: peers[(v, w)][0] for v in range(n) if v != w},
                to_peers={v: peers[(w, v)][1] for v in range(n) if v != w},
            )
            own = {id(control[w][0]), id(results[w][1])}
            own |= {id(c) for c in pipes.from_peers.values()} | {id(c) for c in pipes.to_peers.values()}
            others = [c for c in every if id(c) not in own]
            root = str(self.store.root / f"worker-{w}") if self.store is not None else None
            proc = ctx.Process(
                target=worker_main,
                args=(
                    WorkerSpec(
                        w,
                        n,
                        self.graph,
                        self.plan,
                        self.options,
                        root,
                        keep,
                        restore_id,
                        self._encoders,
                        self._observe,
                    ),  # fmt: skip
                    pipes,
                    others,
                ),
                name=f"aisp-worker-{w}",
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
        for w in range(n):
            control[w][0].close()
            results[w][1].close()
        for rx, tx in peers.values():
            rx.close()
            tx.close()
        self._control = [tx for _, tx in control]
        for w in range(n):
            threading.Thread(
                target=self._read, args=(w, results[w][0]), name=f"aisp-coord-{w}", daemon=True
            ).start()

    def _read(self, w: int, conn: Connection) -> None:
        dec = msgspec.json.Decoder()
        try:
            while True:
                msg = conn.recv_bytes()
                tag = msg[:1]
                if tag == b"O":
                    i, rows = LINES.unpack_from(msg, 1)
                    with self._sink_locks[i]:
                        self._sinks[i].write_encoded(memoryview(msg)[1 + LINES.size :], rows)
                elif tag == b"A":
                    (i,) = SINK.unpack_from(msg, 1)
                    with self._sink_locks[i]:
                        self._sinks[i].write(batch_from_bytes(memoryview(msg)[1 + SINK.size :]))
                elif tag == b"D":
                    self.dead_letter.records(dec.decode(msg[1:]))
                elif tag == b"S":
                    records = dec.decode(msg[1:])
                    with self._cond:  # several reader threads count
                        self.source_dead_letters += len(records)
                    self.dead_letter.records(records)
                elif tag == b"M":
                    self._snapshots[w] = dec.decode(msg[1:])
                elif tag == b"C":
                    (block,) = ONE.unpack_from(msg, 1)
                    with self._cond:
                        self._through[w] = block + (1 if self.plan.key is not None else self.n)
                        self._cond.notify_all()
                elif tag == b"K":
                    checkpoint_id, ok = ACK.unpack_from(msg, 1)
                    with self._cond:
                        self._acks.setdefault(checkpoint_id, []).append(ok)
                        self._cond.notify_all()
                elif tag == b"F":
                    r = dec.decode(msg[1:])
                    r["e2e"] = LatencyHistogram.from_dict(r["e2e"])
                    with self._cond:
                        self._results[w] = WorkerResult(**r)
                        self._cond.notify_all()
                elif tag == b"X":
                    self._fail(f"worker {w} failed: {msg[1:].decode(errors='replace')}")
                    return
        except (EOFError, OSError):
            with self._cond:
                ended = w in self._results
            if not ended:
                self._fail(f"worker {w} exited without finishing (exit code {self._procs[w].exitcode})")
        except Exception as exc:  # noqa: BLE001 - a sink that cannot write stops the run
            self._fail(f"writing worker {w}'s output failed: {type(exc).__name__}: {exc}")

    def _fail(self, reason: str) -> None:
        with self._cond:
            if self._error is None:
                self._error = reason
            self._cond.notify_all()

    def _raise_on_error(self) -> None:
        if self._error is not None:
            raise AispError(self._error)

    def _send(self, w: int, data: bytes) -> None:
        try:
            self._control[w].send_bytes(data)
        except OSError:
            self._fail(f"worker {w} is gone (exit code {self._procs[w].exitcode})")
            self._raise_on_error()

    # -- the run -----------------------------------------------------------------------------
    def run(
        self, *, stop: threading.Event, interval_s: float | None, tick: Callable[[], None] | None = None
    ) -> None:
        """Hand out the input, checkpoint every ``interval_s`` (and at the end), until the input
        ends or ``stop`` is set; then let the workers drain and collect their results."""
        position = self._restore["position"] if self._restore is not None else None
        blocks = self.plan.source.splits(
            position, self._block_rows or self.options.source_batch_rows * self.n
        )
        assert blocks is not None  # plan_exchange checked that the source splits
        enc = msgspec.json.Encoder()
        handed, last_checkpoint = 0, time.monotonic()
        try:
            while not stop.is_set():
                if interval_s is not None and time.monotonic() - last_checkpoint >= interval_s:
                    self._checkpoint(handed, blocks)
                    last_checkpoint = time.monotonic()
                if tick is not None:
                    tick()
                if not self._room_for(handed):
                    continue
                block = blocks.next()
                if block is None:
                    break
                self.events_in += block.rows
                self._send(handed % self.n, b"R" + READ.pack(handed) + enc.encode(block.spec))
                handed += 1
            if interval_s is not None:
                self._checkpoint(handed, blocks)
            for w in range(self.n):
                self._send(w, b"E" + ONE.pack(handed))
            with self._cond:
                while len(self._results) < self.n and self._error is None:
                    self._cond.wait(0.1)
                self._raise_on_error()
        finally:
            blocks.close()
            self.close()

    def _room_for(self, block: int) -> bool:
        """Wait a little for ``block`` to fit in the window; whether it does."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._error is not None or block < min(self._through) + self._window, timeout=0.05
            )
            self._raise_on_error()
            return block < min(self._through) + self._window

    def _checkpoint(self, handed: int, blocks: Splits) -> None:
        """The aligned barrier at block ``handed`` (see the module docstring)."""
        if self.store is None:
            return
        checkpoint_id = self.store.next_id()
        for w in range(self.n):
            self._send(w, b"K" + PAIR.pack(checkpoint_id, handed))
        with self._cond:
            while len(self._acks.get(checkpoint_id, [])) < self.n and self._error is None:
                self._cond.wait(0.1)
            self._raise_on_error()
            acks = self._acks.pop(checkpoint_id)
        if not all(acks):
            log.warning("checkpoint %d skipped: a worker did not go quiet in time", checkpoint_id)
            return
        sinks = {}
        for sid, part, lock in zip(self.plan.sinks, self._sinks, self._sink_locks, strict=True):
            with lock:
                sinks[sid] = part.snapshot()
        dead = self.dead_letter.snapshot()
        for part in self._sinks:
            part.sync()
        self.dead_letter.sync()
        meta = {
            "pipeline": self.graph.name,
            "workers": self.n,
            "position": blocks.position,
            "sinks": sinks,
            "dead_letter_bytes": dead,
            "models": self._models(checkpoint_id),
        }
        self.store.write(checkpoint_id, {}, meta)
        self.checkpoints += 1

    def _models(self, checkpoint_id: int) -> dict[str, Any]:
        """The models the workers' checkpoint ``checkpoint_id`` was taken with (the first
        worker's record: each worker serves the same models)."""
        assert self.store is not None
        return dict(CheckpointStore(self.store.root / "worker-0").meta(checkpoint_id).get("models", {}))

    def merged(self) -> dict[str, Any] | None:
        """The workers' last snapshots as one (``observe.remote.merge``), with this process's
        dead letters and reads; None until every worker has sent one."""
        parts = [self._snapshots.get(w) for w in range(self.n)]
        if any(p is None for p in parts):
            return None
        data = merge(parts)  # type: ignore[arg-type]
        data["dead_letters"] = {"count": self.dead_letter.count, "by_step": dict(self.dead_letter.by_step)}
        data["stats"]["events_in"] += self.source_dead_letters
        data["stats"]["checkpoints"] = self.checkpoints
        self._trail.add(data)
        return data

    def results(self) -> list[WorkerResult]:
        return [self._results[w] for w in sorted(self._results)]

    def summary(self, seconds: float) -> tuple[LatencyHistogram, dict[str, Any]]:
        """The workers' results as one: the merged end-to-end latency, and ``RunSummary``'s
        fields (``peak_rss_mb``: the workers' sum)."""
        results = self.results()
        e2e = LatencyHistogram()
        for r in results:
            e2e.merge(r.e2e)
        firsts = [r.first_read_ns for r in results if r.first_read_ns is not None]
        lasts = [r.last_written_ns for r in results if r.last_written_ns is not None]
        models: dict[str, dict[str, Any]] = {}
        for r in results:
            for sid, m in r.models.items():
                into = models.setdefault(sid, {"rows": 0, "batches": 0, "errors": 0, "swaps": 0})
                for k in into:
                    into[k] += m[k]
        for m in models.values():
            m["mean_batch_rows"] = round(m["rows"] / m["batches"], 1) if m["batches"] else 0.0
        return e2e, {
            "events_in": self.events_in,
            "events_out": sum(r.events_out for r in results),
            "seconds": round(seconds, 3),
            "events_per_s": round(self.events_in / seconds, 1) if seconds > 0 else 0.0,
            "peak_rss_mb": sum(r.peak_rss_mb for r in results),
            "stages": [{"worker": w, **s} for w, r in enumerate(results) for s in r.stages],
            "models": models,
            "checkpoints": self.checkpoints,
            "active_seconds": round((max(lasts) - min(firsts)) / 1e9, 3) if firsts and lasts else 0.0,
            "active_from_ms": wall_ms(min(firsts)) if firsts else 0,
        }

    def close(self) -> None:
        """Close the pipes and end the workers (killed if they outlive a short wait)."""
        for conn in self._control:
            with contextlib.suppress(OSError):
                conn.close()
        for proc in self._procs:
            proc.join(timeout=5 if self._error is None else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
