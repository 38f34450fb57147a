"""A pipeline whose schema is ``RawMessage`` served for real: each HTTP body, WebSocket message
or gRPC message is one event's bytes (an image here), a bad one answered with its reason."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import cv2
import grpc
import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

from tests.support.serving import aisp_serve, wait_http

PIPELINE = """
from aisp import NullSink, Pipeline, TestingSource
from aisp.ingest import RawMessage
from aisp.transform.media.images import ImagePreprocess


def build() -> Pipeline:
    p = Pipeline("shapes", output_columns=["image_height", "image_width"])
    src = p.source("in", TestingSource([]), schema=RawMessage)
    src.apply("prep", ImagePreprocess(column="data", size=(16, 16))).sink("out", NullSink())
    return p
"""


def image(h: int, w: int) -> bytes:
    return cv2.imencode(".png", np.full((h, w, 3), 7, np.uint8))[1].tobytes()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    path = tmp_path_factory.mktemp("raw") / "pipeline.py"
    path.write_text(PIPELINE)
    with aisp_serve(Path(path), http=True, grpc=True) as (addresses, _):
        wait_http(addresses["http"])
        yield addresses


def test_each_http_body_is_one_image(served: dict[str, str]) -> None:
    url = f"http://{served['http']}/v1/pipelines/shapes/events"
    data = image(30, 50)
    r = httpx.post(url, content=data, headers={"content-type": "image/png"}, timeout=30)
    assert r.status_code == 200, r.text
    assert json.loads(r.content) == {"image_height": 30, "image_width": 50}
    bad = httpx.post(url, content=b"GIF89a not supported", timeout=30)
    assert "unsupported image format: GIF" in bad.text


def test_each_websocket_message_is_one_image(served: dict[str, str]) -> None:
    with connect(f"ws://{served['http']}/v1/pipelines/shapes/ws") as ws:
        for h in (10, 20, 30):
            ws.send(image(h, h + 1))
        ws.send(b"")
        answers: list[dict[str, int]] = []
        while len(answers) < 3:  # results come as NDJSON, one or more to a message
            answers += [json.loads(x) for x in str(ws.recv()).splitlines()]
    assert sorted(a["image_height"] for a in answers) == [10, 20, 30]


def test_each_grpc_message_is_one_image(served: dict[str, str]) -> None:
    with grpc.insecure_channel(served["grpc"]) as channel:
        call = channel.stream_stream("/aisp.v1.Pipelines/Events")
        answers = list(call(iter([image(12, 13), b"\x89PNG\r\n\x1a\ntruncated"]), timeout=60))
    got = [json.loads(a) for a in answers]
    assert got[0] == {"image_height": 12, "image_width": 13}
    assert "truncated PNG" in json.dumps(got[1])


PHOTOS = """
import msgspec
from aisp import NullSink, Pipeline, TestingSource
from aisp.transform.media.images import ImagePreprocess


class Photo(msgspec.Struct):
    id: str
    image: bytes


def build() -> Pipeline:
    p = Pipeline("photos", output_columns=["id", "image_height", "image_width"])
    src = p.source("in", TestingSource([]), schema=Photo)
    src.apply("prep", ImagePreprocess(size=(16, 16))).sink("out", NullSink())
    return p
"""


def photo(min_bytes: int) -> bytes:
    """A JPEG of noise of at least ``min_bytes`` (a phone photo's size)."""
    side = 256
    while True:
        noise = np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8)
        data = cv2.imencode(".jpg", noise, [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes()
        if len(data) >= min_bytes:
            return data
        side += 128


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("photos") / "pipeline.py"
    path.write_text(PHOTOS)
    with aisp_serve(Path(path), http=True, grpc=False) as (addresses, _):
        wait_http(addresses["http"])
        yield f"http://{addresses['http']}/v1/pipelines/photos/events"


def test_a_photo_of_megabytes_as_base64_in_json_is_one_line_taken_whole(photos: str) -> None:
    data = photo(1_200_000)
    line = json.dumps({"id": "p", "image": base64.b64encode(data).decode()})
    assert len(line) > 1 << 20  # longer than the line limit of pipelines without bytes fields
    for chunk in (None, 65536):  # sent whole, and in pieces of 64 KiB
        body = line.encode() if chunk is None else _pieces(line.encode(), chunk)
        r = httpx.post(photos, content=body, timeout=60)
        assert r.status_code == 200, r.text[:300]
        side = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR).shape[0]
        assert json.loads(r.content) == {"id": "p", "image_height": side, "image_width": side}


def _pieces(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_a_line_past_the_media_limit_is_413_with_a_json_reason(photos: str) -> None:
    from aisp.serve.http.events import MEDIA_LINE_BYTES

    filler = b"A" * (MEDIA_LINE_BYTES + 4)
    body = b'{"id": "big", "image": "' + filler + b'"}\n'
    r = httpx.post(photos, content=body, timeout=60)
    assert r.status_code == 413
    assert r.json() == {"error": f"a line is longer than {MEDIA_LINE_BYTES} bytes"}
    small = httpx.post(
        photos, content=json.dumps({"id": "s", "image": base64.b64encode(image(5, 6)).decode()})
    )
    assert small.status_code == 200 and json.loads(small.content)["image_width"] == 6


def test_the_line_limit_follows_the_schema() -> None:
    """1 MiB for JSON events without bytes; the base64 of a raw event's limit with them."""
    from types import SimpleNamespace

    import msgspec

    from aisp.serve.http.events import MEDIA_LINE_BYTES, RAW_MAX_BYTES, Events, carries_bytes

    class Plain(msgspec.Struct):
        id: str
        f: list[float]

    class Nested(msgspec.Struct):
        id: str
        parts: list[dict[str, bytes | None]]

    events = Events({}, limiter=None, admission_wait_s=0.0)

    def limit(schema: type) -> int:
        return events.line_limit(SimpleNamespace(pipeline=SimpleNamespace(input_schema=schema)))  # type: ignore[arg-type]

    assert not carries_bytes(Plain) and carries_bytes(Nested)
    assert limit(Plain) == 1 << 20
    assert limit(Nested) == MEDIA_LINE_BYTES >= RAW_MAX_BYTES * 4 // 3
