"""Load through a broker: events go into a pipeline's input stream on a fixed schedule and its
results are read from its output stream (the pipeline runs on its own, e.g. ``aisp run ...
--input redis://HOST:PORT/IN --output redis://HOST:PORT/OUT``).

Each event gets a fresh id; a result is matched to its event by the ``id`` in its JSON, and the
event's latency runs from its scheduled send to the moment its result is read, so a slow
pipeline cannot hide behind a slow producer (open loop). Results that do not come within
``drain_s`` after the last send are counted as ``no_result``.

Targets: any connector with a load client (``aisp.connectors``), named
``SCHEME://HOST:PORT/IN?output=OUT``: ``redis://`` (Redis Streams, ``&field=data``) and
``nats://`` (JetStream, ``&subject=IN.bench&output_subject=OUT.out``; the streams are created
when they do not exist).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import msgspec

from aisp.bench.load import LoadSpec, PointResult, _Meter
from aisp.connectors import connector_for
from aisp.errors import ConfigError
from aisp.observe.clock import wall_ns

__all__ = ["BrokerTarget"]


class BrokerTarget:
    """The open-loop driver over a connector's ``LoadClient`` (see the module docstring)."""

    def __init__(self, url: str, *, drain_s: float = 10.0) -> None:
        self.name = url
        self.client = connector_for(url).load_client(url)
        self.drain_s = drain_s

    def run(self, spec: LoadSpec, lines: list[bytes]) -> PointResult:
        if spec.mode != "open":
            raise ConfigError("a broker target runs open loop: give --rate")
        templates = [msgspec.json.decode(x) for x in lines]
        meter = _Meter(spec)
        seconds = asyncio.run(self._drive(spec, templates, meter))
        return meter.result(seconds)

    async def _drive(self, spec: LoadSpec, templates: list[dict[str, Any]], meter: _Meter) -> float:
        await self.client.connect()
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
            await self.client.close()

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
            await self.client.publish(events)
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
            payloads = await self.client.results()
            now = time.monotonic_ns()
            for data in payloads:
                row = decode(data) if data else None
                eid = row.get("id") if isinstance(row, dict) else None
                if eid in sent:
                    due, measured = sent.pop(eid)
                    meter.record(measured, 1, 1, Counter(), now - due)
