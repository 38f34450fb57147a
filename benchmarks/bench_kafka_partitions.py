"""Scaling a Kafka pipeline over processes: one `aisp run` against two in one consumer group.

Workload F (``--events``, keyed by user) fills a ``--partitions``-partition topic of a Tansu
broker started here (each user always on the same partition). Then the fraud example reads it
into a counting sink (``null:``), with ``--checkpoint-dir`` and ``--partition-state`` (keyed
state checkpointed per partition every second, in changelog topics on the broker with
``--state changelog``, else in a shared directory): once with one process in the group, once
with two started together, alternating for ``--rounds`` rounds (a new group each time, which
reads the topic from the start). Throughput: every event read, over the time from the first
event any process read to the last row any wrote (run summaries' ``active_from_ms`` and
``active_seconds``: process start-up, the group forming and the final idle wait are left out).

    python benchmarks/bench_kafka_partitions.py [--events 400000] [--state changelog] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
from aisp.connectors.kafka import tansu_broker  # noqa: E402
from benchmarks.workload import write_events  # noqa: E402

PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def fill(bootstrap: str, topic: str, data: Path, partitions: int) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(10)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10000})
    for line in data.read_bytes().splitlines():
        start = line.index(b'"user":"u') + 9
        user = int(line[start : line.index(b'"', start)])
        while True:
            try:
                producer.produce(topic, value=line, partition=user % partitions)
                break
            except BufferError:
                producer.poll(0.05)
    assert producer.flush(60) == 0


def group_run(bootstrap: str, topic: str, processes: int, work: Path, state: str) -> dict[str, object]:
    group = f"g-{uuid.uuid4().hex[:6]}"
    procs, summaries = [], []
    for i in range(processes):
        summary = work / f"{group}-{i}.json"
        cmd = [
            sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--no-live",
            "--input", f"kafka://{bootstrap}/{topic}?group={group}&idle_stop_s=3", "--output", "null:",
            "--checkpoint-dir", str(work / f"{group}-chk-{i}"),
            "--partition-state", state if state == "changelog" else str(work / f"{group}-parts"),
            "--summary-json", str(summary),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        summaries.append(summary)
    t0 = time.time()
    for proc in procs:
        _, err = proc.communicate(timeout=900)
        if proc.returncode:
            raise SystemExit(f"a run failed: {err.decode()[-2000:]}")
    wall = time.time() - t0
    runs = [json.loads(s.read_text()) for s in summaries]
    events = sum(int(r["events_in"]) for r in runs)
    start = min(int(r["active_from_ms"]) for r in runs) / 1000  # the first event read by any
    end = max(int(r["active_from_ms"]) / 1000 + float(r["active_seconds"]) for r in runs)
    return {"processes": processes, "events": events, "seconds": round(end - start, 2),
            "events_per_s": round(events / (end - start)), "wall_s": round(wall, 1),
            "per_process_events": [int(r["events_in"]) for r in runs]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=400_000)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--state", choices=["dir", "changelog"], default="dir")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as d, tansu_broker() as bootstrap:
        work = Path(d)
        data = work / "events.jsonl"
        write_events(data, args.events, seed=3)
        fill(bootstrap, "events", data, args.partitions)
        for i in range(args.rounds):
            order = (1, 2) if i % 2 == 0 else (2, 1)
            results = {n: group_run(bootstrap, "events", n, work, args.state) for n in order}
            for n in order:
                print(json.dumps({"round": i, "state": args.state, **results[n]}), flush=True)
            ratios.append(float(str(results[2]["events_per_s"])) / float(str(results[1]["events_per_s"])))
    print(f"two processes / one, per round: {' '.join(f'{r:.2f}' for r in ratios)};"
          f" median {statistics.median(ratios):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
