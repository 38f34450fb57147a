"""Kafka source (``confluent-kafka``): a consumer group, offsets committed once a checkpoint covers
them, positions restored from the checkpoint after a restart.

Each record's value is one event as JSON, decoded with the pipeline's schema; a record that does
not parse is dead-lettered with its partition, offset and the reason (its offset is committed
with the rest). The engine id of an event is ``partition << 40 | offset``, so a replay gives the
same ids.

Delivery: the consumer joins ``group`` and is assigned partitions by the group. The position is
the next offset per partition after the records handed to the pipeline; ``commit(position)``
commits those offsets to the group once the checkpoint holding them is durable (at the latest
when the partition is revoked), for lag and for other readers. The group's offsets are not what
a restart resumes from: they lag the checkpoint (a commit follows it) or, with a transactional
output, may run ahead of it (the process died between the transaction's commit and the
checkpoint's manifest). Without state that moves with partitions, the process's keyed state
holds what it read of every partition, so the process's positions are the truth: an assigned
partition starts where the process read up to, else at the restored checkpoint's offset, else
at the group's committed offset, else at the earliest; a revoked partition keeps its position,
in the checkpoints and for its return. Exactly-once so holds for one process per group, however
the group rebalances (a killed process stays a member until its session times out, so its
successor is first assigned part of the topic). Several processes of one group need keyed state
that moves with the partitions (``aisp run --partition-state``): a newly assigned partition is
then not read while the engine restores its state in the background (``SourceContext.on_assign``;
its records fetched meanwhile are dropped), and starts where the restored state says once it is
loaded (``restored``, asked between batches; the other partitions flow and the group is polled
meanwhile); a revoked one has its state flushed (``on_revoke``) and its position dropped. While
every broker is unreachable the source waits (librdkafka reconnects) and does not count the time
as idle input; after ``retry_s`` it fails with a clear error. Compatibility is tested against the
Tansu broker (Kafka protocol), see the README.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import numpy as np
import numpy.typing as npt

from aisp.batch import Batch
from aisp.connectors.access import Access
from aisp.connectors.kafka.client import CLIENT_SETTINGS, final_reason, security_settings
from aisp.errors import ConfigError, SourceError
from aisp.ingest.base import IdleClock, Source, SourceContext, SourcePartition
from aisp.ingest.messages import MessageDecoder

log = logging.getLogger("aisp.kafka")

__all__ = ["KafkaSource", "KafkaSourcePartition", "kafka_event_id"]

_OFFSET_BITS = 40


def kafka_event_id(partition: Any, offset: Any) -> Any:
    """The engine id of a record: ``partition << 40 | offset`` (ints or numpy arrays).

    >>> kafka_event_id(3, 17)
    3298534883345
    """
    return (partition << _OFFSET_BITS) | offset


@dataclass(frozen=True, kw_only=True)
class KafkaSource(Source):
    """Reads ``topic`` from ``bootstrap`` as a member of ``group`` (see the module docstring)."""

    topic: str
    schema: type[msgspec.Struct]
    bootstrap: str = "127.0.0.1:9092"
    group: str = "aisp"
    poll_timeout_s: float = 0.1
    """How long one poll waits for a first record; once one came, what else is fetched already is
    taken without waiting (a lone record is handed on as it arrives, not at the poll's end)."""
    retry_s: float = 30.0
    stop_when_idle_s: float | None = None
    """End the input after this long without a record, once partitions are assigned and a fetch
    reply has said each one held is read to its end (a slow link's fetch can take longer than
    this; time the engine spends on rows handed out, restores and rebalances does not count:
    ``IdleClock``).
    While the consumer holds only part of the topic, it waits a session timeout longer: the rest
    may be held by a member that died (a killed predecessor) until the group drops it and
    rebalances."""
    fetch_wait_ms: int = 20
    """How long the broker may hold a fetch that finds nothing new (librdkafka's
    ``fetch.wait.max.ms``, 500 by default there). Apache Kafka answers a waiting fetch as soon as
    a record arrives, so this only sets how often an idle consumer asks. Tansu holds every fetch
    this long even when records arrive meanwhile, so on Tansu it is the latency floor (measured,
    500 records/s on one partition: p50 174 ms at 500 ms, 39 ms at 50 ms, 20 ms at 10 ms), and
    each fetch that finds records lists every record batch the partition holds: a run of hours
    on Tansu asks less often (see docs/cluster.md, make soak)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Extra librdkafka settings."""
    access: Access = Access()
    """Credentials and TLS (``aisp.connectors.access``)."""
    sasl: str | None = None
    """The SASL mechanism of the login (``PLAIN``, ``SCRAM-SHA-256``, ``SCRAM-SHA-512``)."""
    decode_heavy: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not 0 <= self.fetch_wait_ms <= 300_000:
            raise ConfigError(f"kafka input: fetch_wait_ms must be 0 to 300000, got {self.fetch_wait_ms}")

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return KafkaSourcePartition(self, ctx, resume_from)

    @staticmethod
    def partition_of(ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The input partition of engine ids (``kafka_event_id``)."""
        return ids >> _OFFSET_BITS

    def describe(self) -> str:
        return f"kafka://{self.bootstrap}/{self.topic}?group={self.group}"


class KafkaSourcePartition(SourcePartition):
    """The live consumer of a ``KafkaSource``."""

    def __init__(self, cfg: KafkaSource, ctx: SourceContext, resume_from: Any) -> None:
        from confluent_kafka import Consumer

        self._cfg, self._ctx = cfg, ctx
        self._messages = MessageDecoder(cfg.schema, ctx)
        self._empty = self._messages.empty  # nothing new yet
        self._resume = {int(p): int(o) for p, o in (resume_from or {}).get("offsets", {}).items()}
        self._next: dict[int, int] = {}
        self._assigned = False
        self._idle = IdleClock()
        self._failing_since: float | None = None
        self._down_since: float | None = None  # all brokers unreachable since then
        self._refused: str | None = None  # the broker refused the login or the certificate
        self._probed_at = -math.inf  # when a broker was last asked whether it answers
        self._said_at = -math.inf  # when the input last said why it does not end
        settings = {
            "error_cb": self._on_error,
            "bootstrap.servers": cfg.bootstrap,
            "group.id": cfg.group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 1000,
            "max.poll.interval.ms": 60000,
            "fetch.wait.max.ms": cfg.fetch_wait_ms,
            **CLIENT_SETTINGS,
            **security_settings(cfg.access, cfg.sasl),
            **cfg.options,
            # the end of the input is a fetch reply that says so, not a quiet spell: a fetch
            # over a slow link can take longer than stop_when_idle_s
            "enable.partition.eof": True,
        }
        self._owned: set[int] = set()  # partitions assigned now (and restored)
        self._restoring: set[int] = set()  # assigned, read only once the engine restored their state
        self._skipped: dict[int, int] = {}  # a restoring partition's first record fetched (dropped)
        self._at_end: dict[int, int] = {}  # the offset a fetch reply last said a partition ends at
        self._committed: dict[int, int] = {}  # the highest offset committed (or started from)
        self._pending: dict[int, int] = {}  # commits asked for by other threads
        self._commit_lock = threading.Lock()
        self._poll_thread: threading.Thread | None = None
        self._in_callback: threading.Thread | None = None  # the thread in a rebalance callback
        self._session_s = float(settings["session.timeout.ms"]) / 1000
        # a rebalance this member waits in longer than a rebalance may take (every member
        # rejoins within max.poll.interval.ms, a dead one is dropped after a session) will not
        # complete: a group coordinator that lost track of it (Tansu, when the member that was
        # to lead left while the others' JoinGroup waited, never answers their SyncGroup)
        self._join_limit_s = float(settings["max.poll.interval.ms"]) / 1000 + self._session_s
        self._joining_since: float | None = time.monotonic()  # waiting for an assignment since
        self._consumer = Consumer(settings)
        self._consumer.subscribe([cfg.topic], on_assign=self._on_assign, on_revoke=self._on_revoke)

    def _on_error(self, err: Any) -> None:
        from confluent_kafka import KafkaError, KafkaException

        # a lost connection starts the clock, and only proof that a broker answers stops it (a
        # record, or metadata at the deadline): librdkafka reports "all brokers down" once, or not
        # at all when the broker went away mid-join, and other errors say nothing of its return
        down = (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT)
        if err.code() in down and self._down_since is None:
            self._down_since = time.monotonic()
        reason = final_reason(KafkaException(err))
        if reason is not None and self._refused is None:  # raised by the next read: final
            self._refused = f"{reason}: {err.str()}"

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        self._joining_since = None
        self._assigned = True
        self._idle.reset()
        for tp in partitions:
            self._at_end.pop(tp.partition, None)
        if self._ctx.on_assign is not None:  # state moves with partitions: restored first
            # not paused: a pause next to an assignment can leave a partition paused for good
            # (librdkafka#5591), and a pause, seek and resume left some unread under load here
            consumer.assign(partitions)
            self._restoring.update(tp.partition for tp in partitions)
            self._ctx.on_assign([tp.partition for tp in partitions])
            return
        for tp in partitions:  # where this process's state says, else where the group says
            start = self._position(tp.partition)
            if start is not None:
                tp.offset = start
            self._owned.add(tp.partition)
        consumer.assign(partitions)

    def _position(self, partition: int) -> int | None:
        """The next offset of ``partition`` that the process's state has not seen: after the
        records handed out, else the restored checkpoint's (None: it has seen none)."""
        return self._next.get(partition, self._resume.get(partition))

    def _resume_restored(self) -> None:
        """Start the partitions whose state the engine has restored, where it says (else where
        the group says: the first record fetched meanwhile, if any)."""
        from confluent_kafka import TopicPartition

        assert self._ctx.restored is not None
        ready = {p: o for p, o in self._ctx.restored().items() if p in self._restoring}
        for p, offset in sorted(ready.items()):
            start = offset if offset is not None else self._skipped.get(p)
            if start is not None:
                self._consumer.seek(TopicPartition(self._cfg.topic, p, start))
            self._at_end.pop(p, None)  # read again from where the state says
            with self._commit_lock:
                self._restoring.discard(p)
                self._skipped.pop(p, None)
                self._owned.add(p)
                if offset is not None:
                    self._resume[p] = self._committed[p] = offset
        self._idle.reset()  # a restore is not idle input

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        self._joining_since = time.monotonic()
        self._idle.reset()  # a rebalance is under way: partitions may come back (not idle input)
        revoked = {tp.partition for tp in partitions}
        with self._commit_lock:  # commits a checkpoint asked for: the last chance to make them
            due = {p: o for p, o in self._pending.items() if p in revoked}
        if due:
            self._commit_now(due)
        on_revoke = self._ctx.on_revoke
        moves = on_revoke is not None  # the partition's state leaves with it
        if on_revoke is not None:
            self._in_callback = threading.current_thread()
            try:
                on_revoke(sorted(revoked))
            finally:
                self._in_callback = None
        with self._commit_lock:
            for p in revoked:  # no longer this consumer's to commit
                self._at_end.pop(p, None)
                self._restoring.discard(p)
                self._skipped.pop(p, None)
                self._owned.discard(p)
                self._committed.pop(p, None)
                self._pending.pop(p, None)
                if moves:  # else the process's state still holds what it read of p: its
                    self._next.pop(p, None)  # position stays, for the checkpoints and for
                    self._resume.pop(p, None)  # the partition's return

    def _answers(self) -> bool:
        """Whether a broker answers a metadata request now (then the outage is over)."""
        try:
            self._consumer.list_topics(self._cfg.topic, timeout=1.0)
        except Exception:  # noqa: BLE001 - KafkaException: no broker answered
            return False
        self._down_since = None
        return True

    def next_batch(self, max_rows: int) -> Batch | None:
        self._poll_thread = threading.current_thread()
        with self._commit_lock:
            pending, self._pending = self._pending, {}
        if pending:
            self._commit_now(pending)
        if self._restoring:
            self._resume_restored()
        from confluent_kafka import KafkaError

        msgs = self._take(max_rows)
        if self._refused is not None:
            raise SourceError(f"kafka at {self._cfg.bootstrap}: {self._refused}")
        if msgs:
            self._down_since = None
        elif self._down_since is not None:  # the brokers are away: not the end of the input
            # asked once a second whether they are back: waiting for a record could take until
            # the deadline once the input is all read, and one answer missed then (a reconnect
            # backing off) must not end the run
            now = time.monotonic()
            if now - self._probed_at >= 1.0:
                self._probed_at = now
                self._answers()
            if self._down_since is not None and now - self._down_since >= self._cfg.retry_s:
                raise SourceError(
                    f"kafka at {self._cfg.bootstrap} unreachable for {self._cfg.retry_s:g} s"
                    " (all brokers down)"
                )
            self._idle.reset()
            if self._joining_since is not None:  # no rebalance completes meanwhile
                self._joining_since = time.monotonic()
        elif self._joining_since is not None:
            waited = time.monotonic() - self._joining_since
            if waited >= self._join_limit_s:
                raise SourceError(
                    f"kafka {self._cfg.bootstrap} group {self._cfg.group!r}: no partition assignment"
                    f" after {waited:.0f} s, longer than a rebalance may take (max.poll.interval.ms"
                    " + session.timeout.ms): the group coordinator does not complete the rebalance"
                )
        records = []
        for m in msgs:
            err = m.error()
            if err is not None and err.code() == KafkaError._PARTITION_EOF:
                self._at_end[m.partition() or 0] = m.offset() or 0
            elif err is None and m.partition() in self._restoring:  # read again once restored
                self._skipped.setdefault(m.partition() or 0, m.offset() or 0)
            elif err is None:
                records.append(m)
            elif err.fatal() or not err.retriable():
                raise SourceError(f"kafka {self._cfg.bootstrap} topic {self._cfg.topic!r}: {err}")
        if not records:
            idle = self._cfg.stop_when_idle_s
            if idle is not None and self._idle.idle_s() >= idle:
                if self._assigned and self._may_stop(idle):
                    return None
                self._say_why_not_ended()
            return self._empty
        self._idle.handed_out()
        parts: list[int] = [m.partition() or 0 for m in records]
        offsets: list[int] = [m.offset() or 0 for m in records]
        for p, o in zip(parts, offsets, strict=True):
            self._next[p] = o + 1
        lines = [m.value() or b"" for m in records]
        ids = kafka_event_id(np.asarray(parts, dtype=np.int64), np.asarray(offsets, dtype=np.int64))
        headers: list[Any] = [m.headers() for m in records]
        return self._messages.batch(
            lines,
            ids,
            lambda i: {"partition": parts[i], "offset": offsets[i]},
            [_traceparent(h) for h in headers] if any(headers) else None,
        )

    def _take(self, max_rows: int) -> list[Any]:
        """Up to ``max_rows`` records (and fetch events): what the client holds already, else the
        first to arrive within the poll timeout and what came with it. One
        ``consume(max_rows, timeout)`` waits until ``max_rows`` records or the timeout: every
        record of a trickle would wait the whole poll timeout."""
        msgs: list[Any] = self._consumer.consume(num_messages=max_rows, timeout=0)
        if msgs:
            return msgs
        msgs = self._consumer.consume(num_messages=1, timeout=self._cfg.poll_timeout_s)
        if msgs and max_rows > 1:
            msgs.extend(self._consumer.consume(num_messages=max_rows - 1, timeout=0))
        return msgs

    def _say_why_not_ended(self) -> None:
        """(Idle past ``stop_when_idle_s``, the input not ended) say why, every 30 s at most: an
        input that waits for its group should not look like a hang."""
        now = time.monotonic()
        if now - self._said_at < 30:
            return
        self._said_at = now
        behind = self._not_at_end()
        if not self._assigned:
            why = "the group has assigned this member no partition yet"
        elif behind:
            why = f"partitions {behind} have not been read to their end yet (a fetch under way)"
        else:
            held = sorted(self._owned | self._restoring)
            why = f"this member holds partitions {held}; it waits for the group to assign the rest"
        log.warning(
            "kafka %s topic %r: no record for %.0f s, but the input does not end: %s",
            self._cfg.bootstrap, self._cfg.topic, self._idle.idle_s(), why,
        )  # fmt: skip

    def _not_at_end(self) -> list[int]:
        """The partitions held that a fetch reply has not yet said end where this consumer is."""
        return sorted(p for p in self._owned if self._at_end.get(p, -1) < self._next.get(p, 0))

    def _may_stop(self, idle_s: float) -> bool:
        """(Idle for ``idle_s``) whether the input may end: every partition held read to its end
        (as a fetch reply said), and the consumer holds the whole topic or it has waited a
        session timeout more (a dead member's partitions come back by then)."""
        if self._restoring or self._not_at_end():
            return False
        if self._idle.idle_s() >= idle_s + self._session_s:
            return True
        try:
            topic = self._consumer.list_topics(self._cfg.topic, timeout=1.0).topics[self._cfg.topic]
        except Exception:  # noqa: BLE001 - KafkaException, KeyError: not known now, wait
            return False
        return len(self._owned | self._restoring) >= len(topic.partitions)

    def snapshot(self) -> Any:
        return {"offsets": {str(p): o for p, o in sorted({**self._resume, **self._next}.items())}}

    @property
    def bootstrap(self) -> str:
        return self._cfg.bootstrap

    def transaction_offsets(self) -> tuple[list[Any], Any]:
        """The offsets after everything handed out and the consumer's group metadata, for a
        transactional producer's ``send_offsets_to_transaction`` (the group's offsets then
        move with the outputs)."""
        from confluent_kafka import TopicPartition

        offsets = [TopicPartition(self._cfg.topic, p, o) for p, o in sorted(self._next.items())]
        return offsets, self._consumer.consumer_group_metadata()

    def commit(self, position: Any) -> None:
        """Commit ``position``'s offsets: at once from the polling thread (a rebalance callback
        included), else at the next poll, so that commits and rebalances never interleave: a
        partition revoked meanwhile is not committed, and an offset never moves back."""
        offsets = {int(p): int(o) for p, o in position["offsets"].items()}
        me = threading.current_thread()
        if self._poll_thread is None or me is self._poll_thread or me is self._in_callback:
            self._commit_now(offsets)
            return
        with self._commit_lock:
            for p, o in offsets.items():
                self._pending[p] = max(o, self._pending.get(p, o))

    def _commit_now(self, offsets: dict[int, int]) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        with self._commit_lock:
            ahead = {p: o for p, o in offsets.items()
                     if p in self._owned and o > self._committed.get(p, -1)}  # fmt: skip
        if not ahead:
            return
        try:
            tps = [TopicPartition(self._cfg.topic, p, o) for p, o in sorted(ahead.items())]
            self._consumer.commit(offsets=tps, asynchronous=False)
        except KafkaException:
            return  # the next checkpoint commits again; the checkpoint holds the positions
        with self._commit_lock:
            for p, o in ahead.items():
                if p in self._owned:
                    self._committed[p] = max(o, self._committed.get(p, o))

    def close(self) -> None:
        with self._commit_lock:
            pending, self._pending = self._pending, {}
        if pending:
            self._commit_now(pending)
        self._consumer.close()


def _traceparent(headers: Any) -> bytes | None:
    """The ``traceparent`` of a message's headers (a list of key/value pairs), if any."""
    return next((value for key, value in headers if key == "traceparent"), None) if headers else None
