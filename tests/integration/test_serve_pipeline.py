"""`aisp serve PIPELINE`: workload-F events over HTTP NDJSON and the gRPC stream, results back."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from aisp import Batch, CollectSink, Pipeline, WorkloadFSource
from aisp.observe.diagnose.pipeline import Scrape, diagnose
from aisp.observe.export.metrics import PipelineCollector
from aisp.serve.http.app import create_app
from aisp.serve.pipelines.service import PipelineService
from benchmarks.workload import reference_outputs, write_events
from tests.support.serving import aisp_serve, wait_http

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
MODEL = ROOT / "examples" / "fraud" / "model.onnx"
EVENTS = 3000


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[bytes], dict[int, dict[str, object]]]:
    path = tmp_path_factory.mktemp("events") / "events.jsonl"
    write_events(path, EVENTS, seed=3)
    return path.read_bytes().splitlines(), reference_outputs(path, MODEL)


@pytest.fixture
def served() -> Iterator[tuple[dict[str, str], subprocess.Popen[str]]]:
    """A fresh server per test: the pipeline's keyed state starts empty, as in the reference."""
    with aisp_serve(PIPELINE, http=True, grpc=True) as (addresses, proc):
        wait_http(addresses["http"])
        yield addresses, proc


def check_scores(rows: list[dict[str, object]], expected: dict[int, dict[str, object]]) -> None:
    assert [r["id"] for r in rows] == sorted(expected)  # one result per event, in request order
    for r in rows:
        e = expected[r["id"]]  # type: ignore[index]
        assert (r["user"], r["n"], r["mean_amount"]) == (e["user"], e["n"], e["mean_amount"])
        assert abs(r["score"] - e["score"]) <= 1e-5  # type: ignore[operator]


def test_http_chunked_stream_gets_ordered_results_equal_to_the_reference(
    served: tuple[dict[str, str], subprocess.Popen[str]],
    events: tuple[list[bytes], dict[int, dict[str, object]]],
) -> None:
    lines, expected = events
    body = b"\n".join(lines) + b"\n"

    def pieces() -> Iterator[bytes]:  # a chunked body, cut mid-line
        for i in range(0, len(body), 10_007):
            yield body[i : i + 10_007]

    r = httpx.post(f"http://{served[0]['http']}/v1/pipelines/fraud/events", content=pieces(), timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    check_scores([json.loads(x) for x in r.content.splitlines()], expected)


def test_bad_lines_are_answered_in_place_and_fire_and_forget_acks(
    served: tuple[dict[str, str], subprocess.Popen[str]],
    events: tuple[list[bytes], dict[int, dict[str, object]]],
) -> None:
    lines, _ = events
    url = f"http://{served[0]['http']}/v1/pipelines/fraud/events"
    body = b"\n".join([lines[0], b'{"id": 1, "user": "u1"}', b"not json", lines[3]])
    out = [json.loads(x) for x in httpx.post(url, content=body, timeout=30).content.splitlines()]
    assert [o.get("id") for o in out] == [0, None, None, 3]
    assert out[1]["line"] == 2 and "missing required field" in out[1]["error"]
    assert out[2]["line"] == 3 and "malformed" in out[2]["error"]
    r = httpx.post(url, params={"mode": "fire"}, content=b"\n".join([*lines[:100], b"{"]), timeout=30)
    assert r.status_code == 202
    assert r.json()["accepted"] == 100 and r.json()["rejected"] == 1 and r.json()["errors"][0]["line"] == 101
    assert httpx.post(url, params={"mode": "later"}, content=lines[0]).status_code == 400
    missing = httpx.post(f"http://{served[0]['http']}/v1/pipelines/nope/events", content=lines[0])
    assert missing.status_code == 404 and "fraud" in missing.json()["error"]
    deadline = httpx.post(url, content=b"\n".join(lines[:5]), headers={"X-Request-Deadline-Ms": "0.001"})
    assert [json.loads(x)["step"] for x in deadline.content.splitlines()] == ["score"] * 5  # expired there
    listing = httpx.get(f"http://{served[0]['http']}/v1/pipelines").json()
    assert listing[0]["name"] == "fraud" and listing[0]["events_in"] >= 103
    metrics = httpx.get(f"http://{served[0]['http']}/metrics").text
    assert 'aisp_stage_latency_seconds_count{phase="compute",stage="score"}' in metrics
    assert "aisp_e2e_latency_seconds_count" in metrics


def test_grpc_stream_answers_each_message_in_order(
    served: tuple[dict[str, str], subprocess.Popen[str]],
    events: tuple[list[bytes], dict[int, dict[str, object]]],
) -> None:
    lines, expected = events
    with grpc.insecure_channel(served[0]["grpc"]) as channel:
        call = channel.stream_stream("/aisp.v1.Pipelines/Events")
        messages = [b"\n".join(lines[i : i + 250]) for i in range(0, len(lines), 250)]
        answers = list(call(iter(messages), timeout=60))
        assert len(answers) == len(messages)
        assert [len(a.splitlines()) for a in answers] == [250] * len(messages)
        check_scores([json.loads(x) for a in answers for x in a.splitlines()], expected)
        acks = list(call(iter([lines[0], b"{"]), metadata=[("mode", "fire")], timeout=30))
        assert [json.loads(a)["accepted"] for a in acks] == [1, 0]
        with pytest.raises(grpc.RpcError) as info:
            list(call(iter([lines[0]]), metadata=[("pipeline", "nope")], timeout=30))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


class Ev(msgspec.Struct):
    id: int
    x: float


def slow_service(capacity_rows: int) -> PipelineService:
    def slow(b: Batch) -> Batch:
        time.sleep(0.02)
        return b.with_columns({"y": b.numpy("x") + 1})

    p = Pipeline("slow", output_columns=["id", "y"])
    p.source("events", WorkloadFSource(events=1), schema=Ev).map_batch("slow", slow).sink(
        "out", CollectSink(columns=["id", "y"])
    )
    return PipelineService(p, capacity_rows=capacity_rows, batch_rows=8)


def test_overload_gets_429_with_retry_after_and_every_accepted_request_is_answered() -> None:
    service = slow_service(capacity_rows=16)
    service.start()
    app = create_app(None, pipelines={"slow": service})

    async def burst() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://aisp", timeout=60) as client:
            body = b"\n".join(json.dumps({"id": i, "x": i}).encode() for i in range(8))
            return await asyncio.gather(
                *(client.post("/v1/pipelines/slow/events", content=body) for _ in range(60))
            )

    try:
        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) == {200, 429}
        assert all(r.headers["Retry-After"] == "1" for r in responses if r.status_code == 429)
        for r in responses:
            if r.status_code == 200:
                assert [json.loads(x)["y"] for x in r.content.splitlines()] == [
                    float(i + 1) for i in range(8)
                ]
        assert service.tracker.open_chunks == 0
        assert service.admission.accepted == 8 * codes.count(200)
        # a refused request is answered after its first chunk: the events read so far count
        assert codes.count(429) <= service.admission.queue_full <= 8 * codes.count(429)
        registry = CollectorRegistry()
        registry.register(PipelineCollector(service.executor, service.admission))
        findings = diagnose(None, Scrape(generate_latest(registry).decode()))
        # the root cause first: the 20 ms step, over its budget, saturating its thread; then the
        # refusals it causes
        causes = [(f.cause, f.stage) for f in findings]
        assert causes[:2] == [("slow_operator", "slow"), ("admission_overload", "admission")]
    finally:
        assert service.close()
    assert np.isfinite(service.stats.e2e.percentile(99))


def test_sigterm_mid_stream_finishes_the_stream_and_exits_0(
    events: tuple[list[bytes], dict[int, dict[str, object]]],
) -> None:
    lines, expected = events
    with aisp_serve(PIPELINE, http=True, grpc=False) as (addresses, proc):
        wait_http(addresses["http"])

        def taken() -> float:
            """Events the served pipeline has taken in (from its /metrics)."""
            text = httpx.get(f"http://{addresses['http']}/metrics", timeout=30).text
            found = re.search(r'^aisp_events_total\{direction="in"\} (\S+)$', text, re.MULTILINE)
            return float(found.group(1)) if found else 0.0

        def pieces() -> Iterator[bytes]:
            for i in range(0, len(lines), 300):
                if i == 900:
                    deadline = time.monotonic() + 60  # the server reads it (a busy machine: later)
                    while taken() == 0 and time.monotonic() < deadline:
                        time.sleep(0.05)
                    proc.send_signal(signal.SIGTERM)  # the request is being read: it was accepted
                    time.sleep(0.2)
                yield b"\n".join(lines[i : i + 300]) + b"\n"

        r = httpx.post(f"http://{addresses['http']}/v1/pipelines/fraud/events", content=pieces(), timeout=60)
        assert r.status_code == 200
        check_scores([json.loads(x) for x in r.content.splitlines()], expected)
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.TransportError):  # and it took no new request
            httpx.post(f"http://{addresses['http']}/v1/pipelines/fraud/events", content=lines[0], timeout=2)
