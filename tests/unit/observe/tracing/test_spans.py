"""EventTracer: sampling, spans per step, filtered and dead-lettered events, W3C parents."""

from __future__ import annotations

import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from aisp import Batch, CollectSink, Pipeline, WorkloadFSource
from aisp.errors import ConfigError
from aisp.observe.tracing.spans import EventTracer, TraceConfig, extract_parent
from aisp.schedule.executor import LocalExecutor
from aisp.sinks.deadletter import DeadLetterSink


def run_traced(p: Pipeline, config: TraceConfig) -> list[object]:
    exporter = InMemorySpanExporter()
    tracer = EventTracer(config, p.name, exporter=exporter)
    ex = LocalExecutor(p.build(), dead_letter=DeadLetterSink().open(), tracer=tracer)
    tracer.start()
    ex.run()
    tracer.close()
    return list(exporter.get_finished_spans())


def test_every_event_traced_through_each_step_and_filtered_ones_end_where_they_left() -> None:
    p = Pipeline("t")
    src = p.source("src", WorkloadFSource(events=100))
    odd = src.filter("odd", lambda b: b.numpy("id") % 2 == 1)
    odd.map_batch("double", lambda b: b.with_columns({"y": b.numpy("amount") * 2})).sink("out", CollectSink())
    spans = run_traced(p, TraceConfig(sample_ratio=1.0, max_traces_per_s=0))
    roots = {s.context.trace_id: s for s in spans if s.name == "aisp.event"}
    assert len(roots) == 100
    for root in roots.values():
        steps = {s.name for s in spans if s.context.trace_id == root.context.trace_id} - {"aisp.event"}
        if root.attributes["aisp.event_id"] % 2:
            assert steps == {"stage src", "stage odd", "stage double", "stage out"}
            assert "aisp.dropped_at" not in root.attributes
        else:
            assert steps == {"stage src", "stage odd"}
            assert root.attributes["aisp.dropped_at"] == "odd"


def test_dead_lettered_events_end_their_trace_in_error() -> None:
    def boom(b: Batch) -> Batch:
        raise ValueError("bad batch")

    p = Pipeline("t")
    p.source("src", WorkloadFSource(events=10)).map_batch("boom", boom).sink("out", CollectSink())
    spans = run_traced(p, TraceConfig(sample_ratio=1.0, max_traces_per_s=0))
    roots = [s for s in spans if s.name == "aisp.event"]
    assert len(roots) == 10
    assert all(r.status.status_code == StatusCode.ERROR for r in roots)
    assert {r.attributes["aisp.dead_letter_step"] for r in roots} == {"boom"}
    assert "bad batch" in (roots[0].status.description or "")


def test_sampling_ratio_by_id_hash_and_nothing_when_off() -> None:
    p = Pipeline("t")
    p.source("src", WorkloadFSource(events=10_000)).sink("out", CollectSink())
    spans = run_traced(p, TraceConfig(sample_ratio=0.05, max_traces_per_s=0))
    roots = [s for s in spans if s.name == "aisp.event"]
    assert 400 <= len(roots) <= 600
    p2 = Pipeline("t")
    p2.source("src", WorkloadFSource(events=1000)).sink("out", CollectSink())
    assert run_traced(p2, TraceConfig(sample_ratio=0.0)) == []


def test_a_traced_request_parents_its_events_on_the_clients_span() -> None:
    exporter = InMemorySpanExporter()
    tracer = EventTracer(TraceConfig(sample_ratio=0.0), "t", exporter=exporter)
    tracer.start()
    parent = extract_parent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    tracer.parent(10, 3, parent)
    batch = Batch.from_columns({"x": np.arange(20)}, ids=np.arange(20))
    tracer.ingest("src", batch, 0)
    assert sorted(tracer.rows(batch).tolist()) == [10, 11, 12]
    tracer.written("out", tracer.rows(batch), 0, 20)
    tracer.close()
    roots = [s for s in exporter.get_finished_spans() if s.name == "aisp.event"]
    assert len(roots) == 3
    assert {format(r.context.trace_id, "032x") for r in roots} == {"4bf92f3577b34da6a3ce929d0e0e4736"}
    assert {format(r.parent.span_id, "016x") for r in roots if r.parent} == {"00f067aa0ba902b7"}


def test_bad_traceparents_are_ignored_and_config_is_checked() -> None:
    assert extract_parent(None) is None
    assert extract_parent("garbage") is None
    assert extract_parent("00-00000000000000000000000000000000-00f067aa0ba902b7-01") is None
    with pytest.raises(ConfigError, match="sample_ratio"):
        TraceConfig(sample_ratio=1.5)
    with pytest.raises(ConfigError, match="max_traces_per_s"):
        TraceConfig(max_traces_per_s=-1)


def test_cli_trace_options_and_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from aisp.cli.common import _trace_config

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    assert _trace_config(0.0, None, 100.0) is None
    flags = _trace_config(0.01, "http://127.0.0.1:9/v1/traces", 50.0)
    assert (flags.sample_ratio, flags.resolved_endpoint(), flags.max_traces_per_s) == (
        0.01,
        "http://127.0.0.1:9/v1/traces",
        50.0,
    )
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    from_env = _trace_config(0.0, None, 100.0)
    assert from_env.sample_ratio == 1.0 and from_env.resolved_endpoint() == "http://127.0.0.1:9/v1/traces"
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    assert _trace_config(0.0, None, 100.0).sample_ratio == 0.0
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert _trace_config(0.0, None, 100.0) is None
