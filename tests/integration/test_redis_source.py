"""The Redis Streams source against the real Redis at 127.0.0.1:6379, through a fault proxy."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgspec

from aisp.connectors.redis.source import RedisStreamSource
from aisp.faults import FaultProxy
from aisp.ingest.base import SourceContext
from tests.integration.test_exactly_once import redis_client


class Ev(msgspec.Struct):
    id: int


def test_entries_delivered_in_a_reply_lost_to_a_broken_connection_are_read_again(tmp_path: Path) -> None:
    r = redis_client()
    stream = f"aisp-lost-reply-{uuid.uuid4().hex[:8]}"
    pipe = r.pipeline(transaction=False)  # type: ignore[attr-defined]
    for i in range(300):
        pipe.xadd(stream, {"data": msgspec.json.encode({"id": i})})
    pipe.execute()
    try:
        with FaultProxy(("127.0.0.1", 6379)) as proxy:
            cfg = RedisStreamSource(
                stream=stream, schema=Ev, port=proxy.port, group="g", consumer="c", retry_s=10
            )
            part = cfg.open(SourceContext("src", lambda records: None, 100))
            seen = part.next_batch(100).numpy("id").tolist()  # type: ignore[union-attr]
            # the server hands the next 50 entries to this consumer, but the reply never arrives
            r.xreadgroup("g", "c", {stream: ">"}, count=50)  # type: ignore[attr-defined]
            proxy.reset_connections()
            for _ in range(20):  # bounded: lost entries would never come
                batch = part.next_batch(100)
                assert batch is not None
                seen += batch.numpy("id").tolist()
                if len(seen) >= 300:
                    break
            part.close()
        assert seen == list(range(300))  # none lost, in order
    finally:
        r.delete(stream)  # type: ignore[attr-defined]


def test_raw_image_messages_become_a_binary_column_an_image_step_decodes() -> None:
    import cv2
    import numpy as np

    from aisp import CollectSink, Pipeline
    from aisp.ingest import RawMessage
    from aisp.transform.media.images import ImagePreprocess

    r = redis_client()
    stream = f"aisp-raw-images-{uuid.uuid4().hex[:8]}"
    images = [cv2.imencode(".png", np.full((10 + i, 20, 3), i * 20, np.uint8))[1].tobytes() for i in range(5)]
    for data in [*images[:2], b"not an image", *images[2:]]:
        r.xadd(stream, {"data": data})  # type: ignore[attr-defined]
    try:
        p, out = Pipeline("raw"), CollectSink(columns=["image_height"])
        src = RedisStreamSource(stream=stream, schema=RawMessage, group="g", stop_when_idle_s=0.5)
        p.source("images", src).apply("prep", ImagePreprocess(column="data", size=(8, 8))).sink("out", out)
        summary = p.run()
        assert sorted(row["image_height"] for row in out.rows) == [10, 11, 12, 13, 14]
        assert summary.dead_letters == 1 and summary.dead_letters_by_step == {"prep": 1}
    finally:
        r.delete(stream)  # type: ignore[attr-defined]
