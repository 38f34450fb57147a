"""Keyed state in changelog topics: the workers of a consumer group share nothing but the broker.

Each keyed step and window step writes the keys (windows) it changed to its changelog topic
``<group>-<input topic>-<step>-changelog`` (compacted, as many partitions as the input, the
state of input partition ``p`` in changelog partition ``p``), at each checkpoint and when a
partition is taken away, before the input offsets are committed. A record's key is the msgpack
of the state key (of a window's key, start and opening event), its value the input offset the checkpoint
covers (8 bytes, big-endian) and the key's state row packed in the step's row layout, which a
record written before them gives; a key (window) gone is a tombstone, with the covered offset in
its header ``o``. How far each partition has read in event time is a changelog of its own
(``_event_time``), so windows decide on after a takeover as they would have.

A worker that is assigned a partition reads the partition of every changelog of the group and
input from the start to an end marker it writes first (so it knows where the end is without
trusting high watermarks), while the partition's input waits. It keeps each key's last record
whose offset is at most the group's committed offset for the partition: a record past it comes
from a checkpoint whose commit never landed (its worker died in between), and is skipped. The
keys of such records are written again at the worker's first checkpoint of the partition (their
restored value, or a tombstone), so a later restore never takes the stale record once the
committed offset has moved past it. A worker that owned the partition before (at the previous
rebalance, or before a restart) starts from its local copy and reads only what follows it
(``local_copy``); one that keeps a standby copy reads only the tail after it (``standby``). A
key's state is written only when it changed since it was last written or restored (a vectorised
comparison of the rows).

Replays are deterministic (a partition's records in offset order, one owner at a time), so the
restored state and the committed offset always agree. Outputs that must be exactly-once across
workers go to a sink that deduplicates by event id (Redis Streams, JetStream); see the README.

With a transactional Kafka output on the same cluster, the changelog records are written in its
transactions (``write_through``), which commit them with the outputs and the input offsets.
Restores and standbys still read uncommitted records too, and keep to the committed offset as
above: a worker that died inside a transaction leaves it open until the broker aborts it (after
``transaction.timeout.ms`` on Apache Kafka; never on Tansu), and a ``read_committed`` reader
would wait for that before reading on.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec
import numpy.typing as npt
import pyarrow as pa

from aisp.connectors.kafka.client import CLIENT_SETTINGS, error_code
from aisp.connectors.kafka.local_copy import LocalCopies, LocalCopy, Rows, merge_tail
from aisp.connectors.kafka.records import changes, record_sets, state_columns, to_checkpoint
from aisp.connectors.kafka.standby import COVERS, END, LAYOUT, OFFSET_BEGINNING, ChangelogLog, Standby, ring
from aisp.errors import ConfigError, StateError
from aisp.state.checkpoint import Checkpoint
from aisp.state.store import decode_keys, encode_rows

__all__ = ["ChangelogStates", "changelog_topic"]

log = logging.getLogger("aisp.changelog")

_LEGAL = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def changelog_topic(group: str, topic: str, step: str) -> str:
    """The changelog topic of ``step`` for the group ``group`` reading ``topic``.

    >>> changelog_topic("fraud", "events", "user_stats")
    'fraud-events-user_stats-changelog'
    """
    name = f"{group}-{topic}-{step}-changelog"
    if not set(name) <= _LEGAL or len(name) > 249:
        raise ConfigError(
            f"changelog topic {name!r} is not a legal Kafka topic name: group, input topic and step"
            " ids may use letters, digits, '.', '_' and '-' only"
        )
    return name


class Records(Protocol):
    """Where changelog records are produced: the changelog's own producer, or a transactional
    output's open transaction."""

    def produce(
        self, topic: str, *, key: bytes, value: bytes | None, partition: int, headers: Any, on_delivery: Any
    ) -> None: ...

    def poll(self, timeout: float) -> int: ...

    def flush(self, timeout: float) -> int: ...


@dataclass
class _Owned:
    """What a worker knows of a partition it owns: per step, the keys and rows last written or
    restored, and the keys whose stale records must be written over."""

    base: dict[str, tuple[pa.Array, dict[str, npt.NDArray[Any]]]] = field(default_factory=dict)
    stale: dict[str, set[bytes]] = field(default_factory=dict)
    covers: int = -1
    """The input offset last written or restored: an older capture is never written after it."""


class ChangelogStates:
    """Keyed state per input partition in changelog topics (see the module docstring); the
    ``PartitionStateStore`` of ``aisp run --partition-state changelog``."""

    written_before_outputs = True

    def __init__(
        self,
        bootstrap: str,
        group: str,
        topic: str,
        pipeline: str,
        *,
        standby_replicas: int = 0,
        restore_timeout_s: float = 300.0,
        local_dir: str | Path | None = None,
        options: dict[str, Any] | None = None,
        security: dict[str, Any] | None = None,
    ) -> None:
        """``security``: librdkafka's login and TLS settings of the input's broker
        (``aisp.connectors.kafka.client.security_settings``), for every client of the changelogs."""
        from confluent_kafka import Consumer, Producer
        from confluent_kafka.admin import AdminClient

        self.bootstrap, self._group, self._topic, self._pipeline = bootstrap, group, topic, pipeline
        self._restore_timeout_s = restore_timeout_s
        self._prefix = f"{group}-{topic}-"
        secured = dict(security or {})
        self._admin = AdminClient({"bootstrap.servers": bootstrap, **CLIENT_SETTINGS, **secured})
        meta = self._admin.list_topics(topic, timeout=30).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise ConfigError(f"changelog state needs the input topic {topic!r} at {bootstrap} to exist")
        self.partitions = len(meta.partitions)
        self._errors: list[str] = []
        self._producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "linger.ms": 5,
                "error_cb": lambda err: None,  # delivery reports say what failed
                **CLIENT_SETTINGS,
                **secured,
                **(options or {}),
            }
        )
        self._records: Records = self._producer
        self._offsets = Consumer(  # reads the group's committed offsets; never joins the group
            {
                "bootstrap.servers": bootstrap,
                "group.id": group,
                "enable.auto.commit": False,
                **CLIENT_SETTINGS,
                **secured,
            }
        )
        self._reader = Consumer(  # reads changelogs at takeovers (connected once: a new one takes ~0.5 s)
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"{group}-restore",
                "enable.auto.commit": False,
                "isolation.level": "read_uncommitted",  # see the module docstring
                "fetch.max.bytes": 64 << 20,
                "fetch.wait.max.ms": 20,  # the end marker is there: no wait for more to come
                **CLIENT_SETTINGS,
                **secured,
            }
        )
        self._created: set[str] = set()
        self._owned: dict[int, _Owned] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._claiming = threading.Lock()  # held by a claim: close waits for it to stop
        self._closing = threading.Event()
        self.restored_records = 0
        self.written_records = 0
        self.restore_seconds = 0.0
        self._counts = {"claimed": 0, "from_standby": 0, "from_local": 0, "restore_s": 0.0}
        self._local = LocalCopies(local_dir) if local_dir is not None else None
        self._ends: dict[tuple[str, int], int] = {}  # (changelog, partition) -> offset after the last known
        self._standby_replicas = standby_replicas
        self._standby: Standby | None = None
        if standby_replicas > 0:
            self._standby = Standby(bootstrap, group, topic, self._topics, security=secured)
            self._standby.start()
            self._want()

    @property
    def owned(self) -> list[int]:
        with self._lock:
            return sorted(self._owned)

    def write_through(self, records: Records) -> None:
        """Produce changelog records to ``records`` (a transactional output's transaction)."""
        self._records = records

    # -- topics -------------------------------------------------------------------------------
    def _topics(self) -> dict[str, str]:
        """The changelog topics of this group and input: step id -> topic."""
        names = self._admin.list_topics(timeout=30).topics
        return {
            name[len(self._prefix) : -len("-changelog")]: name
            for name in names
            if name.startswith(self._prefix) and name.endswith("-changelog")
        }

    def _ensure(self, step: str) -> str:
        from confluent_kafka import KafkaError
        from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

        name = changelog_topic(self._group, self._topic, step)
        if name in self._created:
            return name
        new = NewTopic(name, self.partitions, 1, config={"cleanup.policy": "compact"})
        for f in self._admin.create_topics([new]).values():
            try:
                f.result(30)
            except Exception as exc:
                if error_code(exc) != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise StateError(f"cannot create changelog topic {name!r}: {exc}") from exc
        self._created.add(name)
        return name

    # -- restore ------------------------------------------------------------------------------
    def _committed(self, partition: int) -> int | None:
        from confluent_kafka import TopicPartition

        (tp,) = self._offsets.committed([TopicPartition(self._topic, partition)], timeout=30)
        if tp.error is not None:
            raise StateError(
                f"input partition {partition}: the group's committed offset is unknown: {tp.error}"
            )
        return tp.offset if tp.offset >= 0 else None

    def _tail(self, name: str, partition: int, copy: ChangelogLog) -> None:
        """Read ``name``/``partition`` into ``copy`` from where it stands to an end marker
        written now (see the module docstring)."""
        from confluent_kafka import TopicPartition

        token = uuid.uuid4().hex.encode()
        self._producer.produce(name, key=END, value=token, partition=partition)
        self._flush(name, self._producer)
        reader = self._reader
        deadline = time.monotonic() + self._restore_timeout_s
        try:
            reader.assign([TopicPartition(name, partition, copy.next)])
            while time.monotonic() < deadline and not self._closing.is_set():
                if copy.add_messages(reader.consume(num_messages=50_000, timeout=0.05), token):
                    return
        finally:
            reader.unassign()
        if self._closing.is_set():
            raise StateError(f"changelog {name!r} partition {partition}: restore stopped (closing)")
        raise StateError(
            f"changelog {name!r} partition {partition}: not read to its end in {self._restore_timeout_s:g} s"
        )

    def claim(self, partition: int) -> Checkpoint | None:
        """Restore ``partition`` from its changelogs (see the module docstring), from a standby
        copy or a local copy when there is one: its state, and its committed offset as where to
        start; None when it has neither."""
        with self._claiming:
            if self._closing.is_set():
                raise StateError(f"input partition {partition}: not restored (closing)")
            return self._claim(partition)

    def _claim(self, partition: int) -> Checkpoint | None:
        t0 = time.monotonic()
        committed = self._committed(partition)
        warm = self._standby.take(partition) if self._standby is not None else {}
        local = self._local.load(partition, committed) if self._local is not None and not warm else None
        owned = _Owned()
        tables: dict[str, pa.Table] = {}
        event_time: dict[str, int] = {}
        read = 0
        steps = self._topics()
        for step, name in sorted(steps.items()):
            start = local.ends.get(name) if local is not None else None
            from_local = start is not None
            copy = warm.get(name) or ChangelogLog(next=start if start is not None else OFFSET_BEGINNING)
            before = copy.records
            copy.settle(committed)
            self._tail(name, partition, copy)
            self._ends[(name, partition)] = copy.next
            read += copy.records - before
            keys, values, stale = copy.resolve()
            self._created.add(name)
            rows: Rows | None = None
            columns = state_columns(name, copy.layout, values) if keys else {}
            if from_local:
                assert local is not None
                gone = [k for k, (_, v) in copy.final.items() if v is None]
                rows = merge_tail(name, local.steps.get(step), keys, columns, gone)
                stale |= local.stale.get(step, set())
            elif keys:
                rows = pa.array(decode_keys(b"", keys)), columns
            owned.stale[step] = stale
            if rows is None or not len(rows[0]):
                continue
            owned.base[step] = rows
            to_checkpoint(step, rows, tables, event_time)
        owned.covers = committed if committed is not None else -1
        with self._lock:
            self._owned[partition] = owned
        self.restored_records += read
        self.restore_seconds = time.monotonic() - t0
        self._counts["claimed"] += 1
        self._counts["from_standby"] += bool(warm)
        self._counts["from_local"] += local is not None
        self._counts["restore_s"] += self.restore_seconds
        source = ", the tail of a standby copy" if warm else ", the tail after a local copy" if local else ""
        log.info(
            "input partition %d: %d changelogs read in %.3f s (%d records%s), committed offset %s",
            partition, len(steps), self.restore_seconds, read, source, committed,
        )  # fmt: skip
        self._want()
        if committed is None:
            return None
        meta = {
            "pipeline": self._pipeline,
            "partition": partition,
            "offset": committed,
            "event_time": event_time,
        }
        return Checkpoint(0, Path(f"{self._prefix}*-changelog[{partition}]"), meta, tables)

    # -- checkpoints --------------------------------------------------------------------------
    def write(self, partition: int, tables: dict[str, pa.Table], meta: dict[str, Any]) -> bool:
        """Write the keys of ``partition`` that changed since they were last written (see the
        module docstring); False when the partition was released meanwhile. The tables are kept
        to compare the next write with: the caller must not change them afterwards."""
        with self._write_lock:  # writes never interleave, and never go back in offsets
            with self._lock:
                owned = self._owned.get(partition)
            if owned is None or int(meta["offset"]) < owned.covers:
                return False
            owned.covers = int(meta["offset"])
            self._write(partition, owned, tables, meta)
            if self._local is not None and self._local.due(partition):
                self._save(partition, owned)
            return True

    def _save(self, partition: int, owned: _Owned) -> None:
        """Keep a local copy of ``partition``'s state as last written (see ``local_copy``)."""
        assert self._local is not None
        names = {
            step: changelog_topic(self._group, self._topic, step) for step in {*owned.base, *owned.stale}
        }
        ends = {n: self._ends[(n, partition)] for n in names.values() if (n, partition) in self._ends}
        steps = {step: rows for step, rows in owned.base.items() if names[step] in ends}
        stale = {step: keys for step, keys in owned.stale.items() if names[step] in ends}
        self._local.save(partition, LocalCopy(owned.covers, ends, steps, stale))

    def _write(
        self, partition: int, owned: _Owned, tables: dict[str, pa.Table], meta: dict[str, Any]
    ) -> None:
        covers = int(meta["offset"]).to_bytes(COVERS, "big")
        tombstone_headers = [("o", str(int(meta["offset"])).encode())]
        names: list[str] = []
        for step, keys, columns in record_sets(tables, meta):
            changed, gone = changes(keys, columns, owned.base.get(step), owned.stale.get(step, set()))
            if not changed.any() and not gone:
                owned.base[step] = (keys, columns)
                continue
            name = self._ensure(step)
            names.append(name)
            picked = keys.filter(pa.array(changed)).to_pylist()
            rows = {c: col[changed] for c, col in columns.items()}
            record_keys, values, descr = encode_rows(b"", picked, rows)
            self._produce(name, LAYOUT, msgspec.json.encode(descr), partition)
            for k, v in zip(record_keys, values, strict=True):
                self._produce(name, k, covers + v, partition)
            for k in gone:
                self._produce(name, k, None, partition, tombstone_headers)
            self.written_records += len(record_keys) + len(gone)
            owned.base[step] = (keys, columns)
            owned.stale.pop(step, None)
        for name in names:
            self._flush(name)

    def _produce(
        self, name: str, key: bytes, value: bytes | None, partition: int, headers: Any = None
    ) -> None:
        while True:
            try:
                self._records.produce(
                    name,
                    key=key,
                    value=value,
                    partition=partition,
                    headers=headers,
                    on_delivery=self._delivered,
                )
                return
            except BufferError:  # the local queue is full: let deliveries drain it
                self._records.poll(0.05)

    def _delivered(self, err: Any, msg: Any) -> None:
        if err is not None:
            self._errors.append(str(err))
            return
        where = (msg.topic(), msg.partition())
        self._ends[where] = max(self._ends.get(where, 0), msg.offset() + 1)

    def _flush(self, name: str, records: Records | None = None) -> None:
        left = (records or self._records).flush(60)
        if left or self._errors:
            raise StateError(
                f"changelog {name!r}: {left} records undelivered"
                + (f"; {self._errors[0]}" if self._errors else "")
            )

    def stats(self) -> dict[str, float]:
        """Partitions taken over (from a standby copy), seconds spent restoring, changelog
        records read to restore and written."""
        return {
            **self._counts,
            "restore_s": round(self._counts["restore_s"], 3),
            "records_read": self.restored_records,
            "records_written": self.written_records,
        }

    def release(self, partition: int) -> None:
        with self._write_lock:
            with self._lock:
                owned = self._owned.pop(partition, None)
            if owned is not None and self._local is not None:
                self._save(partition, owned)
        self._want()

    def _want(self) -> None:
        """Keep warm copies of the ``standby_replicas`` partitions after the owned ones."""
        if self._standby is not None:
            self._standby.want(ring(self.owned, self.partitions, self._standby_replicas))

    def close(self) -> None:
        self._closing.set()
        with self._claiming:  # a claim under way stops
            pass
        for partition in self.owned:
            self.release(partition)
        if self._standby is not None:
            self._standby.stop()
            self._standby.join(5)
        self._producer.flush(10)
        self._offsets.close()
        self._reader.close()
