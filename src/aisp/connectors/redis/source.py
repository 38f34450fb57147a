"""Redis Streams source: a consumer group, acknowledged (XACK) only once a checkpoint covers it.

Each stream entry carries one event as JSON in a field (``data`` by default), decoded with the
pipeline's schema like a file line; an entry that does not parse is dead-lettered with its
stream id and the reason, and acknowledged with the rest (a poison message never comes back).

Delivery: entries are read with ``XREADGROUP`` as consumer ``consumer`` of ``group`` (created at
the stream's start if missing, with ``MKSTREAM``). The position is the id of the last entry
handed to the pipeline. ``commit(position)``, called once a checkpoint holding that position is
durable, acknowledges every entry up to it. After a restart from a checkpoint, entries of this
consumer's pending list up to the checkpointed id are acknowledged (the checkpoint covers them)
and the later ones are delivered again first, in order, then new entries: exactly-once together
with checkpoints and a deduplicating sink. Without checkpoints, delivery is at-least-once.
Entries left pending by another consumer of the group for ``claim_idle_ms`` are taken over with
``XAUTOCLAIM`` when this one starts (at-least-once for those).

The engine id of an event is its stream id packed into an int64 (``ms << 20 | seq``), so a
replay gives the same ids. A lost connection is retried with exponential backoff and full jitter
for ``retry_s`` seconds, then the source fails with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import numpy as np

from aisp.batch import Batch
from aisp.connectors.access import Access
from aisp.connectors.redis.client import call_redis, redis_client
from aisp.errors import SourceError
from aisp.ingest.base import IdleClock, Source, SourceContext, SourcePartition
from aisp.ingest.messages import MessageDecoder

__all__ = ["RedisStreamSource", "entry_id_to_int"]


def entry_id_to_int(entry_id: bytes | str) -> int:
    """A stream id ``ms-seq`` as one int64: ``ms << 20 | seq`` (seq below 2**20).

    >>> entry_id_to_int(b"1700000000000-3")
    1782579200000000003
    """
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = raw.partition("-")
    return (int(ms) << 20) | int(seq or 0)


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True, kw_only=True)
class RedisStreamSource(Source):
    """Reads ``stream`` at ``host:port`` as ``consumer`` of ``group`` (see the module docstring)."""

    stream: str
    schema: type[msgspec.Struct]
    host: str = "127.0.0.1"
    port: int = 6379
    group: str = "aisp"
    consumer: str = "aisp-1"
    field: str = "data"
    block_ms: int = 100
    claim_idle_ms: int = 30_000
    retry_s: float = 30.0
    stop_when_idle_s: float | None = None
    """End the input after this long without a new entry (None: read for ever)."""
    access: Access = Access()
    """Credentials and TLS (``aisp.connectors.access``)."""
    decode_heavy: ClassVar[bool] = False

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return _RedisStreamPartition(self, ctx, resume_from)

    def describe(self) -> str:
        return f"redis://{self.host}:{self.port}/{self.stream}?group={self.group}&consumer={self.consumer}"


class _RedisStreamPartition(SourcePartition):
    def __init__(self, cfg: RedisStreamSource, ctx: SourceContext, resume_from: Any) -> None:
        import redis

        self._cfg, self._ctx = cfg, ctx
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._connects = 0  # (re)connections so far: a read that spans one may have lost its reply
        self._r: Any = redis_client(
            cfg.host,
            cfg.port,
            cfg.access,
            socket_timeout=max(5.0, cfg.block_ms / 500),
            redis_connect_func=self._on_connect,  # called with the connection
        )
        self._messages = MessageDecoder(cfg.schema, ctx)
        self._empty = self._messages.empty  # nothing new yet
        self._field = cfg.field.encode()
        self._last: str | None = resume_from["last_id"] if resume_from else None
        self._replay: list[tuple[bytes, dict[bytes, bytes]]] = []
        self._idle = IdleClock()
        self._call(self._setup)

    # -- connection ---------------------------------------------------------------------------
    def _on_connect(self, connection: Any) -> None:
        self._connects += 1
        connection.on_connect()

    def _call(self, fn: Any, *args: Any) -> Any:
        cfg = self._cfg
        return call_redis(
            fn, *args, retry_on=self._errors, retry_s=cfg.retry_s, what=f"redis at {cfg.host}:{cfg.port}",
            error=SourceError,
        )  # fmt: skip

    def _setup(self) -> None:
        import redis

        cfg = self._cfg
        try:
            self._r.xgroup_create(cfg.stream, cfg.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        # this consumer's pending entries: covered by the checkpoint (ack) or to deliver again
        pending = self._read_pending()
        if self._last is not None:
            last = _id_key(self._last)
            covered = [eid for eid, _ in pending if _id_key(eid) <= last]
            if covered:
                self._r.xack(cfg.stream, cfg.group, *covered)
            pending = [(eid, f) for eid, f in pending if _id_key(eid) > last]
        claimed: list[tuple[bytes, dict[bytes, bytes]]] = []
        cursor: Any = "0-0"
        while True:  # entries another consumer left pending for too long
            reply = self._r.xautoclaim(
                cfg.stream, cfg.group, cfg.consumer, cfg.claim_idle_ms, cursor, count=1000
            )
            cursor, entries = reply[0], reply[1]
            claimed += [(eid, f) for eid, f in entries if f]
            if cursor in (b"0-0", "0-0"):
                break
        self._replay = sorted(pending + claimed, key=lambda e: _id_key(e[0]))

    def _read_pending(self, after: Any = "0") -> list[tuple[bytes, dict[bytes, bytes]]]:
        """This consumer's pending entries (delivered, not acknowledged) with ids after ``after``."""
        out: list[tuple[bytes, dict[bytes, bytes]]] = []
        start: Any = after
        while True:
            reply = self._r.xreadgroup(
                self._cfg.group, self._cfg.consumer, {self._cfg.stream: start}, count=1000
            )
            entries = reply[0][1] if reply else []
            entries = [(eid, f) for eid, f in entries if f]  # deleted entries come back empty
            if not reply or not reply[0][1]:
                return out
            out += entries
            start = reply[0][1][-1][0]

    # -- reading ------------------------------------------------------------------------------
    def next_batch(self, max_rows: int) -> Batch | None:
        if self._replay:
            entries, self._replay = self._replay[:max_rows], self._replay[max_rows:]
        else:
            cfg = self._cfg
            connects = self._connects
            reply = self._call(
                self._r.xreadgroup, cfg.group, cfg.consumer, {cfg.stream: ">"}, max_rows, cfg.block_ms
            )
            entries = reply[0][1] if reply else []
            if self._connects != connects:
                # the client (re)connected during the read (redis-py also retries by itself): the
                # server may have delivered entries whose reply was lost; they sit in this
                # consumer's pending list, so take them, in order, from there
                self._replay = self._call(self._read_pending, self._last or "0")
                entries, self._replay = self._replay[:max_rows], self._replay[max_rows:]
        if not entries:
            if self._cfg.stop_when_idle_s is not None and self._idle.idle_s() >= self._cfg.stop_when_idle_s:
                return None
            return self._empty
        self._idle.handed_out()
        self._last = entries[-1][0].decode()
        lines = [f.get(self._field, b"") for _, f in entries]
        ids = np.fromiter((entry_id_to_int(e) for e, _ in entries), dtype=np.int64, count=len(entries))
        return self._messages.batch(
            lines,
            ids,
            lambda i: {"stream_id": entries[i][0].decode()},
            [f.get(b"traceparent") for _, f in entries],
            empty_reason=f"entry has no {self._cfg.field!r} field",
        )

    def snapshot(self) -> Any:
        return {"last_id": self._last} if self._last is not None else None

    def commit(self, position: Any) -> None:
        """Acknowledge this consumer's pending entries up to the checkpointed id."""
        if not position:
            return
        cfg = self._cfg
        start: Any = "-"
        while True:
            rows = self._call(
                self._r.xpending_range,
                cfg.stream,
                cfg.group,
                start,
                position["last_id"],
                10_000,
                cfg.consumer,
            )
            ids = [r["message_id"] for r in rows]  # the range ends at the checkpointed id
            if ids:
                self._call(self._r.xack, cfg.stream, cfg.group, *ids)
            if len(rows) < 10_000:
                return
            start = "(" + rows[-1]["message_id"].decode()

    def close(self) -> None:
        self._r.close()
