"""Retries with backoff are counted by target and reason, and exported as aisp_retries_total."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aisp import CollectSink, Pipeline, WorkloadFSource
from aisp.errors import SinkError
from aisp.observe.export.metrics import PipelineCollector
from aisp.retry import RETRIES, call_with_retry
from aisp.schedule.executor import LocalExecutor
from aisp.sinks.deadletter import DeadLetterSink


def test_retries_are_counted_and_exported_and_a_target_that_stays_away_fails_clearly() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    before = dict(RETRIES.items()).get(("test broker at 127.0.0.1:1", "ConnectionResetError"), 0)
    assert (
        call_with_retry(
            flaky, retry_on=(OSError,), give_up_after_s=5, what="test broker at 127.0.0.1:1", base_s=0.001
        )
        == "ok"
    )
    with pytest.raises(SinkError, match="test broker at 127.0.0.1:1 unreachable for 0.01 s"):
        call_with_retry(
            lambda: (_ for _ in ()).throw(ConnectionRefusedError("no")),
            retry_on=(OSError,),
            give_up_after_s=0.01,
            what="test broker at 127.0.0.1:1",
            error=SinkError,
            base_s=0.001,
        )
    counts = dict(RETRIES.items())
    assert counts[("test broker at 127.0.0.1:1", "ConnectionResetError")] == before + 2
    assert counts[("test broker at 127.0.0.1:1", "ConnectionRefusedError")] >= 1

    p = Pipeline("r")
    p.source("src", WorkloadFSource(events=10)).sink("out", CollectSink())
    registry = CollectorRegistry()
    registry.register(PipelineCollector(LocalExecutor(p.build(), dead_letter=DeadLetterSink().open())))
    family = next(
        f
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        if f.name == "aisp_retries"
    )
    exported = {
        (s.labels["target"], s.labels["reason"]): s.value for s in family.samples if s.name.endswith("_total")
    }
    assert exported[("test broker at 127.0.0.1:1", "ConnectionResetError")] == before + 2
