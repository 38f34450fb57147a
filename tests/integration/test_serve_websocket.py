"""`aisp serve PIPELINE` over a WebSocket (`/v1/pipelines/{p}/ws`), with a real client library:
every result once, in order, equal to `aisp run` on the same file; bad lines answered in place;
refusals close the socket with a clear code and reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from benchmarks.workload import write_events
from tests.support.serving import aisp_serve, wait_http

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
EVENTS = 12_000


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[bytes], list[dict[str, object]]]:
    """The events, and what `aisp run` writes for them."""
    tmp = tmp_path_factory.mktemp("ws")
    write_events(tmp / "events.jsonl", EVENTS, seed=11)
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--input", str(tmp / "events.jsonl")]
    cmd += ["--output", str(tmp / "out.jsonl"), "--no-live"]
    subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, check=True, capture_output=True)
    expected = [json.loads(x) for x in (tmp / "out.jsonl").read_bytes().splitlines()]
    return (tmp / "events.jsonl").read_bytes().splitlines(), sorted(expected, key=lambda r: r["id"])  # type: ignore[arg-type, return-value]


@pytest.fixture
def address() -> Iterator[str]:
    """A fresh server per test: the pipeline's keyed state starts empty, as in `aisp run`."""
    with aisp_serve(PIPELINE, http=True, grpc=False) as (addresses, _):
        wait_http(addresses["http"])
        yield addresses["http"]


def stream(
    ws: ClientConnection, messages: list[bytes], *, binary: bool = False
) -> tuple[list[bytes], int | None]:
    """Send ``messages`` (text frames, or binary ones) then the end (an empty message) while
    reading every result line until the server closes; the lines and the close code."""
    lines: list[bytes] = []

    def read() -> None:
        try:
            for message in ws:
                lines.extend(
                    message.encode().splitlines() if isinstance(message, str) else message.splitlines()
                )
        except ConnectionClosed:
            pass

    reader = threading.Thread(target=read)
    reader.start()
    for m in messages:
        ws.send(m if binary else m.decode())
    ws.send(b"" if binary else "")
    reader.join(120)
    assert not reader.is_alive()
    return lines, ws.close_code


def test_a_stream_of_events_gets_every_result_once_in_order_as_aisp_run_writes_it(
    address: str, data: tuple[list[bytes], list[dict[str, object]]]
) -> None:
    events, expected = data
    messages = [b"\n".join(events[i : i + 250]) + b"\n" for i in range(0, len(events), 250)]
    with connect(f"ws://{address}/v1/pipelines/fraud/ws", max_size=None) as ws:
        lines, code = stream(ws, messages)
    assert code == 1000
    rows = [json.loads(x) for x in lines]
    assert [r["id"] for r in rows] == [e["id"] for e in expected]  # once each, in the events' order
    for r, e in zip(rows, expected, strict=True):
        assert (r["user"], r["alert"], r["n"], r["mean_amount"]) == (
            e["user"],
            e["alert"],
            e["n"],
            e["mean_amount"],
        )
        assert abs(r["score"] - e["score"]) <= 1e-5  # type: ignore[operator]


@pytest.mark.parametrize("seed", [8, 9])
def test_binary_frames_of_any_size_and_no_compression(
    address: str, data: tuple[list[bytes], list[dict[str, object]]], seed: int
) -> None:
    """The server declines permessage-deflate (the client offers it by default); binary frames
    carry the same events as text ones, split at seeded sizes, one event a frame included."""
    events, expected = data
    rng = np.random.default_rng(seed)
    messages, i = [], 0
    while i < len(events):
        n = int(rng.choice([1, 3, 97, 500, 2000]))
        messages.append(b"\n".join(events[i : i + n]))
        i += n
    with connect(f"ws://{address}/v1/pipelines/fraud/ws", max_size=None) as ws:
        assert ws.protocol.extensions == [], f"seed {seed}"
        lines, code = stream(ws, messages, binary=True)
    assert code == 1000
    assert [json.loads(x)["id"] for x in lines] == [e["id"] for e in expected], f"seed {seed}"


def test_bad_lines_are_answered_in_place_and_the_stream_goes_on(
    address: str, data: tuple[list[bytes], list[dict[str, object]]]
) -> None:
    events, _ = data
    messages = [events[0] + b"\n{broken\n" + events[1], b"\n".join(events[2:5])]
    with connect(f"ws://{address}/v1/pipelines/fraud/ws") as ws:
        lines, code = stream(ws, messages)
    assert code == 1000
    rows = [json.loads(x) for x in lines]
    assert len(rows) == 6 and "error" in rows[1] and rows[1]["line"] == 2
    assert [r["id"] for r in rows if "id" in r] == [json.loads(e)["id"] for e in events[:5]]


def test_refusals_close_with_a_code_and_the_reason(address: str) -> None:
    with connect(f"ws://{address}/v1/pipelines/nope/ws") as ws, pytest.raises(ConnectionClosed):
        ws.recv(timeout=10)
    assert ws.close_code == 4404 and "no pipeline 'nope'" in (ws.close_reason or "")
    headers = {"X-Tier": "platinum"}
    with (
        connect(f"ws://{address}/v1/pipelines/fraud/ws", additional_headers=headers) as ws,
        pytest.raises(ConnectionClosed),
    ):
        ws.recv(timeout=10)
    assert ws.close_code == 4400 and "X-Tier" in (ws.close_reason or "")


def test_tokens_guard_the_socket() -> None:
    with aisp_serve(PIPELINE, http=True, grpc=False, extra_env={"AISP_TOKENS": "t0k"}) as (addresses, _):
        wait_http(addresses["http"])
        url = f"ws://{addresses['http']}/v1/pipelines/fraud/ws"
        with connect(url) as ws, pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 4401 and ws.close_reason == "unauthorized"
        with connect(url, additional_headers={"Authorization": "Bearer t0k"}) as ws:
            ws.send('{"id":1,"user":"u1","amount":2.5,"ts":1,"f":[' + ",".join(["0.1"] * 16) + "]}")
            assert json.loads(ws.recv(timeout=30))["id"] == 1
