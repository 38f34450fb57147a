"""A pipeline whose schema is ``RawMessage`` served for real: each HTTP body, WebSocket message
or gRPC message is one event's bytes (an image here), a bad one answered with its reason."""

from __future__ import annotations

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
from aisp.transform.images import ImagePreprocess


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
