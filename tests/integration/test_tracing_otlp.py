"""Per-event traces reach a real OTLP/HTTP receiver on 127.0.0.1: a span per stage, children
of the event's root span, and the client's ``traceparent`` kept across `aisp serve`."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import grpc
import httpx

from aisp.cli import load_pipeline
from aisp.observe.tracing.spans import TraceConfig
from aisp.runner import ObserveOptions, RunOptions, run
from benchmarks.workload import write_events
from tests.support.otlp import Received, otlp_receiver
from tests.support.serving import aisp_serve, wait_http

ROOT = Path(__file__).resolve().parents[2]
FRAUD = ROOT / "examples" / "fraud" / "pipeline.py"
STAGES = {"events", "by_user", "user_stats", "features", "score", "emit", "out"}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def traces(received: Received) -> dict[bytes, list[Any]]:
    by_trace: dict[bytes, list[Any]] = defaultdict(list)
    for span in received.snapshot():
        by_trace[span.trace_id].append(span)
    return by_trace


def check_event_trace(spans: list[Any]) -> Any:
    """One event's trace: a root with a child span for every stage; returns the root."""
    roots = [s for s in spans if s.name == "aisp.event"]
    assert len(roots) == 1, [s.name for s in spans]
    root = roots[0]
    children = [s for s in spans if s is not root]
    assert {s.name for s in children} == {f"stage {st}" for st in STAGES}
    for child in children:
        assert child.parent_span_id == root.span_id
        assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
    assert root.end_time_unix_nano >= max(c.end_time_unix_nano for c in children) - 1_000_000
    return root


def test_sampled_events_of_a_run_arrive_as_traces_covering_every_stage() -> None:
    with otlp_receiver() as (endpoint, received):
        pipeline = load_pipeline(str(FRAUD), events=20_000)
        trace = TraceConfig(sample_ratio=0.01, max_traces_per_s=0, endpoint=endpoint)
        summary = run(pipeline, RunOptions(observe=ObserveOptions(trace=trace)))
        assert summary.events_out == 20_000
    by_trace = traces(received)
    events = {t: s for t, s in by_trace.items() if any(x.name == "aisp.event" for x in s)}
    # about 1% of 20,000 by the id hash (the first batch may come before the tracer starts)
    assert 120 <= len(events) <= 260, len(events)
    for spans in events.values():
        root = check_event_trace(spans)
        assert root.parent_span_id == b""
    calls = [s for t, spans in by_trace.items() if t not in events for s in spans]
    assert calls and all(s.name == "aisp.batch" for s in calls)
    linked = {link.span_id for s in calls for link in s.links}
    model_spans = {s.span_id for spans in events.values() for s in spans if s.name == "stage score"}
    assert model_spans <= linked  # every event's model span is linked from the call that scored it
    assert {r["service.name"] for r in received.resources} == {"aisp"}


def test_the_rate_cap_bounds_new_traces() -> None:
    with otlp_receiver() as (endpoint, received):
        pipeline = load_pipeline(str(FRAUD), events=50_000)
        trace = TraceConfig(sample_ratio=1.0, max_traces_per_s=20, endpoint=endpoint)
        started = time.monotonic()
        run(pipeline, RunOptions(observe=ObserveOptions(trace=trace)))
        seconds = time.monotonic() - started
    roots = [s for s in received.snapshot() if s.name == "aisp.event"]
    assert 0 < len(roots) <= 20 * (seconds + 1)


def test_a_clients_traceparent_is_kept_over_http_and_grpc(tmp_path: Path) -> None:
    write_events(tmp_path / "in.jsonl", 40)
    lines = (tmp_path / "in.jsonl").read_bytes().splitlines()
    with otlp_receiver() as (endpoint, received):
        # the standard variables: an endpoint turns tracing on; always_off leaves the decision
        # to the clients' traceparent
        args = ("--admission-rows", "4096")
        env = {
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
            "OTEL_TRACES_SAMPLER": "parentbased_always_off",
        }
        with aisp_serve(FRAUD, http=True, grpc=True, extra_args=args, extra_env=env) as (addresses, _):
            wait_http(addresses["http"])
            traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
            r = httpx.post(
                f"http://{addresses['http']}/v1/pipelines/fraud/events",
                content=b"\n".join(lines[:20]) + b"\n",
                headers={"traceparent": traceparent},
                timeout=30,
            )
            assert r.status_code == 200 and len(r.content.splitlines()) == 20
            # an unsampled client trace is followed: not traced
            unsampled = f"00-{'1' * 32}-{CLIENT_SPAN}-00"
            r = httpx.post(
                f"http://{addresses['http']}/v1/pipelines/fraud/events",
                content=lines[20] + b"\n",
                headers={"traceparent": unsampled},
                timeout=30,
            )
            assert r.status_code == 200
            grpc_trace = "0af7651916cd43dd8448eb211c80319c"
            with grpc.insecure_channel(addresses["grpc"]) as channel:
                call = channel.stream_stream("/aisp.v1.Pipelines/Events")
                metadata = [("traceparent", f"00-{grpc_trace}-b7ad6b7169203331-01")]
                answers = list(call(iter([b"\n".join(lines[21:30])]), metadata=metadata, timeout=30))
                assert len(answers[0].splitlines()) == 9
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                by_trace = traces(received)
                if len(_roots(by_trace, CLIENT_TRACE)) == 20 and len(_roots(by_trace, grpc_trace)) == 9:
                    break
                time.sleep(0.1)
    by_trace = traces(received)
    http_roots = _roots(by_trace, CLIENT_TRACE)
    assert len(http_roots) == 20
    assert {r.parent_span_id.hex() for r in http_roots} == {CLIENT_SPAN}
    assert len(_roots(by_trace, grpc_trace)) == 9
    assert not _roots(by_trace, "1" * 32)
    spans = by_trace[bytes.fromhex(CLIENT_TRACE)]
    for root in http_roots:
        mine = [s for s in spans if s.parent_span_id == root.span_id]
        assert {s.name for s in mine} == {f"stage {st}" for st in STAGES}


def _roots(by_trace: dict[bytes, list[Any]], trace_id: str) -> list[Any]:
    return [s for s in by_trace.get(bytes.fromhex(trace_id), []) if s.name == "aisp.event"]


PRODUCER_SPAN = "b7ad6b7169203331"


def _broker_run(input_url: str, output_url: str, endpoint: str) -> None:
    """The fraud pipeline from ``input_url`` to ``output_url``, tracing only the events whose
    producer sent a sampled ``traceparent``."""
    pipeline = load_pipeline(str(FRAUD))
    from aisp.connectors import sink_for, source_for

    pipeline.bind(source=source_for(pipeline, input_url), sink=sink_for(pipeline, output_url))
    summary = run(
        pipeline, RunOptions(observe=ObserveOptions(trace=TraceConfig(sample_ratio=0.0, endpoint=endpoint)))
    )
    assert summary.events_out == 30


def _check_broker_traces(received: Received, producer_traces: list[str], out_traceparents: list[str]) -> None:
    by_trace = traces(received)
    for trace_id in producer_traces:
        roots = _roots(by_trace, trace_id)
        assert len(roots) == 1, trace_id
        assert roots[0].parent_span_id.hex() == PRODUCER_SPAN
        check_event_trace(by_trace[bytes.fromhex(trace_id)])
    assert len(by_trace) == len(producer_traces) + len(
        {s.trace_id for s in received.snapshot() if s.name == "aisp.batch"}
    )
    # the outgoing messages of the traced events name their trace, and only theirs carry one
    assert sorted(tp.split("-")[1] for tp in out_traceparents) == sorted(producer_traces)


def test_a_producers_traceparent_in_redis_stream_entries_is_kept_and_written_on(tmp_path: Path) -> None:
    import uuid

    import redis

    tag = uuid.uuid4().hex[:8]
    write_events(tmp_path / "in.jsonl", 30)
    lines = (tmp_path / "in.jsonl").read_bytes().splitlines()
    producer_traces = [uuid.uuid4().hex for _ in range(3)]
    r = redis.Redis()
    try:
        for i, line in enumerate(lines):
            fields: dict[str, Any] = {"data": line}
            if i % 10 == 0:
                fields["traceparent"] = f"00-{producer_traces[i // 10]}-{PRODUCER_SPAN}-01"
            elif i == 5:
                fields["traceparent"] = f"00-{uuid.uuid4().hex}-{PRODUCER_SPAN}-00"  # not sampled
            r.xadd(f"aisp-trace-in-{tag}", fields)
        with otlp_receiver() as (endpoint, received):
            _broker_run(
                f"redis://127.0.0.1:6379/aisp-trace-in-{tag}?group=t&idle_stop_s=1",
                f"redis://127.0.0.1:6379/aisp-trace-out-{tag}",
                endpoint,
            )
        entries = r.xrange(f"aisp-trace-out-{tag}")
        assert len(entries) == 30
        out = [f[b"traceparent"].decode() for _, f in entries if b"traceparent" in f]
        _check_broker_traces(received, producer_traces, out)
    finally:
        r.delete(f"aisp-trace-in-{tag}", f"aisp-trace-out-{tag}")
        for key in r.scan_iter(f"aisp:dedupe:aisp-trace-out-{tag}:*"):
            r.delete(key)
        r.close()


def test_a_producers_traceparent_in_jetstream_headers_is_kept_and_written_on(tmp_path: Path) -> None:
    import asyncio
    import uuid

    import nats
    from nats.js.api import StreamConfig

    tag = uuid.uuid4().hex[:8].upper()
    write_events(tmp_path / "in.jsonl", 30)
    lines = (tmp_path / "in.jsonl").read_bytes().splitlines()
    producer_traces = [uuid.uuid4().hex for _ in range(3)]

    async def fill() -> None:
        nc = await nats.connect("nats://127.0.0.1:4222", connect_timeout=2, max_reconnect_attempts=0)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=f"TRACEIN{tag}", subjects=[f"TRACEIN{tag}.>"]))
        for i, line in enumerate(lines):
            headers = (
                {"traceparent": f"00-{producer_traces[i // 10]}-{PRODUCER_SPAN}-01"} if i % 10 == 0 else None
            )
            await js.publish(f"TRACEIN{tag}.ev", line, headers=headers)
        await nc.close()

    async def drain() -> list[str]:
        nc = await nats.connect("nats://127.0.0.1:4222", connect_timeout=2, max_reconnect_attempts=0)
        js = nc.jetstream()
        sub = await js.pull_subscribe(f"TRACEOUT{tag}.>", durable="check", stream=f"TRACEOUT{tag}")
        msgs = await sub.fetch(30, timeout=10)
        found = [m.headers["traceparent"] for m in msgs if m.headers and "traceparent" in m.headers]
        assert len(msgs) == 30
        for name in (f"TRACEIN{tag}", f"TRACEOUT{tag}"):
            await js.delete_stream(name)
        await nc.close()
        return found

    asyncio.run(fill())
    with otlp_receiver() as (endpoint, received):
        _broker_run(
            f"nats://127.0.0.1:4222/TRACEIN{tag}?durable=t&idle_stop_s=1",
            f"nats://127.0.0.1:4222/TRACEOUT{tag}?subject=TRACEOUT{tag}.out",
            endpoint,
        )
    _check_broker_traces(received, producer_traces, asyncio.run(drain()))
