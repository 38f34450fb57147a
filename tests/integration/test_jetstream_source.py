"""The JetStream source against the real NATS server at 127.0.0.1:4222."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec

from aisp.connectors.nats.source import JetStreamSource
from aisp.ingest.base import SourceContext


class Ev(msgspec.Struct):
    id: int


async def _fill(stream: str, n: int) -> None:
    import nats
    from nats.js.api import StreamConfig

    nc = await nats.connect("nats://127.0.0.1:4222")
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    await asyncio.gather(*(js.publish(f"{stream}.ev", msgspec.json.encode({"id": i})) for i in range(n)))
    await nc.close()


async def _steal(stream: str, durable: str, n: int) -> None:
    """Ask the server for ``n`` messages of the consumer with a reply subject nobody reads: they
    count as delivered, as when a reply is lost in a disconnect."""
    import json

    import nats

    nc = await nats.connect("nats://127.0.0.1:4222")
    got: list[Any] = []

    async def lost(msg: Any) -> None:
        got.append(msg)

    await nc.subscribe("_INBOX.lost", cb=lost)
    request = json.dumps({"batch": n, "no_wait": True}).encode()
    await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", request, reply="_INBOX.lost")
    for _ in range(100):
        await asyncio.sleep(0.02)
        if got and got[-1].headers:  # the end of the batch: a status message
            break
    await nc.close()
    assert len(got) > 1


async def _drop(stream: str) -> None:
    import nats

    nc = await nats.connect("nats://127.0.0.1:4222")
    await nc.jetstream().delete_stream(stream)
    await nc.close()


def test_messages_delivered_into_a_lost_reply_at_the_end_are_read_before_the_input_ends() -> None:
    stream = f"AISPLOST{uuid.uuid4().hex[:8].upper()}"
    asyncio.run(_fill(stream, 300))
    dead: list[Any] = []
    try:
        cfg = JetStreamSource(stream=stream, schema=Ev, durable="c", stop_when_idle_s=1.0, retry_s=10)
        part = cfg.open(SourceContext("src", dead.extend, 100))
        seen = part.next_batch(100).numpy("id").tolist()  # type: ignore[union-attr]
        asyncio.run(_steal(stream, "c", 1000))  # the rest, with nothing after it to show the gap
        for _ in range(100):  # bounded: the input ends after 1 s of quiet
            batch = part.next_batch(100)
            if batch is None:
                break
            seen += batch.numpy("id").tolist()
        part.close()
        assert seen == list(range(300))  # none lost, in order, before the input ended
        assert not dead
    finally:
        asyncio.run(_drop(stream))
