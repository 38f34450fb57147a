"""Sliding-window anomaly control of a served pipeline, over a real `aisp serve`: driven above
its threshold with anomalous scores it answers 429 with Retry-After within 3 windows, its
admitted rate falls, it recovers once the anomaly ends, and every accepted event is answered."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import msgspec
import pytest
from hypothesis import strategies as st

from tests.support.serving import aisp_serve, wait_http

PIPELINE = """
import msgspec
from aisp import NullSink, Pipeline, TestingSource

class Event(msgspec.Struct):
    id: int
    score: float

def build():
    p = Pipeline("scores", output_columns=["id", "score"])
    p.source("events", TestingSource([]), schema=Event).sink("out", NullSink())
    return p
"""
WINDOW_S = 1.0
POLICY = {
    "rate_events_per_s": 4000, "window_s": WINDOW_S, "step_s": 0.25, "max_events_per_s": 300,
    "score_column": "score", "score_threshold": 0.92, "max_score_share": 0.5, "consecutive": 2,
    "decrease": 0.5, "increase_events_per_s": 1000, "min_rate_events_per_s": 100, "retry_after_ms": 150,
}  # fmt: skip


@pytest.fixture
def server(tmp_path: Path) -> Any:
    (tmp_path / "pipeline.py").write_text(PIPELINE)
    table = "\n".join(f"{k} = {json.dumps(v)}" for k, v in POLICY.items())
    (tmp_path / "serve.toml").write_text(f"[anomaly.scores]\n{table}\n")
    args = ("--config", str(tmp_path / "serve.toml"))
    with aisp_serve(tmp_path / "pipeline.py", http=True, grpc=True, extra_args=args) as (addresses, _):
        wait_http(addresses["http"])
        yield addresses


def drive(
    url: str, score: float, seconds: float, start_id: int
) -> tuple[list[httpx.Response], dict[int, Any]]:
    """50-event requests at about 1000 events/s; the responses, and the results by event id."""
    responses, answered = [], {}
    next_id, end = start_id, time.monotonic() + seconds
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < end:
            body = "".join(json.dumps({"id": next_id + i, "score": score}) + "\n" for i in range(50))
            r = client.post(url, content=body)
            responses.append(r)
            if r.status_code == 200:
                for line in r.content.splitlines():
                    row = json.loads(line)
                    answered[row["id"]] = row
            next_id += 50
            time.sleep(0.05)
    return responses, answered


def test_anomalous_load_is_refused_then_admitted_again_and_nothing_accepted_is_lost(
    server: dict[str, str],
) -> None:
    base = f"http://{server['http']}/v1/pipelines/scores"
    started = time.monotonic()
    anomalous, answered = drive(f"{base}/events", 0.99, 4 * WINDOW_S, 0)
    refused = [r for r in anomalous if r.status_code == 429]
    assert refused, "never refused"
    first = anomalous.index(refused[0])
    assert first * 0.05 < 3 * WINDOW_S + 0.5, f"the first 429 came after {first} requests"
    assert int(refused[0].headers["Retry-After"]) >= 1
    assert 0.1 <= int(refused[0].headers["Retry-After-Ms"]) / 1000 <= 0.2  # about 150 ms, +-30%
    assert "anomaly" in refused[0].json()["error"] and refused[0].json()["retry_after_ms"] >= 105
    status = httpx.get(f"{base}/anomaly").json()
    assert status["triggered"] >= 1 and status["rate_events_per_s"] < POLICY["rate_events_per_s"]
    assert status["window"]["score_share"] > 0.5
    low_rate = status["rate_events_per_s"]
    metrics = httpx.get(f"http://{server['http']}/metrics").text
    assert "aisp_anomaly_triggered_total" in metrics and "aisp_admitted_rate_events_per_second" in metrics

    normal, answered_after = drive(f"{base}/events", 0.1, 5 * WINDOW_S, 1_000_000)
    status = httpx.get(f"{base}/anomaly").json()
    assert status["rate_events_per_s"] > low_rate  # additive increase once the condition clears
    assert [r.status_code for r in normal[-5:]] == [200] * 5, "not admitted again"
    assert time.monotonic() - started < 30
    for responses, rows in ((anomalous, answered), (normal, answered_after)):
        accepted = sum(50 for r in responses if r.status_code == 200)
        assert len(rows) == accepted  # every accepted event answered, once
        assert all("error" not in row for row in rows.values())


def test_grpc_refuses_with_resource_exhausted_and_retry_after_ms(server: dict[str, str]) -> None:
    drive(f"http://{server['http']}/v1/pipelines/scores/events", 0.99, 3 * WINDOW_S, 0)  # trigger it
    channel = grpc.insecure_channel(server["grpc"])
    call = channel.stream_stream("/aisp.v1.Pipelines/Events")
    codes = []
    for _ in range(20):
        body = "".join(json.dumps({"id": i, "score": 0.99}) + "\n" for i in range(400)).encode()
        try:
            list(call(iter([body]), metadata=(("pipeline", "scores"),), timeout=10))
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                trailing = dict(exc.trailing_metadata() or ())
                assert 100 <= int(trailing["retry-after-ms"]) <= 200
                break
    assert "RESOURCE_EXHAUSTED" in codes, codes


def test_the_policy_changes_at_run_time_and_bad_settings_are_400(server: dict[str, str]) -> None:
    url = f"http://{server['http']}/v1/pipelines/scores/anomaly"
    r = httpx.put(url, json={"max_score_share": 0.9, "consecutive": 4})
    assert r.status_code == 200 and r.json()["policy"]["consecutive"] == 4
    for bad in ({"decrease": 2}, {"nope": 1}, {"window_s": "x"}, [1]):
        r = httpx.put(url, json=bad)
        assert r.status_code == 400 and "error" in r.json(), bad
    assert httpx.put(url, content=b"{not json").status_code == 400
    assert httpx.get(f"http://{server['http']}/v1/pipelines/nope/anomaly").status_code == 404


BODIES = st.one_of(
    st.binary(max_size=64),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.sampled_from([*POLICY, "x", ""]), inner, max_size=4)
        ),
        max_leaves=8,
    ).map(lambda v: json.dumps(v).encode()),
)


def test_any_put_body_is_answered_200_or_400_with_json_and_admin_only_with_tokens() -> None:
    from hypothesis import given, settings

    from aisp import NullSink, Pipeline, TestingSource
    from aisp.serve.auth import Tokens
    from aisp.serve.http.app import create_app
    from aisp.serve.pipelines.service import PipelineService

    class Event(msgspec.Struct):
        id: int
        score: float

    p = Pipeline("scores")
    p.source("events", TestingSource([]), schema=Event).sink("out", NullSink())
    service = PipelineService(p)
    service.start()
    tokens = Tokens.of(tokens=["user"], admin_tokens=["root"])
    transport = httpx.ASGITransport(app=create_app(None, pipelines={"scores": service}, tokens=tokens))
    admin = {"authorization": "Bearer root"}

    async def put(body: bytes, headers: dict[str, str]) -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://aisp") as client:
            return await client.put("/v1/pipelines/scores/anomaly", content=body, headers=headers)

    @settings(max_examples=200, deadline=None)
    @given(BODIES)
    def fuzz(body: bytes) -> None:
        r = asyncio.run(put(body, admin))
        assert r.status_code in (200, 400), (body, r.text)
        assert isinstance(r.json(), dict)

    try:
        assert (
            asyncio.run(put(json.dumps(POLICY).encode(), {"authorization": "Bearer user"})).status_code == 403
        )
        assert asyncio.run(put(json.dumps(POLICY).encode(), admin)).status_code == 200  # installs one
        fuzz()
    finally:
        service.close()
