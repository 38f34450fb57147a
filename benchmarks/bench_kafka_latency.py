"""How soon a Kafka record is handed on: AISP's Kafka source against the loops a user writes.

A producer sends ``--rate`` records a second (each carries the time it was sent) to a topic of
``--partitions`` partitions on a Tansu broker started here; a reader in the same process takes
them, and each record's wait is the time from its send to the moment the reader has it. Readers:

- ``aisp``: ``KafkaSource.next_batch`` (the engine's input), its default settings;
- ``consume``: a plain ``confluent_kafka.Consumer`` (librdkafka's defaults) calling
  ``consume(512, timeout=0.1)``, the batched loop most examples show;
- ``poll``: the same consumer calling ``poll(0.1)`` for one record at a time;
- ``poll, fetch 20 ms``: that loop with ``fetch.wait.max.ms`` 20, as AISP's input sets it: the
  strongest loop here (Tansu holds every fetch for that long).

Each reader runs ``--seconds`` seconds per round, alternating, for ``--rounds`` rounds (a new
topic and group each time); the table gives the median over rounds of each round's p50 and p99.

    python benchmarks/bench_kafka_latency.py [--rate 500] [--partitions 1] [--seconds 15] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
from aisp.connectors.kafka import tansu_broker  # noqa: E402


class Record(msgspec.Struct):
    n: int
    sent: float


def _topic(bootstrap: str, partitions: int) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    topic = f"lat-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept until the topic is made
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(10)
    return topic


def _produce(bootstrap: str, topic: str, partitions: int, rate: float, stop: threading.Event) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    t0, n = time.monotonic(), 0
    while not stop.is_set():
        due = int((time.monotonic() - t0) * rate)
        while n < due:
            line = json.dumps({"n": n, "sent": time.monotonic()}).encode()
            p.produce(topic, value=line, partition=n % partitions)
            n += 1
        p.poll(0)
        time.sleep(0.0005)
    p.flush(10)


def _aisp(bootstrap: str, topic: str) -> tuple[Callable[[], list[float]], Callable[[], None]]:
    from aisp.connectors.kafka.source import KafkaSource
    from aisp.ingest.base import SourceContext

    cfg = KafkaSource(topic=topic, schema=Record, bootstrap=bootstrap, group=f"g-{topic}")
    source = cfg.open(SourceContext("src", lambda records: None))

    def take() -> list[float]:
        batch = source.next_batch(512)
        if batch is None or not batch.num_rows:
            return []
        return [float(x) for x in batch.numpy("sent")]

    return take, source.close


def _plain(
    bootstrap: str, topic: str, batched: bool, tuned: bool = False
) -> tuple[Callable[[], list[float]], Callable[[], None]]:
    from confluent_kafka import Consumer

    settings = {"bootstrap.servers": bootstrap, "group.id": f"g-{topic}", "auto.offset.reset": "earliest"}
    c = Consumer({**settings, "fetch.wait.max.ms": 20} if tuned else settings)
    c.subscribe([topic])

    def take() -> list[float]:
        msgs: list[Any] = (
            c.consume(512, timeout=0.1) if batched else [m for m in [c.poll(0.1)] if m is not None]
        )
        return [json.loads(m.value())["sent"] for m in msgs if m.error() is None]

    return take, c.close


READERS = {
    "aisp": _aisp,
    "consume": lambda b, t: _plain(b, t, True),
    "poll": lambda b, t: _plain(b, t, False),
    "poll, fetch 20 ms": lambda b, t: _plain(b, t, False, tuned=True),
}


def one_round(
    bootstrap: str, reader: str, rate: float, partitions: int, seconds: float
) -> tuple[float, float]:
    topic = _topic(bootstrap, partitions)
    take, close = READERS[reader](bootstrap, topic)
    stop = threading.Event()
    waits: list[float] = []
    try:
        producer = threading.Thread(target=_produce, args=(bootstrap, topic, partitions, rate, stop))
        producer.start()
        settled = float("inf")  # records sent before the group gave the reader its partitions, and
        end = time.monotonic() + 60 + seconds  # for a second after, are left out
        while time.monotonic() < end:
            got = take()
            now = time.monotonic()
            if got and settled == float("inf"):
                settled, end = now + 1, now + 1 + seconds
            waits += [now - s for s in got if s >= settled]
        stop.set()
        producer.join()
    finally:
        close()
    ms = np.asarray(waits) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--partitions", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list[tuple[float, float]]] = {r: [] for r in READERS}
    with tansu_broker() as bootstrap:
        for i in range(args.rounds):
            for reader in READERS:
                p50, p99 = one_round(bootstrap, reader, args.rate, args.partitions, args.seconds)
                results[reader].append((p50, p99))
                print(f"round {i + 1} {reader}: p50 {p50:.1f} ms, p99 {p99:.1f} ms", flush=True)
    print(f"\n{args.rate:g} records/s, {args.partitions} partition(s), median of {args.rounds} rounds")
    print("| reader | p50 ms | p99 ms |\n|---|---|---|")
    for reader, rows in results.items():
        p50 = statistics.median(r[0] for r in rows)
        p99 = statistics.median(r[1] for r in rows)
        print(f"| {reader} | {p50:.1f} | {p99:.1f} |")


if __name__ == "__main__":
    main()
