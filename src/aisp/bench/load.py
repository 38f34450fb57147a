"""Load generation against a served pipeline (HTTP NDJSON or the gRPC stream) or a local one.

Open loop (``rate``): requests leave on a fixed schedule, ``events_per_request`` events each,
and each event's latency is measured from its *scheduled* send time to its answer, so a
stalled server cannot hide its stall by slowing the client down (no coordinated omission).
Closed loop (``concurrency``): that many requests in flight, each sent when the previous one
is answered; latency from the actual send. A local pipeline file is run with ``aisp run
--rate`` (its pacer is open loop the same way) in a fresh process per point.

Latencies go into an HDR-style histogram (``LatencyHistogram``, about 1% resolution);
answers other than success are counted by kind (``http_429``, ``grpc_RESOURCE_EXHAUSTED``,
``event_error`` for an event answered with an error, ``client_backlog`` for requests the client
could not start because too many were in flight).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import numpy as np

from aisp.errors import ConfigError
from aisp.observe.latency import LatencyHistogram

__all__ = ["GrpcPipeline", "HttpPipeline", "LoadSpec", "PointResult", "run_point", "workload_lines"]

MAX_IN_FLIGHT = 4096  # requests; beyond this the client counts a scheduled request as a backlog error


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """One load point. ``rate`` (events/s) > 0: open loop; else ``concurrency`` requests in
    flight (closed loop). The first ``warmup_s`` is sent but not measured."""

    rate: float = 0.0
    concurrency: int = 0
    duration_s: float = 5.0
    warmup_s: float = 0.5
    events_per_request: int = 1
    slo_ms: float = 50.0

    def __post_init__(self) -> None:
        if (self.rate > 0) == (self.concurrency > 0):
            raise ConfigError("give a rate (open loop) or a concurrency (closed loop), not both")
        if self.duration_s <= 0 or self.events_per_request < 1:
            raise ConfigError("duration_s must be > 0 and events_per_request >= 1")

    @property
    def mode(self) -> str:
        return "open" if self.rate > 0 else "closed"


@dataclass
class PointResult:
    """What one load point measured (latencies in ms, rates in events/s)."""

    mode: str
    offered_rate: float
    concurrency: int
    duration_s: float
    events_sent: int
    events_ok: int
    achieved_rate: float
    latency_ms: dict[str, float]
    slo_ms: float
    slo_attainment: float
    errors: dict[str, int] = field(default_factory=dict)
    client_cpu_share: float = 0.0
    """The load generator's CPU over the point (1.0: a core): near 1, the client, not the
    target, may be what limits the rate; send more events per request."""

    @property
    def error_share(self) -> float:
        return sum(self.errors.values()) / max(self.events_sent, 1)

    def meets_slo(self) -> bool:
        """p99 within the SLO, at most 0.1% errors, and the offered rate was kept up with."""
        kept_up = self.mode == "closed" or self.achieved_rate >= 0.95 * self.offered_rate
        return self.latency_ms["p99"] <= self.slo_ms and self.error_share <= 0.001 and kept_up

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "meets_slo": self.meets_slo()}


def workload_lines(n: int, data: str | None = None, seed: int = 0) -> list[bytes]:
    """``n`` event lines: from a JSON-lines file (cycled), or generated workload-F events."""
    if data is not None:
        lines = [x for x in Path(data).read_bytes().splitlines() if x.strip()]
        if not lines:
            raise ConfigError(f"{data!r} holds no lines")
        return [lines[i % len(lines)] for i in range(n)]
    from aisp.ingest.base import SourceContext
    from aisp.ingest.generator import WorkloadFSource
    from aisp.sinks.base import RowEncoder

    part = WorkloadFSource(events=n, seed=seed).open(SourceContext("bench", lambda _: None, 4096))
    encoder = RowEncoder(["id", "user", "amount", "ts", "f"])
    out: list[bytes] = []
    while (batch := part.next_batch(4096)) is not None and batch.num_rows:
        out += encoder.encode(batch).splitlines()
    return out


class Target(Protocol):
    """Sends one request of NDJSON lines; returns (events ok, error kinds counted)."""

    name: str

    async def open(self) -> None: ...

    async def send(self, body: bytes, events: int) -> tuple[int, Counter[str]]: ...

    async def close(self) -> None: ...


class HttpPipeline:
    """``POST {base}/events`` of a served pipeline (``http://HOST:PORT/v1/pipelines/NAME``)."""

    def __init__(self, url: str) -> None:
        self.name = url
        self.url = url.rstrip("/") + ("" if url.rstrip("/").endswith("/events") else "/events")
        self._client: Any = None

    async def open(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(timeout=60, limits=limits)

    async def send(self, body: bytes, events: int) -> tuple[int, Counter[str]]:
        import httpx

        errors: Counter[str] = Counter()
        try:
            r = await self._client.post(self.url, content=body)
        except httpx.HTTPError as exc:
            errors[f"transport_{type(exc).__name__}"] += events
            return 0, errors
        if r.status_code != 200:
            errors[f"http_{r.status_code}"] += events
            return 0, errors
        failed = sum(1 for line in r.content.splitlines() if line.startswith(b'{"error"'))
        if failed:
            errors["event_error"] += failed
        return events - failed, errors

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class _Stream:
    """One long-lived bidirectional stream: requests queued in, answers matched in order."""

    def __init__(self, call: Any, metadata: Any) -> None:
        self.requests: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.pending: deque[asyncio.Future[bytes]] = deque()
        self.dead = False

        async def outgoing() -> AsyncIterator[bytes]:
            while (body := await self.requests.get()) is not None:
                yield body

        self.call = call(outgoing(), metadata=metadata)
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        error: Exception = RuntimeError("stream ended")  # the server ended it (a refusal)
        try:
            async for answer in self.call:
                self.pending.popleft().set_result(bytes(answer))
        except Exception as exc:  # noqa: BLE001 - every request waiting on this stream fails with it
            error = exc
        self.dead = True
        while self.pending:
            self.pending.popleft().set_exception(error)

    async def send(self, body: bytes) -> bytes:
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        await self.requests.put(body)
        return await future

    async def close(self) -> None:
        await self.requests.put(None)
        await self.reader


class GrpcPipeline:
    """The served pipeline's gRPC stream (``grpc://HOST:PORT/NAME``), the way a client feeds
    it: ``streams`` long-lived bidirectional streams, each request one message, answered in
    order on its stream; a stream the server ends (a refusal) is opened again."""

    def __init__(self, url: str, *, streams: int = 8) -> None:
        parts = urlsplit(url)
        self.name = url
        self.address = parts.netloc
        self.pipeline = parts.path.strip("/")
        self._channel: Any = None
        self._streams: list[_Stream | None] = [None] * streams
        self._next = 0

    async def open(self) -> None:
        import grpc.aio

        self._channel = grpc.aio.insecure_channel(self.address)
        self._call = self._channel.stream_stream("/aisp.v1.Pipelines/Events")

    def _stream(self) -> _Stream:
        i = self._next = (self._next + 1) % len(self._streams)
        stream = self._streams[i]
        if stream is None or stream.dead:
            metadata = (("pipeline", self.pipeline),) if self.pipeline else None
            stream = self._streams[i] = _Stream(self._call, metadata)
        return stream

    async def send(self, body: bytes, events: int) -> tuple[int, Counter[str]]:
        import grpc

        errors: Counter[str] = Counter()
        try:
            answer = await self._stream().send(body)
        except grpc.RpcError as exc:
            errors[f"grpc_{exc.code().name}"] += events
            return 0, errors
        except RuntimeError:
            errors["grpc_stream_ended"] += events
            return 0, errors
        failed = sum(1 for line in answer.splitlines() if line.startswith(b'{"error"'))
        if failed:
            errors["event_error"] += failed
        return events - failed, errors

    async def close(self) -> None:
        for stream in self._streams:
            if stream is not None and not stream.dead:
                await stream.close()
        if self._channel is not None:
            await self._channel.close()


class _Meter:
    """Counts and latencies of one point, measured after the warm-up."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.hist = LatencyHistogram()
        self.sent = self.ok = 0
        self.errors: Counter[str] = Counter()
        self.in_flight = 0

    def record(self, measured: bool, events: int, ok: int, errors: Counter[str], latency_ns: int) -> None:
        if not measured:
            return
        self.sent += events
        self.ok += ok
        self.errors.update(errors)
        if ok:
            self.hist.record(np.full(ok, latency_ns, dtype=np.int64))

    def result(self, seconds: float) -> PointResult:
        lat = self.hist.summary_ms()
        within = self.hist.cumulative([self.spec.slo_ms * 1e6])[0] if self.hist.count else 0
        return PointResult(
            mode=self.spec.mode,
            offered_rate=self.spec.rate,
            concurrency=self.spec.concurrency,
            duration_s=round(seconds, 3),
            events_sent=self.sent,
            events_ok=self.ok,
            achieved_rate=round(self.ok / seconds, 1) if seconds > 0 else 0.0,
            latency_ms=lat,
            slo_ms=self.spec.slo_ms,
            slo_attainment=round(within / self.sent, 4) if self.sent else 0.0,
            errors=dict(self.errors),
        )


async def _one(
    target: Target, body: bytes, events: int, start_ns: int, measured: bool, meter: _Meter
) -> None:
    meter.in_flight += 1
    try:
        ok, errors = await target.send(body, events)
    finally:
        meter.in_flight -= 1
    meter.record(measured, events, ok, errors, time.monotonic_ns() - start_ns)


async def _open_loop(target: Target, bodies: list[bytes], spec: LoadSpec, meter: _Meter) -> None:
    k = spec.events_per_request
    interval_ns = int(k / spec.rate * 1e9)
    begin = time.monotonic_ns() + 10_000_000
    measure_from = begin + int(spec.warmup_s * 1e9)
    end = measure_from + int(spec.duration_s * 1e9)
    tasks: set[asyncio.Task[None]] = set()
    i = 0
    while (due := begin + i * interval_ns) < end:
        now = time.monotonic_ns()
        if due > now:
            await asyncio.sleep((due - now) / 1e9)
        measured = due >= measure_from
        if meter.in_flight >= MAX_IN_FLIGHT:
            meter.record(measured, k, 0, Counter({"client_backlog": k}), 0)
        else:
            task = asyncio.create_task(_one(target, bodies[i % len(bodies)], k, due, measured, meter))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        i += 1
    if tasks:
        await asyncio.gather(*tasks)


async def _closed_loop(target: Target, bodies: list[bytes], spec: LoadSpec, meter: _Meter) -> None:
    k = spec.events_per_request
    begin = time.monotonic_ns()
    measure_from = begin + int(spec.warmup_s * 1e9)
    end = measure_from + int(spec.duration_s * 1e9)
    sent = 0

    async def worker(w: int) -> None:
        nonlocal sent
        while (start := time.monotonic_ns()) < end:
            body = bodies[sent % len(bodies)]
            sent += 1
            await _one(target, body, k, start, start >= measure_from, meter)

    await asyncio.gather(*(worker(w) for w in range(spec.concurrency)))


async def _drive(
    target: Target,
    bodies: list[bytes],
    spec: LoadSpec,
    meter: _Meter,
    progress: Callable[[_Meter], None] | None,
) -> float:
    await target.open()
    stop = asyncio.Event()

    async def report() -> None:
        while not stop.is_set():
            if progress is not None:
                progress(meter)
            await asyncio.sleep(0.25)

    reporter = asyncio.create_task(report())
    try:
        started = time.monotonic()
        loop: Awaitable[None] = (
            _open_loop(target, bodies, spec, meter)
            if spec.mode == "open"
            else _closed_loop(target, bodies, spec, meter)
        )
        await loop
        return time.monotonic() - started - spec.warmup_s
    finally:
        stop.set()
        await reporter
        await target.close()


def run_point(
    target: Target | str,
    spec: LoadSpec,
    *,
    lines: list[bytes] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> PointResult:
    """Run one load point against ``target`` (see ``bench.targets.make_target``)."""
    if isinstance(target, str):
        return _local_point(target, spec)
    k = spec.events_per_request
    lines = lines or workload_lines(max(k * 64, 4096))
    drive = getattr(target, "run", None)
    if drive is not None:  # a broker: its own send and receive loops
        return drive(spec, lines)  # type: ignore[no-any-return]
    bodies = [b"\n".join(lines[i : i + k]) + b"\n" for i in range(0, len(lines) - k + 1, k)]
    meter = _Meter(spec)

    def tick(m: _Meter) -> None:
        if progress is not None:
            progress(
                {
                    "sent": m.sent,
                    "ok": m.ok,
                    "errors": sum(m.errors.values()),
                    "in_flight": m.in_flight,
                    "p99_ms": round(m.hist.percentile(99) / 1e6, 3),
                }
            )

    cpu = time.process_time()
    seconds = asyncio.run(_drive(target, bodies, spec, meter, tick))
    result = meter.result(min(seconds, spec.duration_s) if seconds > 0 else spec.duration_s)
    result.client_cpu_share = round((time.process_time() - cpu) / (seconds + spec.warmup_s), 3)
    return result


def _local_point(pipeline: str, spec: LoadSpec) -> PointResult:
    """``aisp run PIPELINE --rate R`` in a fresh process for warm-up + duration."""
    if spec.mode != "open":
        raise ConfigError("a local pipeline runs open loop: give --rate")
    events = int(spec.rate * (spec.duration_s + spec.warmup_s))
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        cmd = [
            sys.executable,
            "-m",
            "aisp.cli",
            "run",
            pipeline,
            "--rate",
            str(spec.rate),
            "--events",
            str(events),
        ]
        cmd += ["--no-live", "--summary-json", str(summary), "--slo-ms", str(spec.slo_ms)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
        if done.returncode != 0:
            raise ConfigError(f"aisp run failed: {done.stderr.strip()[-500:]}")
        s = json.loads(summary.read_text())
    lat = s["latency_ms"]
    return PointResult(
        mode="open",
        offered_rate=spec.rate,
        concurrency=0,
        duration_s=round(s["seconds"], 3),
        events_sent=int(s["events_in"]),
        events_ok=int(s["events_out"]),
        achieved_rate=round(float(s["events_per_s"]), 1),
        latency_ms=lat,
        slo_ms=spec.slo_ms,
        slo_attainment=round(float(s["slo_attainment"]), 4),
        errors={"dead_letter": int(s["dead_letters"])} if s["dead_letters"] else {},
    )
