"""What a served pipeline's events come to: ``Chunk`` (a request's events and their answers) and
``ResultTracker`` (the executor's ``Lineage``), which follows each event to its end (see
``aisp.serve.pipelines.service``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from aisp.batch import ID, PARTIAL, SOURCE, Batch
from aisp.sinks.base import RowEncoder
from aisp.transform.operators import Emit

__all__ = ["Chunk", "ResultTracker"]

_encode = msgspec.json.Encoder().encode


class Chunk:
    """The events of one piece of a request, in request order, and what became of each.

    ``prefix`` is the number of leading events that are done; ``results[:prefix]`` are their
    JSON lines. ``notify`` is called (from a pipeline thread) whenever ``prefix`` grows.
    """

    def __init__(self, start: int, n: int, notify: Callable[[], None] | None = None) -> None:
        self.start, self.n = start, n
        self.open = np.ones(n, dtype=np.int32)  # open branches per event; 0 = done
        self.results: npt.NDArray[np.object_] = np.empty(n, dtype=object)  # bytes, or None: not yet
        self.rank = np.zeros(n, dtype=np.int8)  # what results[i] is: see ResultTracker.RANKS
        self.prefix = 0
        self.notify = notify
        self.done = threading.Event()
        self.pieces: dict[int, list[bytes]] = {}
        """Lines of partial rows (``PARTIAL``: tokens as they come) by event, not yet taken."""
        self._pieces_lock = threading.Lock()

    def add_piece(self, i: int, line: bytes) -> None:
        with self._pieces_lock:
            self.pieces.setdefault(i, []).append(line)

    def stream(self, start: int, stop: int) -> bytes:
        """``lines(start, stop)`` with each event's pieces before its result line, then the
        pieces of event ``stop`` so far (the one the response waits for: it streams)."""
        out: list[bytes] = []
        with self._pieces_lock:
            for i in range(start, min(stop + 1, self.n)):
                out += self.pieces.pop(i, ())
                if i < stop:
                    out.append(self.lines(i, i + 1)[:-1])
        return b"\n".join(out) + b"\n" if out else b""

    def lines(self, start: int, stop: int) -> bytes:
        """The result lines of events ``start:stop`` (done ones), newline-terminated."""
        done = self.results[start:stop].tolist()
        if not done:
            return b""
        if None in done:  # (an event done with no outcome recorded: not expected)
            done = [b"{}" if r is None else r for r in done]
        return b"\n".join(done) + b"\n"

    def _advance(self) -> bool:
        rest = np.flatnonzero(self.open[self.prefix :])
        prefix = self.prefix + int(rest[0]) if rest.size else self.n
        if prefix == self.prefix:
            return False
        self.prefix = prefix
        if prefix == self.n:
            self.done.set()
        return True


class ResultTracker:
    """Maps events back to their chunks and collects their results (see the module docstring).

    An event that took several branches gets the most telling of their outcomes: its output
    rows, else the error of a branch that failed, else a side sink that took it, else the step
    that dropped it.
    """

    DROPPED, SIDE_SINK, ERROR, OUTPUT = 1, 2, 3, 4

    def __init__(self, result_step: str, encoder: RowEncoder) -> None:
        self.result_step = result_step
        self._encoder = encoder
        self._pieces_encoder = RowEncoder()  # partial rows: their own columns (an LLM's token)
        self._lock = threading.Lock()
        self._chunks: dict[int, Chunk] = {}
        self._starts = np.empty(0, dtype=np.int64)
        self._order: list[Chunk] = []
        self._dirty = False
        self.observe: Callable[[Batch], None] | None = None
        """Called with each batch of results (the anomaly monitor)."""

    def switch(self, result_step: str, encoder: RowEncoder) -> None:
        """(At a topology update's barrier) results come from ``result_step`` from now on."""
        with self._lock:
            self.result_step, self._encoder = result_step, encoder

    @property
    def open_chunks(self) -> int:
        return len(self._chunks)

    def add(self, chunk: Chunk) -> None:
        with self._lock:
            self._chunks[chunk.start] = chunk
            self._dirty = True
            if chunk._advance() and chunk.prefix == chunk.n:  # every line was invalid
                self._chunks.pop(chunk.start)

    def discard(self, chunk: Chunk) -> None:
        with self._lock:
            if self._chunks.pop(chunk.start, None) is not None:
                self._dirty = True

    # -- the executor's Lineage -------------------------------------------------------------
    def forwarded(self, step: str, batch: Batch, outs: Emit) -> None:
        if PARTIAL in batch:
            return  # pieces of results open and close no branch
        ids = _events(batch)
        if len(outs) == 1 and outs[0][1].num_rows == ids.shape[0]:
            out_ids = _events(outs[0][1])
            if out_ids is ids or np.array_equal(out_ids, ids):
                return  # one row out per row in: nothing changes
        out_ids = np.concatenate([_events(o) for _, o in outs]) if outs else np.empty(0, np.int64)
        # branches per event: rows out less rows in (a step may take several rows of an event,
        # a video's chunks' sound, and make several of it, or none)
        ids, took = np.unique(ids, return_counts=True)
        uniq, counts = np.unique(out_ids, return_counts=True)
        pos = np.searchsorted(uniq, ids).clip(0, max(uniq.shape[0] - 1, 0))
        found = (uniq[pos] == ids) if uniq.shape[0] else np.zeros(ids.shape[0], dtype=bool)
        delta = np.where(found, counts[pos] if uniq.shape[0] else 0, 0) - took
        changed = delta != 0
        if changed.any():
            self._update(ids[changed], delta[changed], fill=_encode({"dropped": step}), rank=self.DROPPED)

    def written(self, step: str, batch: Batch) -> None:
        if not batch.num_rows:
            return
        if PARTIAL in batch:
            if step == self.result_step:
                self._pieces(batch)
            return
        minus = np.full(batch.num_rows, -1, dtype=np.int32)
        if step == self.result_step:
            if self.observe is not None:
                self.observe(batch)
            lines = np.empty(batch.num_rows, dtype=object)
            lines[:] = self._encoder.encode(batch).split(b"\n")[: batch.num_rows]
            self._update(_events(batch), minus, lines=lines)
        else:
            self._update(_events(batch), minus, fill=_encode({"sink": step}), rank=self.SIDE_SINK)

    def failed(self, step: str, batch: Batch, reason: str, *, closes: bool = True) -> None:
        if ID not in batch or not batch.num_rows or PARTIAL in batch:
            return
        delta = np.full(batch.num_rows, -1 if closes else 0, dtype=np.int32)
        fill = _encode({"error": reason, "step": step})
        self._update(_events(batch), delta, fill=fill, rank=self.ERROR, always_fill=not closes)

    def _pieces(self, batch: Batch) -> None:
        lines = self._pieces_encoder.encode(batch).split(b"\n")
        ids = _events(batch)
        wake = []
        with self._lock:
            for chunk, rows in self._locate(ids):
                for i, r in zip((ids[rows] - chunk.start).tolist(), rows.tolist(), strict=True):
                    chunk.add_piece(i, lines[r])
                wake.append(chunk)
        for chunk in wake:
            if chunk.notify is not None:
                chunk.notify()

    # -- bookkeeping ------------------------------------------------------------------------
    def _locate(self, ids: npt.NDArray[np.int64]) -> list[tuple[Chunk, npt.NDArray[np.intp]]]:
        """(chunk, row positions in ``ids``) for every tracked chunk that ``ids`` touch."""
        if self._dirty:
            self._order = sorted(self._chunks.values(), key=lambda c: c.start)
            self._starts = np.asarray([c.start for c in self._order], dtype=np.int64)
            self._dirty = False
        if not self._order:
            return []
        pos = np.searchsorted(self._starts, ids, side="right") - 1
        out = []
        for p in np.unique(pos).tolist():
            if p < 0:
                continue
            chunk = self._order[p]
            rows = np.flatnonzero(pos == p)
            rows = rows[ids[rows] - chunk.start < chunk.n]
            if rows.size:
                out.append((chunk, rows))
        return out

    def _update(
        self,
        ids: npt.NDArray[np.int64],
        delta: npt.NDArray[Any],
        *,
        lines: npt.NDArray[np.object_] | None = None,
        fill: bytes | None = None,
        rank: int = 0,
        always_fill: bool = False,
    ) -> None:
        """Apply branch changes ``delta`` to events ``ids``: ``lines`` are their outputs;
        ``fill`` (of ``rank``) is the outcome of the branches that close (``delta`` < 0), or of
        every row given with ``always_fill``."""
        wake = []
        with self._lock:
            for chunk, rows in self._locate(ids):
                idx = ids[rows] - chunk.start
                res = chunk.results
                if lines is not None:
                    ranks = chunk.rank
                    if _distinct(idx, chunk.n) and not (ranks[idx] == self.OUTPUT).any():
                        res[idx] = lines[rows]  # each event's first and only output row here
                    else:  # several output rows for an event: joined, in order
                        for i, r in zip(idx.tolist(), rows.tolist(), strict=True):
                            res[i] = _join(res[i], lines[r]) if ranks[i] == self.OUTPUT else lines[r]
                            ranks[i] = self.OUTPUT
                    ranks[idx] = self.OUTPUT
                elif fill is not None:
                    closing = idx[((delta[rows] < 0) | always_fill) & (chunk.rank[idx] < rank)]
                    res[closing] = fill
                    chunk.rank[closing] = rank
                np.add.at(chunk.open, idx, delta[rows])
                closed = idx[chunk.open[idx] <= 0]
                if closed.size:
                    chunk.open[closed] = 0
                    if chunk._advance():
                        wake.append(chunk)
                        if chunk.prefix == chunk.n:
                            del self._chunks[chunk.start]
                            self._dirty = True
        for chunk in wake:
            if chunk.notify is not None:
                chunk.notify()


def _events(batch: Batch) -> npt.NDArray[np.int64]:
    """The events a batch's rows come from: their ids, or for rows a step made with ids of their
    own (a video's frames, captions), the ids of the events they were made of (``SOURCE``)."""
    if SOURCE in batch:
        return np.asarray(batch.numpy(SOURCE), dtype=np.int64)
    return batch.ids


def _distinct(idx: npt.NDArray[np.int64], n: int) -> bool:
    """Whether the positions ``idx`` (each below ``n``) are all different."""
    seen = np.zeros(n, dtype=np.bool_)
    seen[idx] = True
    return int(np.count_nonzero(seen)) == idx.size


def _join(a: bytes, b: bytes) -> bytes:
    """Two outputs of one event (a fan-out) as one JSON array line."""
    if a.startswith(b"["):
        return a[:-1] + b"," + b + b"]"
    return b"[" + a + b"," + b + b"]"
