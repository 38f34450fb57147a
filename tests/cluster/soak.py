"""``make soak`` (``DURATION`` seconds, default 3600): workload F from Kafka through two workers of one
group with keyed state in changelog topics, to a Redis stream; paced at 80% of the capacity it
measures first (at most ``--max-rate``); a worker SIGKILLed and started again every
``--kill-every`` seconds (the two in turn). Every ``--sample-s`` seconds it samples end-to-end
p50/p99 (from the broker's acknowledgement of the event to its output; p99 from the producer's
send call too, its ``linger.ms`` included), each process's RSS, open file descriptors, threads
and CPU share (the workers, Tansu, Redis, the soak itself), the group's consumer lag and each
worker's last checkpoint's duration (``/metrics``).

The producer batches for ``--linger-ms`` (500) and the workers fetch with ``fetch_wait_ms``
``--fetch-wait-ms`` (100): Tansu keeps each record batch as an object, and both a produce and a
fetch that finds records cost it in proportion to the objects it holds (measured at 1,000
events/s on 4 partitions, one consumer: linger.ms 5 took Tansu to a whole core within 60 s,
linger.ms 100 to 0.09; at 2,000 events/s, linger.ms 100 and fetches of 100 ms, its share still
grew by 0.02 core a minute).

A checker reads the output stream as it grows (and trims what it read, so that an hour of
outputs does not fill Redis): every event id must come exactly once. At the end: the report
(``report.json``: samples, kills with their recovery time, and the verdicts) and one PNG plot per
series against time, in ``--out`` (default ``out/soak``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from aisp.connectors.base import free_port, wait_for_port
from aisp.connectors.kafka.client import CLIENT_SETTINGS
from aisp.connectors.kafka.connector import tansu_broker
from benchmarks.workload import BLOCK, event_lines
from tests.cluster.scenario import ENV, PIPELINE, partition_of

PARTITIONS = 4


class Producer(threading.Thread):
    """Events with ids 0, 1, ... to ``topic`` at ``rate`` a second until ``halt``; the time each
    was sent (Unix ms) in ``sent_ms[id]``, the time the broker acknowledged it (from then on a
    consumer can read it) in ``acked_ms[id]``."""

    def __init__(self, bootstrap: str, topic: str, rate: float, linger_ms: float) -> None:
        super().__init__(name="soak-producer", daemon=True)
        from confluent_kafka import Producer as KafkaProducer

        self._p = KafkaProducer({"bootstrap.servers": bootstrap, "linger.ms": linger_ms,
                                 "enable.idempotence": True, **CLIENT_SETTINGS})  # fmt: skip
        self._topic, self.rate = topic, rate
        self.sent = 0
        self.sent_ms = np.zeros(1 << 20)
        self.acked_ms = np.zeros(1 << 20)
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            start = time.monotonic()
            while not self.halt.is_set():
                chunk = BLOCK - self.sent % BLOCK  # a whole block of the generator at a time
                lines = event_lines(self.sent, self.sent + chunk, seed=11)
                if self.sent + chunk > len(self.sent_ms):
                    more = np.zeros(len(self.sent_ms))
                    self.sent_ms, self.acked_ms = (
                        np.concatenate([a, more]) for a in (self.sent_ms, self.acked_ms)
                    )
                for line in lines:
                    if self.halt.is_set():
                        break
                    wait = start + self.sent / self.rate - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    user = line[line.index(b'"user":"') + 8 : line.index(b'","amount"')].decode()
                    self._p.produce(
                        self._topic, value=line, partition=partition_of(user, PARTITIONS),
                        on_delivery=functools.partial(self._acked, self.sent),
                    )  # fmt: skip
                    self.sent_ms[self.sent] = time.time() * 1000
                    self.sent += 1
                    self._p.poll(0)
            if self._p.flush(60) != 0:
                raise RuntimeError("the producer could not deliver every event")
        except BaseException as exc:  # noqa: BLE001 - reported by the soak
            self.error = exc

    def _acked(self, i: int, err: Any, _msg: Any) -> None:
        if err is None:
            self.acked_ms[i] = time.time() * 1000


class Checker(threading.Thread):
    """Reads the output stream as it grows: counts each id, keeps latencies and the time each
    partition was last answered, and trims what it read."""

    def __init__(self, r: Any, stream: str, producer: Producer) -> None:
        super().__init__(name="soak-checker", daemon=True)
        self._r, self._stream, self._producer = r, stream, producer
        self.seen = np.zeros(1 << 20, dtype=np.uint8)
        self.outputs = 0
        self.latencies: list[float] = []  # from the broker's ack
        self.from_send: list[float] = []  # from the producer's send call (its linger.ms included)
        self.last_ms = [0.0] * PARTITIONS
        self.first_after: dict[float, dict[int, float]] = {}  # kill ms -> partition -> first output
        self.halt = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        last = "0-0"
        while not self.halt.is_set():
            got = self._r.xread({self._stream: last}, count=5000, block=500)
            for _, entries in got or []:
                for entry_id, fields in entries:
                    self._take(entry_id.decode(), json.loads(fields[b"data"]))
                    last = entry_id.decode()
                self._r.xtrim(self._stream, minid=last)

    def _take(self, entry_id: str, row: dict[str, Any]) -> None:
        at_ms = float(entry_id.split("-")[0])
        i = int(row["id"])
        with self.lock:
            if i >= len(self.seen):
                self.seen = np.concatenate([self.seen, np.zeros(max(i + 1, 2 * len(self.seen)), np.uint8)])
            self.seen[i] = min(255, int(self.seen[i]) + 1)
            self.outputs += 1
            if i < len(self._producer.sent_ms) and self._producer.acked_ms[i] > 0:
                self.latencies.append(at_ms - float(self._producer.acked_ms[i]))
                self.from_send.append(at_ms - float(self._producer.sent_ms[i]))
            p = partition_of(str(row["user"]), PARTITIONS)
            self.last_ms[p] = at_ms
            for kill_ms, firsts in self.first_after.items():
                if at_ms >= kill_ms and p not in firsts:
                    firsts[p] = at_ms

    def take_latencies(self) -> tuple[list[float], list[float]]:
        """The latencies since the last call: from the broker's ack, and from the send call."""
        with self.lock:
            out, self.latencies, send, self.from_send = self.latencies, [], self.from_send, []
        return out, send


_TICKS = os.sysconf("SC_CLK_TCK")


def _proc(pid: int, cpu_before: dict[int, tuple[float, float]]) -> dict[str, float]:
    """RSS, open fds, threads and the share of one core used since the last sample (``cpu_before``:
    pid -> (CPU seconds, when) at the last sample, updated here)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    cpu_s, now = (int(fields[11]) + int(fields[12])) / _TICKS, time.monotonic()
    before = cpu_before.get(pid)
    cpu_before[pid] = (cpu_s, now)
    cpu = round((cpu_s - before[0]) / max(now - before[1], 1e-3), 2) if before else math.nan
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return {"rss_mb": round(rss, 1), "fds": fds, "threads": threads, "cpu": cpu}


def _lag(bootstrap: str, topic: str, group: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                  **CLIENT_SETTINGS})  # fmt: skip
    try:
        parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        committed = c.committed(parts, timeout=10)
        lag = 0
        for tp in committed:
            _, high = c.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=10)
            lag += high - max(tp.offset, 0)
        return lag
    finally:
        c.close()


class Worker:
    """One ``aisp run`` of the group, started again after a kill with the same directory."""

    def __init__(
        self, tag: str, out: Path, bootstrap: str, topic: str, group: str, output: str, fetch_wait_ms: int
    ) -> None:
        self.tag, self.dir = tag, out / tag
        self.dir.mkdir(parents=True, exist_ok=True)
        query = f"group={group}&idle_stop_s=20&fetch_wait_ms={fetch_wait_ms}"
        self.argv = [
            sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--no-live",
            "--input", f"kafka://{bootstrap}/{topic}?{query}", "--output", output,
            "--dead-letter", str(self.dir / "dl.jsonl"), "--checkpoint-dir", str(self.dir / "chk"),
            "--partition-state", "changelog", "--metrics-port", "0",
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics = ""
        self.lives = 0
        self.since_s = 0.0
        """When (soak seconds) this life of the worker started."""

    def start(self, at_s: float = 0.0) -> None:
        self.lives += 1
        self.since_s = at_s
        log = self.dir / f"run-{self.lives}.log"
        with log.open("wb") as fh:
            self.proc = subprocess.Popen(self.argv, env=ENV, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not self.metrics.startswith(f"{self.lives}:"):
            found = re.search(r"metrics (http://\S+)", log.read_text(errors="replace"))
            if found:
                self.metrics = f"{self.lives}:{found.group(1)}"
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def checkpoint_s(self) -> float:
        try:
            text = urllib.request.urlopen(self.metrics.partition(":")[2], timeout=10).read().decode()
        except OSError:
            return math.nan
        found = re.search(r"^aisp_checkpoint_last_seconds (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else math.nan


def _percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 1) if values else math.nan


def measure_capacity(
    bootstrap: str, r: Any, redis_port: int, out: Path, events: int, fetch_wait_ms: int
) -> float:
    """Events a second two fresh workers drain from a full topic (the soak runs at 80% of it)."""
    from aisp.connectors.kafka.connector import fill_topic

    fill_topic(bootstrap, "cap-in", event_lines(0, events, seed=5), partitions=PARTITIONS, key="user")
    output = f"redis://127.0.0.1:{redis_port}/cap-out"
    workers = [Worker(f"cap{i}", out, bootstrap, "cap-in", "cap", output, fetch_wait_ms) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        assert w.proc is not None
        w.proc.wait(timeout=1800)
    entries = r.xrange("cap-out", count=1) + r.xrevrange("cap-out", count=1)
    first, last = (float(e[0].decode().split("-")[0]) for e in entries)
    return events / max((last - first) / 1000, 1e-3)


def plot(samples: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in samples]
    series = {
        "latency_ms": ["p50_ms", "p99_ms"], "lag": ["lag"],
        **{k: [f"{n}.{k}" for n in samples[0]["procs"]] for k in ("rss_mb", "fds", "threads", "cpu")},
        "checkpoint_s": [f"{n}.checkpoint_s" for n in samples[0]["checkpoint_s"]],
    }  # fmt: skip
    for name, keys in series.items():
        fig, ax = plt.subplots(figsize=(8, 3))
        for key in keys:
            proc, _, field = key.partition(".")
            if field and name == "checkpoint_s":
                ys = [s["checkpoint_s"].get(proc, math.nan) for s in samples]
            elif field:
                ys = [s["procs"].get(proc, {}).get(field, math.nan) for s in samples]
            else:
                ys = [s[key] for s in samples]
            ax.plot(t, ys, label=key)
        ax.set_xlabel("minutes")
        ax.set_ylabel(name)
        if name == "latency_ms":  # the takeovers' seconds and the steady tens of ms on one plot
            ax.set_yscale("log")
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=float(os.environ.get("DURATION", 3600)))
    parser.add_argument("--kill-every", type=float, default=600)
    parser.add_argument("--sample-s", type=float, default=10)
    parser.add_argument("--capacity-events", type=int, default=200_000)
    parser.add_argument("--out", default="out/soak")
    parser.add_argument(
        "--max-rate",
        type=float,
        default=0.0,
        help="events/s at most (0: 80%% of capacity). Tansu's memory storage keeps every record (it"
        " applies no retention.ms and refuses DeleteRecords): ~6 MB/s at 15k events/s",
    )
    parser.add_argument(
        "--linger-ms", type=float, default=500,
        help="the producer's linger.ms: Tansu keeps each record batch as an object and lists them all at"
        " every fetch that finds records, so fewer, larger batches keep its cost down over hours",
    )  # fmt: skip
    parser.add_argument(
        "--fetch-wait-ms", type=int, default=100,
        help="the workers' fetch_wait_ms: how often each asks Tansu, which holds every fetch this long",
    )  # fmt: skip
    parser.add_argument(
        "--judge-again", metavar="REPORT",
        help="judge a finished soak's report.json again (its samples, kills and counts) with this"
        " version's verdicts, and plot it; runs nothing",
    )  # fmt: skip
    args = parser.parse_args()
    if args.judge_again:
        return judge_again(Path(args.judge_again))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        bootstrap = stack.enter_context(tansu_broker())
        redis_port = free_port()
        redis_proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(redis_port), "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL,
        )  # fmt: skip
        stack.callback(redis_proc.kill)
        wait_for_port(redis_port, lambda: redis_proc.poll() is None, "redis-server")
        import redis

        r = redis.Redis(port=redis_port)
        capacity = measure_capacity(bootstrap, r, redis_port, out, args.capacity_events, args.fetch_wait_ms)
        rate = 0.8 * capacity if args.max_rate <= 0 else min(0.8 * capacity, args.max_rate)
        print(f"capacity {capacity:.0f} events/s: the soak runs at {rate:.0f}", flush=True)
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient({"bootstrap.servers": bootstrap, **CLIENT_SETTINGS})
        for f in admin.create_topics([NewTopic("soak-in", PARTITIONS, 1)]).values():
            f.result(30)
        output = f"redis://127.0.0.1:{redis_port}/soak-out?dedupe_ttl_s=1800"
        workers = [
            Worker(f"w{i}", out, bootstrap, "soak-in", "soak", output, args.fetch_wait_ms) for i in range(2)
        ]
        stack.callback(lambda: [w.kill() for w in workers])  # an interrupted soak leaves none running
        for w in workers:
            w.start()
        producer = Producer(bootstrap, "soak-in", rate, args.linger_ms)
        checker = Checker(r, "soak-out", producer)
        producer.start()
        checker.start()
        tansu_pid = int(subprocess.run(["pgrep", "-f", f"tansu broker --listener-url tcp://{bootstrap}"],
                                       capture_output=True, text=True).stdout.split()[0])  # fmt: skip
        samples: list[dict[str, Any]] = []
        kills: list[dict[str, Any]] = []
        cpu: dict[int, tuple[float, float]] = {}
        started = time.monotonic()
        next_kill = started + args.kill_every
        try:
            while time.monotonic() - started < args.duration:
                time.sleep(args.sample_s)
                latencies, from_send = checker.take_latencies()
                procs = {"tansu": _proc(tansu_pid, cpu), "redis": _proc(redis_proc.pid, cpu),
                         "soak": _proc(os.getpid(), cpu)}  # fmt: skip
                for w in workers:
                    if w.proc is not None and w.proc.poll() is None:
                        procs[w.tag] = {**_proc(w.proc.pid, cpu), "life": w.lives, "since_s": w.since_s}
                sample = {
                    "t_s": round(time.monotonic() - started, 1), "sent": producer.sent,
                    "outputs": checker.outputs,
                    "p50_ms": _percentile(latencies, 50), "p99_ms": _percentile(latencies, 99),
                    "p99_from_send_ms": _percentile(from_send, 99),
                    "lag": _lag(bootstrap, "soak-in", "soak"), "procs": procs,
                    "checkpoint_s": {w.tag: w.checkpoint_s() for w in workers},
                }  # fmt: skip
                samples.append(sample)
                print(json.dumps(sample), flush=True)
                if producer.error is not None:
                    raise RuntimeError(f"the producer failed: {producer.error}")
                if time.monotonic() >= next_kill:
                    victim = workers[len(kills) % 2]
                    assert victim.proc is not None
                    kill_ms = time.time() * 1000
                    with checker.lock:
                        checker.first_after[kill_ms] = {}
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.proc.wait()
                    victim.start(time.monotonic() - started)
                    kills.append({"worker": victim.tag, "at_s": sample["t_s"], "kill_ms": kill_ms})
                    next_kill += args.kill_every
        finally:
            producer.halt.set()
            producer.join(timeout=120)
        deadline = time.monotonic() + 300
        while checker.outputs < producer.sent and time.monotonic() < deadline:
            time.sleep(1)
        checker.halt.set()
        for w in workers:
            if w.proc is not None:
                try:
                    w.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
        for k in kills:
            firsts = checker.first_after.get(k["kill_ms"], {})
            k["recovery_s"] = (
                round((max(firsts.values()) - k["kill_ms"]) / 1000, 1) if len(firsts) == PARTITIONS else None
            )
        seen = checker.seen[: producer.sent]
        report = verdicts(samples, kills, int((seen == 0).sum()), int((seen > 1).sum()), capacity, rate)
        (out / "report.json").write_text(json.dumps({**report, "samples": samples, "kills": kills}, indent=1))
        if samples:
            plot(samples, out)
        print(json.dumps(report, indent=1))
        return 0 if report["ok"] else 1


def judge_again(path: Path) -> int:
    """Judge the soak recorded in ``path`` again and plot it beside it (``--judge-again``)."""
    old = json.loads(path.read_text())
    report = verdicts(
        old["samples"], old["kills"], old["lost"], old["duplicated"], old["capacity_events_per_s"],
        old["rate_events_per_s"],
    )  # fmt: skip
    path.write_text(json.dumps({**report, "samples": old["samples"], "kills": old["kills"]}, indent=1))
    plot(old["samples"], path.parent)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


def verdicts(
    samples: list[dict[str, Any]], kills: list[dict[str, Any]], lost: int, duplicated: int, capacity: float,
    rate: float,
) -> dict[str, Any]:  # fmt: skip
    """The soak's goals: nothing lost or doubled, each worker's RSS slope under 5 MB/h after the
    first 10 minutes, fds and threads flat, p99 of the last 10 minutes within 1.2x of the first 10.

    The slope judged is a leak's: the workers' RSS against time within the steady stretches of
    their lives, pooled (``_rss_slopes``). A kill of one worker moves its partitions to the other
    for the takeover and back when it returns, and the survivor's RSS steps up to hold them
    (memory its allocator then keeps); a step is not a leak. Per life the slope is reported too
    (a stretch of 5 minutes cannot tell 5 MB/h from an allocator's step of a few MB), and over
    each whole life. Tansu's and Redis's slopes are reported, not judged: Tansu keeps every
    record it is given, in memory."""
    warm = [s for s in samples if s["t_s"] >= 600] or samples[len(samples) // 2 :]
    slopes, whole, workers = _rss_slopes(warm, [float(k["at_s"]) for k in kills])
    first = [s["p99_ms"] for s in samples if s["t_s"] <= 600 and not math.isnan(s["p99_ms"])]
    last_t = samples[-1]["t_s"] if samples else 0
    last = [s["p99_ms"] for s in samples if s["t_s"] >= last_t - 600 and not math.isnan(s["p99_ms"])]
    p99_first, p99_last = (float(np.median(x)) if x else math.nan for x in (first, last))
    spread = {k: (min(v), max(v)) for k, v in _series(warm, ("fds", "threads")).items()}
    return {
        "capacity_events_per_s": round(capacity), "rate_events_per_s": round(rate),
        "lost": lost, "duplicated": duplicated, "rss_slope_mb_per_h": slopes,
        "rss_whole_life_slope_mb_per_h": whole, "workers_rss_slope_mb_per_h": workers,
        "p99_ms_first_10_min": p99_first, "p99_ms_last_10_min": p99_last, "fds_threads_min_max": spread,
        "recovery_s": [k.get("recovery_s") for k in kills],
        "ok": lost == duplicated == 0 and not workers >= 5
        and not p99_last > 1.2 * p99_first,
    }  # fmt: skip


def _rss_slopes(
    samples: list[dict[str, Any]], kill_s: list[float], settle_s: float = 300.0, min_span_s: float = 240.0
) -> tuple[dict[str, float], dict[str, float], float]:
    """RSS slopes in MB/h: per process life (``name#life``) within its steady stretches, per life
    over the whole life (its first ``settle_s`` left out), and the workers' (``w*``) within their
    steady stretches, pooled. A stretch runs from a life's start or a kill to the next kill; its
    first ``settle_s`` (a start, a takeover, a hand-back) are left out. A fit within stretches is
    one line across them, each with its own level (time and RSS taken from their stretch's
    means): a step between stretches does not count, a climb within them does. A life with less
    than ``min_span_s`` of it gets no slope."""
    stretches: dict[tuple[str, float], list[tuple[float, float]]] = {}
    whole: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        t = float(s["t_s"])
        for name, proc in s["procs"].items():
            life, born = f"{name}#{proc.get('life', 1)}", float(proc.get("since_s", 0.0))
            since = max([born, *[k for k in kill_s if k <= t]])
            if t - born >= settle_s:
                whole.setdefault(life, []).append((t, proc["rss_mb"]))
            if t - since >= settle_s:
                stretches.setdefault((life, since), []).append((t, proc["rss_mb"]))
    lives: dict[str, list[list[tuple[float, float]]]] = {}
    for (life, _), points in stretches.items():
        lives.setdefault(life, []).append(points)
    within = {life: _within(parts, min_span_s) for life, parts in lives.items()}
    fits = {}
    for life, points in whole.items():
        if len(points) >= 3 and points[-1][0] - points[0][0] >= min_span_s:
            ts, ys = np.array(points).T
            fits[life] = round(float(np.polyfit(ts / 3600, ys, 1)[0]), 1)
    workers = _within([p for life, parts in lives.items() if life.startswith("w") for p in parts], min_span_s)
    return {k: v for k, v in within.items() if not math.isnan(v)}, fits, workers


def _within(stretches: list[list[tuple[float, float]]], min_span_s: float) -> float:
    """One slope (MB/h) across ``stretches`` of (t, RSS), each with its own level; nan when they
    span less than ``min_span_s`` in all."""
    xy = xx = span = 0.0
    for points in stretches:
        if len(points) < 3:
            continue
        ts, ys = np.array(points).T
        dt, dy = ts / 3600 - (ts / 3600).mean(), ys - ys.mean()
        xy, xx, span = xy + float(dt @ dy), xx + float(dt @ dt), span + float(ts[-1] - ts[0])
    return round(xy / xx, 1) if xx > 0 and span >= min_span_s else math.nan


def _series(samples: list[dict[str, Any]], fields: tuple[str, ...]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for s in samples:
        for name, proc in s["procs"].items():
            for f in fields:
                out.setdefault(f"{name}#{proc.get('life', 1)}.{f}", []).append(proc[f])
    return out


if __name__ == "__main__":
    sys.exit(main())
