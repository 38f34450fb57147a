"""Kafka sink (``confluent-kafka``): each output once in the topic, through an idempotent or a
transactional producer whose replays after a restart are skipped by event id.

Rows are produced as JSON (the same line as the file sink), keyed by the engine id, to partition
``engine id % partitions``. The sink's position is the next offset of each partition, learnt
from delivery reports; a checkpoint flushes and records it.

With ``transactional_id`` the rows of one checkpoint interval form one Kafka transaction,
committed at the checkpoint's barrier together with the offsets of the pipeline's Kafka source
(``send_offsets_to_transaction``, when it reads from the same cluster): a ``read_committed``
reader sees an interval's outputs all at once and the consumer group's offsets move with them.
A restart fences the previous producer (``init_transactions``), which aborts its open
transaction. Without checkpoints a transaction is committed every ``transaction_max_s``.

Keyed state in changelog topics on the same cluster (``--partition-state changelog``) is
written in the same transaction (``take_state_writes``): a checkpoint's ``snapshot`` then only
flushes and notes the source offsets, the changelog records are produced into the open
transaction, and ``sync`` commits outputs, changelog records and offsets at once; rows the
pipeline delivers in between wait for that commit, so a transaction holds one interval exactly.

With ``compact`` (several workers of a group writing one topic) the topic is compacted and
nothing is skipped: each event id's record may appear more than once, always with the same
value, and a reader keeps one per key (as compaction eventually does).

After a restart from a checkpoint, the sink reads the records a ``read_committed`` reader finds
in each partition after the checkpointed offset and notes their keys (engine ids); a row the
replay makes again under a noted key is skipped, once for each time the key was written. The
replay may interleave the input's partitions in another order than before the crash (several
input partitions, several model instances): skipping by key does not depend on it, as long as
a replayed row has the value it had (keyed state restored with the positions makes it so). With
transactions on Apache Kafka there is nothing to skip except when the process died between a
transaction's commit and the checkpoint's manifest; the Tansu broker the tests use shows aborted
and fenced transactions' records to ``read_committed`` readers, and those are skipped too. The
topic is assumed to be written by this pipeline only. This reads the records after the
checkpoint (at most one checkpoint interval of output, their keys held until replayed; until
then checkpoints keep the position they start at, so a restart before the replay notes them
again), and on a first start counts the whole partition, once.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from aisp.batch import Batch
from aisp.connectors.access import Access
from aisp.connectors.kafka.client import (
    CLIENT_SETTINGS,
    GRACE_S,
    CallStuck,
    bounded,
    error_code,
    final_reason,
    security_settings,
)
from aisp.errors import SinkError
from aisp.retry import call_with_retry
from aisp.sinks.base import RowEncoder, Sink, SinkPartition

if TYPE_CHECKING:
    from aisp.ingest.base import SourcePartition

__all__ = ["KafkaSink"]


@dataclass(frozen=True, kw_only=True)
class KafkaSink(Sink):
    """Produces rows to ``topic`` once each (see the module docstring)."""

    topic: str
    bootstrap: str = "127.0.0.1:9092"
    columns: Sequence[str] | None = None
    partitions: int = 1
    """Partitions of the topic (created with this many if missing)."""
    flush_timeout_s: float = 30.0
    retry_s: float = 30.0
    """How long a record may wait for an unreachable broker before the sink fails."""
    transactional_id: str | None = None
    """Write in Kafka transactions under this id, one per checkpoint interval (see the module
    docstring); None: an idempotent producer without transactions."""
    transaction_max_s: float = 10.0
    """Commit an open transaction after this long even without a checkpoint (the broker aborts
    transactions older than ``transaction.timeout.ms``, 60 s by default)."""
    compact: bool = False
    """Create the topic compacted and count nothing at a restart: a replay writes its rows again
    under the same keys (the event ids), which compaction and readers that keep one record per
    key collapse. For several workers of a group writing one topic (each replaying what another
    wrote), where counting records after a position cannot tell whose they are."""
    options: Mapping[str, Any] = field(default_factory=dict)
    access: Access = Access()
    """Credentials and TLS (``aisp.connectors.access``)."""
    sasl: str | None = None
    """The SASL mechanism of the login (``PLAIN``, ``SCRAM-SHA-256``, ``SCRAM-SHA-512``)."""

    def open(self) -> SinkPartition:
        return _KafkaWriter(self, None)

    def resume(self, position: Any) -> SinkPartition:
        return _KafkaWriter(self, {int(p): int(o) for p, o in position["next"].items()})

    def describe(self) -> str:
        return f"kafka://{self.bootstrap}/{self.topic}"


def _keys_after(
    bootstrap: str, topic: str, partition: int, start: int, *, keys: bool, timeout_s: float = 60.0,
    settings: dict[str, Any] | None = None,
) -> tuple[int, Counter[int]]:  # fmt: skip
    """The records in ``topic``/``partition`` from offset ``start`` to the end, and (``keys``:
    after a restart; a first start skips nothing) how often each key, an engine id, occurs
    among them, read until a fetch reply says the partition ends there (Tansu's high watermarks
    are per record batch, so they cannot be used; a quiet spell is no proof either: a loaded
    machine or a slow link holds replies back and would undercount). Not at the end within
    ``timeout_s``: a ``SinkError``."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    c = Consumer(
        {
            **CLIENT_SETTINGS,
            **(settings or {}),
            "bootstrap.servers": bootstrap,
            "group.id": "aisp-count",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    try:
        c.assign([TopicPartition(topic, partition, start if start > 0 else OFFSET_BEGINNING)])
        n, found, deadline = 0, Counter[int](), time.monotonic() + timeout_s
        while True:
            msgs = c.consume(num_messages=10_000, timeout=0.1)
            good = [m for m in msgs if m.error() is None]
            n += len(good)
            if keys:
                found.update(int(m.key() or 0) for m in good)
            if msgs and (err := msgs[-1].error()) is not None and err.code() == KafkaError._PARTITION_EOF:
                return n, found
            if time.monotonic() > deadline:
                raise SinkError(
                    f"kafka topic {topic!r} partition {partition} at {bootstrap}: not read to its end"
                    f" in {timeout_s:g} s (to find the records a replay must skip)"
                )
    finally:
        c.close()


class _InTransaction:
    """A transactional writer's producer as changelog writes see it: a record produced goes
    into the open transaction (one begins when none is open); ``BufferError`` when the local
    queue is full, as with a producer."""

    def __init__(self, writer: _KafkaWriter) -> None:
        self._writer = writer

    def produce(
        self, topic: str, *, key: bytes, value: bytes | None, partition: int, headers: Any, on_delivery: Any
    ) -> None:
        self._writer.produce_in_transaction(
            topic, key=key, value=value, partition=partition, headers=headers, on_delivery=on_delivery
        )

    def poll(self, timeout: float) -> int:
        return int(self._writer._producer.poll(timeout))

    def flush(self, timeout: float) -> int:
        return int(self._writer._producer.flush(timeout))


class _KafkaWriter(SinkPartition):
    def __init__(self, cfg: KafkaSink, resume: dict[int, int] | None) -> None:
        from confluent_kafka import KafkaError, KafkaException, Producer
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        self._cfg = cfg
        secured = {**CLIENT_SETTINGS, **security_settings(cfg.access, cfg.sasl), **cfg.options}
        admin = AdminClient({"bootstrap.servers": cfg.bootstrap, **secured})
        topics = call_with_retry(
            lambda: admin.list_topics(timeout=5).topics, retry_on=(KafkaException,),
            give_up_after_s=cfg.retry_s, what=f"kafka at {cfg.bootstrap}", error=SinkError,
            final=final_reason,
        )  # fmt: skip
        if cfg.topic not in topics:
            config = {"cleanup.policy": "compact"} if cfg.compact else {}
            for f in admin.create_topics([NewTopic(cfg.topic, cfg.partitions, 1, config=config)]).values():
                try:
                    f.result(10)
                except Exception as exc:
                    if error_code(exc) != KafkaError.TOPIC_ALREADY_EXISTS:
                        raise SinkError(f"cannot create kafka topic {cfg.topic!r}: {exc}") from exc
        self._errors: list[str] = []
        self._producer = Producer(
            {
                "bootstrap.servers": cfg.bootstrap,
                "enable.idempotence": True,
                "linger.ms": 5,
                "message.timeout.ms": int(cfg.retry_s * 1000),  # then a clear error, not a hang
                **({"transactional.id": cfg.transactional_id} if cfg.transactional_id else {}),
                **secured,
            }
        )
        self._stuck = False  # a call never returned: the producer is not touched again
        self._txn_since: float | None = None  # when the open transaction began
        self._txn_lock = threading.RLock()  # begin, produce into, commit: one thread at a time
        self._sources: list[Any] = []  # Kafka source partitions whose offsets go with a commit
        self._deferred = False  # commits wait for ``sync`` (changelog writes join the transaction)
        self._pending: list[tuple[list[Any], Any]] | None = None  # offsets noted by ``snapshot``
        self._committed = threading.Event()  # no commit pending: rows may open the next transaction
        self._committed.set()
        if cfg.transactional_id:  # fences an earlier producer (its open transaction is aborted)
            self._call("init_transactions", cfg.retry_s)
        self._next: dict[int, int] = {}
        self._skip: dict[int, Counter[int]] = {}
        self._skip_from: dict[int, int] = {}  # where the records to skip begin, per partition
        for p in range(cfg.partitions):
            start = (resume or {}).get(p, 0)
            if cfg.compact:  # replays are written again, under the same keys
                self._next[p] = start
                continue
            found, keys = _keys_after(
                cfg.bootstrap,
                cfg.topic,
                p,
                start,
                keys=resume is not None,
                timeout_s=max(60.0, cfg.retry_s),
                settings=secured,
            )
            self._next[p] = start + found
            if resume is not None and keys:
                self._skip[p] = keys  # produced after the checkpoint: the replay makes them again
                self._skip_from[p] = start
        self._encoder = RowEncoder(cfg.columns)
        self.skipped = 0

    def _check_usable(self) -> None:
        if self._stuck:
            raise SinkError(f"kafka {self._cfg.topic!r}: the producer is stuck in an earlier call")

    def _call(self, method: str, *args: Any) -> None:
        """A transactional producer call; a failure that leaves the transaction unusable fails
        the sink (the run restarts from its last checkpoint), a retriable one is retried."""
        from confluent_kafka import KafkaException

        self._check_usable()
        deadline = time.monotonic() + self._cfg.retry_s
        timeout = next((float(a) for a in reversed(args) if isinstance(a, (int, float))), 0.0)
        while True:
            try:
                bounded(method, functools.partial(getattr(self._producer, method), *args), timeout + GRACE_S)
                return
            except CallStuck as exc:  # librdkafka ignored its timeout: the producer is lost
                self._stuck = True
                self._pending = None
                self._committed.set()
                raise SinkError(
                    f"kafka {self._cfg.topic!r}: {exc} (the Kafka client hangs; the run stops, and"
                    " a restart resumes from the last checkpoint)"
                ) from exc
            except KafkaException as exc:
                err = exc.args[0]
                if err.retriable() and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                if err.txn_requires_abort():
                    abort = functools.partial(self._producer.abort_transaction, self._cfg.flush_timeout_s)
                    try:
                        bounded("abort_transaction", abort, self._cfg.flush_timeout_s + GRACE_S)
                    except CallStuck:
                        self._stuck = True
                    self._txn_since = None
                self._pending = None
                self._committed.set()  # rows waiting for the commit see the failure
                raise SinkError(f"kafka {self._cfg.topic!r}: {method} failed: {err.str()}") from exc

    def bind_sources(self, sources: Mapping[str, SourcePartition]) -> None:
        from aisp.connectors.kafka.source import KafkaSourcePartition

        self._sources = [
            part
            for part in sources.values()
            if isinstance(part, KafkaSourcePartition) and part.bootstrap == self._cfg.bootstrap
        ]

    def take_state_writes(self, states: Any) -> bool:
        from aisp.connectors.kafka.changelog import ChangelogStates

        if not (
            self._cfg.transactional_id
            and isinstance(states, ChangelogStates)
            and states.bootstrap == self._cfg.bootstrap
        ):
            return False
        self._deferred = True
        states.write_through(_InTransaction(self))
        return True

    def produce_in_transaction(self, topic: str, **kwargs: Any) -> None:
        with self._txn_lock:
            self._begin()
            self._producer.produce(topic, **kwargs)

    def _begin(self) -> None:
        with self._txn_lock:
            if self._cfg.transactional_id and self._txn_since is None:
                self._call("begin_transaction")
                self._txn_since = time.monotonic()

    def _offsets(self) -> list[tuple[list[Any], Any]]:
        """The Kafka sources' offsets after everything handed out, with their group metadata."""
        return [part.transaction_offsets() for part in self._sources]

    def _commit(self, offsets: list[tuple[list[Any], Any]] | None) -> None:
        """Commit the open transaction, with the sources' ``offsets`` when at a barrier."""
        with self._txn_lock:
            if self._txn_since is None:
                return
            for tps, group in offsets or ():
                if tps:
                    self._call("send_offsets_to_transaction", tps, group, self._cfg.flush_timeout_s)
            self._call("commit_transaction", self._cfg.flush_timeout_s)
            self._txn_since = None

    def _delivered(self, err: Any, msg: Any) -> None:
        """A delivery report. It must not raise: confluent-kafka 2.16 turns an exception in a
        callback into a ``SystemError`` from ``flush``, which stopped a run after a blackhole."""
        try:
            if err is not None:
                self._errors.append(str(err))
                return
            offset = msg.offset()
            if offset is None or offset < 0:  # written, its offset unknown: a retry the broker had
                return  # already taken (the reply was lost); the next report moves the position
            p = msg.partition()
            self._next[p] = max(self._next.get(p, 0), offset + 1)
        except Exception as exc:  # noqa: BLE001 - said by the next write or flush, as a SinkError
            self._errors.append(f"a delivery report failed: {type(exc).__name__}: {exc}")

    def write(self, batch: Batch) -> None:
        if not batch.num_rows:
            return
        if not self._committed.wait(self._cfg.retry_s):
            raise SinkError(f"kafka {self._cfg.topic!r}: a checkpoint's transaction was not committed")
        lines = self._encoder.encode(batch).split(b"\n")
        ids = batch.ids
        parts = (ids % self._cfg.partitions).astype(np.int64).tolist()
        traced = batch.traceparents or {}
        for i, (key, p) in enumerate(zip(ids.tolist(), parts, strict=True)):
            if self._skip and self._replayed(p, key):
                continue
            if self._txn_since is None:
                self._begin()
            while True:
                try:
                    self._producer.produce(
                        self._cfg.topic,
                        value=lines[i],
                        key=str(key),
                        partition=p,
                        on_delivery=self._delivered,
                        headers=[("traceparent", traced[key])] if key in traced else None,
                    )
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    self._producer.poll(0.05)
        self._producer.poll(0)
        if self._errors:
            raise SinkError(f"kafka {self._cfg.topic!r}: delivery failed: {self._errors[0]}")
        if self._txn_since is not None and time.monotonic() - self._txn_since >= self._cfg.transaction_max_s:
            self.flush()
            self._commit(None)

    def _replayed(self, partition: int, key: int) -> bool:
        """Whether the row ``key`` was written after the checkpoint already (then it is skipped,
        once for each time it was written)."""
        written = self._skip.get(partition)
        if not written or not written[key]:
            return False
        written[key] -= 1
        if not written[key]:
            del written[key]
            if not written:
                del self._skip[partition], self._skip_from[partition]
        self.skipped += 1
        return True

    def flush(self) -> None:
        self._check_usable()
        left = self._producer.flush(self._cfg.flush_timeout_s)
        if left or self._errors:
            raise SinkError(
                f"kafka {self._cfg.topic!r}: {left} records undelivered after {self._cfg.flush_timeout_s:g} s"
                + (f"; {self._errors[0]}" if self._errors else "")
            )

    def snapshot(self) -> Any:
        self.flush()
        if self._deferred:  # committed by ``sync``, after the changelog records join
            self._committed.clear()
            self._pending = self._offsets()
        elif self._txn_since is not None:
            self._commit(self._offsets())
        # a partition whose noted rows are not all replayed yet keeps the position they start at,
        # so that a restart before they are notes them again (the state does not cover them yet)
        return {"next": {str(p): self._skip_from.get(p, o) for p, o in sorted(self._next.items())}}

    def sync(self) -> None:
        if self._pending is None:
            return
        try:
            self.flush()
            self._commit(self._pending)
        finally:
            self._pending = None
            self._committed.set()

    def close(self) -> None:
        if self._stuck:  # the stuck call still holds the producer: leave it to the process exit
            return
        self.sync()
        self.flush()
        if self._txn_since is not None:
            self._commit(self._offsets())
