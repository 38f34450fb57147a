"""Kafka connectors against a Kafka-protocol broker (Tansu, started by the tests): SIGKILL at
random moments, restart, and the output topic holds each result once."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.workload import write_events
from tests.integration.test_exactly_once import PIPELINE, aisp_run, kill_and_restart
from tests.support.tansu import tansu_broker

EVENTS = 20_000


@pytest.fixture(scope="module")
def broker() -> Iterator[str]:
    with tansu_broker() as bootstrap:
        yield bootstrap


def produce(bootstrap: str, topic: str, lines: list[bytes]) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the topic exists
    for f in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        f.result(10)
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5})
    for line in lines:
        while True:
            try:
                p.produce(topic, value=line, partition=0)
                break
            except BufferError:
                p.poll(0.05)
    assert p.flush(30) == 0


def consume_all(bootstrap: str, topic: str) -> list[bytes]:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex}", "enable.auto.commit": False}
    )
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    out: list[bytes] = []
    idle = 0
    while idle < 10:
        msgs = [m for m in c.consume(num_messages=10_000, timeout=0.2) if m.error() is None]
        idle = 0 if msgs else idle + 1
        out += [m.value() for m in msgs]
    c.close()
    return out


def test_kafka_in_and_out_exactly_once_across_sigkills(broker: str, tmp_path: Path) -> None:
    data = tmp_path / "events.jsonl"
    write_events(data, EVENTS, seed=31, bad_every=401)
    ref = tmp_path / "ref.jsonl"
    import subprocess

    from tests.integration.test_exactly_once import ENV, outputs

    subprocess.run(aisp_run(data, ref), env=ENV, check=True, capture_output=True)
    expected = outputs(ref)
    name = uuid.uuid4().hex[:8]
    src, dst = f"in-{name}", f"out-{name}"
    produce(broker, src, data.read_bytes().splitlines())
    cmd = [
        sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--no-live",
        "--input", f"kafka://{broker}/{src}?group=g-{name}&idle_stop_s=2",
        "--output", f"kafka://{broker}/{dst}",
        "--checkpoint-dir", str(tmp_path / "chk"), "--checkpoint-interval-s", "0.25", "--rate", "8000",
    ]  # fmt: skip
    assert kill_and_restart(cmd, kills=5, seed=5) >= 4
    rows = [json.loads(x) for x in consume_all(broker, dst)]
    assert len(rows) == len({r["id"] for r in rows}), "an output was produced twice"
    assert sorted(rows, key=lambda r: r["id"]) == expected
