"""Load through a broker: events go into a pipeline's input stream on a fixed schedule and its
results are read from its output stream (the pipeline runs on its own, e.g. ``aisp run ...
--input redis://HOST:PORT/IN --output redis://HOST:PORT/OUT``).

Each event gets a fresh id; a result is matched to its event by the ``id`` in its JSON, and the
event's latency runs from its scheduled send to the moment its result is read, so a slow
pipeline cannot hide behind a slow producer (open loop). Results that do not come within
``drain_s`` after the last send are counted as ``no_result``.

Targets: ``redis://HOST:PORT/IN?output=OUT[&field=data]`` (Redis Streams) and
``nats://HOST:PORT/IN?output=OUT[&subject=IN.bench][&output_subject=OUT.out]`` (JetStream; the
input stream is created, on ``IN.>``, when it does not exist).
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections import Counter
from typing import Any
from urllib.parse import parse_qs, urlparse

import msgspec

from aisp.bench.load import LoadSpec, PointResult, _Meter
from aisp.errors import ConfigError
from aisp.observe.clock import wall_ns

__all__ = ["JetStreamTarget", "RedisStreamsTarget"]


class _BrokerTarget(abc.ABC):
    """The open-loop driver; a subclass publishes events and reads results."""

    def __init__(self, url: str, *, drain_s: float = 10.0) -> None:
        parsed = urlparse(url)
        self.name = url
        self.options = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port
        self.stream = parsed.path.lstrip("/")
        self.output = self.options.get("output", "")
        if not self.stream or not self.output:
            scheme = parsed.scheme
            raise ConfigError(
                f"{url!r}: give the input and output streams, as {scheme}://HOST:PORT/IN?output=OUT"
            )
        self.drain_s = drain_s

    @abc.abstractmethod
    async def connect(self) -> None:
        """Connect, and start reading results from now on."""

    @abc.abstractmethod
    async def publish(self, events: list[bytes]) -> None: ...

    @abc.abstractmethod
    async def results(self) -> list[bytes]:
        """Result payloads that arrived (waits briefly when there are none)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    def run(self, spec: LoadSpec, lines: list[bytes]) -> PointResult:
        if spec.mode != "open":
            raise ConfigError("a broker target runs open loop: give --rate")
        templates = [msgspec.json.decode(x) for x in lines]
        meter = _Meter(spec)
        seconds = asyncio.run(self._drive(spec, templates, meter))
        return meter.result(seconds)

    async def _drive(self, spec: LoadSpec, templates: list[dict[str, Any]], meter: _Meter) -> float:
        await self.connect()
        try:
            sent: dict[int, tuple[int, bool]] = {}  # id -> (scheduled send, measured)
            base = wall_ns() // 1000 * 1000  # ids no earlier point or run used
            sending, answered = asyncio.Event(), asyncio.Event()
            reader = asyncio.create_task(self._read(sent, meter, sending, answered))
            started = time.monotonic()
            await self._send(spec, templates, sent, base)
            sending.set()
            try:
                await asyncio.wait_for(answered.wait(), timeout=self.drain_s)
            except TimeoutError:
                pass  # the rest are counted as lost below
            answered.set()
            await reader
            seconds = min(time.monotonic() - started - spec.warmup_s, spec.duration_s)
            lost = sum(1 for _, measured in sent.values() if measured)
            if lost:
                meter.record(True, lost, 0, Counter({"no_result": lost}), 0)
            return seconds
        finally:
            await self.close()

    async def _send(
        self, spec: LoadSpec, templates: list[dict[str, Any]], sent: dict[int, tuple[int, bool]], base: int
    ) -> None:
        k = spec.events_per_request
        interval_ns = int(k / spec.rate * 1e9)
        begin = time.monotonic_ns() + 10_000_000
        measure_from = begin + int(spec.warmup_s * 1e9)
        end = measure_from + int(spec.duration_s * 1e9)
        encode = msgspec.json.encode
        i = n = 0
        while (due := begin + i * interval_ns) < end:
            now = time.monotonic_ns()
            if due > now:
                await asyncio.sleep((due - now) / 1e9)
            events = []
            for _ in range(k):
                eid = base + n
                events.append(encode({**templates[n % len(templates)], "id": eid}))
                sent[eid] = (due, due >= measure_from)
                n += 1
            await self.publish(events)
            i += 1

    async def _read(
        self,
        sent: dict[int, tuple[int, bool]],
        meter: _Meter,
        sending: asyncio.Event,
        answered: asyncio.Event,
    ) -> None:
        """Match results to events until every sent event is answered (or ``answered`` is set
        from outside: the drain time is up)."""
        decode = msgspec.json.decode
        while not answered.is_set():
            if sending.is_set() and not sent:
                answered.set()
                break
            payloads = await self.results()
            now = time.monotonic_ns()
            for data in payloads:
                row = decode(data) if data else None
                eid = row.get("id") if isinstance(row, dict) else None
                if eid in sent:
                    due, measured = sent.pop(eid)
                    meter.record(measured, 1, 1, Counter(), now - due)


class RedisStreamsTarget(_BrokerTarget):
    """Events XADDed to stream ``IN``, results read from stream ``OUT`` (field ``field``)."""

    def __init__(self, url: str, *, drain_s: float = 10.0) -> None:
        super().__init__(url, drain_s=drain_s)
        self.field = self.options.get("field", "data")
        self._r: Any = None
        self._last: Any = b"0-0"

    async def connect(self) -> None:
        import redis.asyncio as redis

        self._r = redis.Redis(host=self.host, port=self.port or 6379)
        last = await self._r.xrevrange(self.output, count=1)
        self._last = last[0][0] if last else b"0-0"

    async def publish(self, events: list[bytes]) -> None:
        pipe = self._r.pipeline(transaction=False)
        for event in events:
            pipe.xadd(self.stream, {self.field: event})
        await pipe.execute()

    async def results(self) -> list[bytes]:
        reply = await self._r.xread({self.output: self._last}, count=1000, block=50)
        out = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self._last = entry_id
                out.append(fields.get(self.field.encode(), b""))
        return out

    async def close(self) -> None:
        if self._r is not None:
            await self._r.aclose()


class JetStreamTarget(_BrokerTarget):
    """Events published to ``subject`` of stream ``IN``, results read from stream ``OUT``
    (new messages only, an ephemeral consumer)."""

    def __init__(self, url: str, *, drain_s: float = 10.0) -> None:
        super().__init__(url, drain_s=drain_s)
        self.subject = self.options.get("subject", f"{self.stream}.bench")
        self.output_subject = self.options.get("output_subject", f"{self.output}.out")
        self._nc: Any = None
        self._sub: Any = None

    async def connect(self) -> None:
        import nats
        from nats.js.api import DeliverPolicy, StreamConfig

        from aisp.sinks.nats_jetstream import ensure_stream

        self._nc = await nats.connect(f"nats://{self.host}:{self.port or 4222}", connect_timeout=5)
        js = self._nc.jetstream()
        for name, subjects in ((self.stream, [f"{self.stream}.>"]), (self.output, [self.output_subject])):
            await ensure_stream(js, StreamConfig(name=name, subjects=subjects))
        self._js = js
        self._sub = await js.subscribe(
            self.output_subject, stream=self.output, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
        )

    async def publish(self, events: list[bytes]) -> None:
        await asyncio.gather(*(self._js.publish(self.subject, event) for event in events))

    async def results(self) -> list[bytes]:
        import nats

        out = []
        try:
            out.append((await self._sub.next_msg(timeout=0.05)).data)
            while True:
                out.append((await self._sub.next_msg(timeout=0.0001)).data)
        except nats.errors.TimeoutError:  # nothing more now
            return out

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
