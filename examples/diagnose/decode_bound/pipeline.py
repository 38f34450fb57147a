"""Planted: image decoding. Each event is a 1024 x 768 PNG (noise: nothing for the codec to
skip, and PNG has no reduced-scale decoding as JPEG does) made into a 64 x 64 tensor: about
10 ms of decoding an image on one core. At 300 images/s the step's decoding pool (one thread per
core) is busy all the time; the model after it is a trifle.

    aisp run examples/diagnose/decode_bound/pipeline.py --rate 300 --metrics-port 9464
"""

from __future__ import annotations

from typing import Any

import cv2
import msgspec
import numpy as np

from aisp import NullSink, Pipeline, TestingSource
from aisp.transform.media.images import ImagePreprocess

RATE = 300


class Row(msgspec.Struct):
    id: int
    image: bytes


def images(kinds: int = 4) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [
        cv2.imencode(".png", rng.integers(0, 255, (768, 1024, 3), dtype=np.uint8))[1].tobytes()
        for _ in range(kinds)
    ]


def build(events: int = 20_000) -> Pipeline:
    pngs = images()
    rows: list[dict[str, Any]] = [{"id": i, "image": pngs[i % len(pngs)]} for i in range(int(events))]
    p = Pipeline("decode_bound", output_columns=["id", "brightness"])
    prepared = p.source("images", TestingSource(rows, batch_rows=16), schema=Row).apply(
        "prepare", ImagePreprocess(size=(64, 64)), latency_budget_ms=20.0
    )
    prepared.map_batch(
        "brightness", lambda b: b.with_columns({"brightness": b.numpy("pixels").mean(axis=1)})
    ).sink("out", NullSink())
    return p
