"""What a paced Kafka stream costs the broker the tests use (Tansu, memory storage) as it fills.

A producer sends ``--rate`` events a second (200 bytes each, round robin over ``--partitions``
partitions, ``linger.ms`` as given) to a Tansu broker started here, and one group consumer reads
them (``fetch.wait.max.ms`` as given, committing every second); every 30 s the broker's CPU share
is printed. Tansu keeps each record batch as an object and lists a partition's batches at every
fetch that finds records, so its cost grows with the batches it holds: fewer, larger batches and
fewer fetches keep it down over hours (``make soak`` uses 500 and 100 ms).

    python benchmarks/bench_broker_cost.py [--rate 1000] [--seconds 90]
        [--linger-ms 5 100] [--fetch-wait-ms 500 20 100]
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
from aisp.connectors.kafka import tansu_broker  # noqa: E402


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(rate: float, seconds: float, partitions: int, linger_ms: float, fetch_wait_ms: int) -> list[float]:
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    with tansu_broker() as bootstrap:
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic("t", partitions, 1)])["t"].result(10)
        pid = int(subprocess.run(["pgrep", "-f", f"tansu broker --listener-url tcp://{bootstrap}"],
                                 capture_output=True, text=True).stdout.split()[0])  # fmt: skip
        stop = threading.Event()

        def produce() -> None:
            p = Producer({"bootstrap.servers": bootstrap, "linger.ms": linger_ms, "enable.idempotence": True})
            t0, n = time.monotonic(), 0
            while not stop.is_set():
                while n < int((time.monotonic() - t0) * rate):
                    p.produce("t", value=b"x" * 200, partition=n % partitions)
                    n += 1
                p.poll(0)
                time.sleep(0.001)
            p.flush(10)

        def consume() -> None:
            c = Consumer({"bootstrap.servers": bootstrap, "group.id": "g", "enable.auto.commit": False,
                          "auto.offset.reset": "earliest", "fetch.wait.max.ms": fetch_wait_ms})  # fmt: skip
            c.subscribe(["t"])
            last = time.monotonic()
            while not stop.is_set():
                if c.consume(1000, 0.1) and time.monotonic() - last > 1:
                    c.commit(asynchronous=False)
                    last = time.monotonic()
            c.close()

        threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
        for t in threads:
            t.start()
        shares = []
        before, at = _cpu_s(pid), time.monotonic()
        for _ in range(int(seconds // 30)):
            time.sleep(30)
            now_cpu, now = _cpu_s(pid), time.monotonic()
            shares.append(round((now_cpu - before) / (now - at), 2))
            before, at = now_cpu, now
        stop.set()
        for t in threads:
            t.join()
    return shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1000)
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--linger-ms", type=float, nargs="+", default=[5, 100])
    ap.add_argument("--fetch-wait-ms", type=int, nargs="+", default=[500, 20, 100])
    args = ap.parse_args()
    print("| linger.ms | fetch.wait.max.ms | Tansu's CPU share per 30 s |\n|---|---|---|")
    for linger, wait in itertools.product(args.linger_ms, args.fetch_wait_ms):
        shares = one(args.rate, args.seconds, args.partitions, linger, wait)
        print(f"| {linger:g} | {wait} | {' / '.join(f'{s:.2f}' for s in shares)} |", flush=True)


if __name__ == "__main__":
    main()
