"""The Kafka source while the engine restores the state of newly assigned partitions, against
the Tansu broker: the partitions wait, the group is polled meanwhile (a restore longer than the
poll interval keeps the consumer in its group), and each partition starts where its restored
state says."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import msgspec
import pytest

from aisp.connectors.kafka import KafkaSource, tansu_broker
from aisp.connectors.kafka.source import kafka_event_id
from aisp.ingest.base import SourceContext
from tests.integration.test_kafka import keyed_topic

RECORDS = 200


class Reading(msgspec.Struct):
    user: str
    amount: float


@pytest.fixture(scope="module")
def broker() -> Iterator[str]:
    with tansu_broker() as bootstrap:
        yield bootstrap


def test_a_restore_longer_than_the_poll_interval_keeps_the_group_and_starts_where_the_state_says(
    broker: str,
) -> None:
    name = uuid.uuid4().hex[:8]
    topic = f"rin-{name}"
    lines = [msgspec.json.encode({"user": f"u{i % 2}", "amount": float(i)}) for i in range(2 * RECORDS)]
    keyed_topic(broker, topic, lines, 2)  # u0 on partition 0, u1 on partition 1
    assigned: list[tuple[float, list[int]]] = []
    revoked: list[list[int]] = []
    restore_s = 9.0  # longer than max.poll.interval.ms below

    def restored() -> dict[int, int | None]:
        if not assigned or time.monotonic() - assigned[-1][0] < restore_s:
            return {}
        at, partitions = assigned.pop()
        return {p: (50 if p == 0 else None) for p in partitions}  # partition 0's state covers 0..49

    ctx = SourceContext(
        "src",
        lambda records: None,
        on_assign=lambda partitions: assigned.append((time.monotonic(), partitions)),
        restored=restored,
        on_revoke=revoked.append,
    )
    source = KafkaSource(
        topic=topic,
        schema=Reading,
        bootstrap=broker,
        group=f"rg-{name}",
        options={"max.poll.interval.ms": 6000, "session.timeout.ms": 6000},
    )
    part = source.open(ctx)
    ids: list[int] = []
    first_at: float | None = None
    started = time.monotonic()
    try:
        while len(ids) < 2 * RECORDS - 50 and time.monotonic() - started < 90:
            batch = part.next_batch(100)
            assert batch is not None
            if batch.num_rows:
                first_at = first_at or time.monotonic()
                ids.extend(batch.ids.tolist())
        time.sleep(1.0)
        tail = part.next_batch(100)  # nothing more, nothing twice
        assert tail is not None and tail.num_rows == 0
        assert revoked == [], "the consumer left its group while a partition was restored"
    finally:  # (closing revokes the partitions)
        part.close()
    expected = [kafka_event_id(0, o) for o in range(50, RECORDS)] + [
        kafka_event_id(1, o) for o in range(RECORDS)
    ]
    assert sorted(ids) == sorted(expected)
    assert first_at is not None and first_at - started >= restore_s  # nothing read before the restore
