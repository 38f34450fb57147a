"""A served pipeline with a window step gets a new topology mid-stream: its open windows and the
source's event time go on in the new graph, so every window is emitted once with the values of a
run without the update, and the same events are late."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import msgspec

from aisp import CollectSink, Count, EventTime, Max, Pipeline, Sum, TestingSource, Tumbling
from aisp.serve.admission import PipelineAdmission
from aisp.serve.pipelines.service import PipelineService

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "aisp_topology_window_events", ROOT / "examples/windows/events.py"
)
assert _spec is not None and _spec.loader is not None
events = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(events)


class Event(msgspec.Struct):
    id: int
    user: str
    ts: int
    amount: float


def windowed(log: CollectSink, rows: list[dict[str, Any]], *, version: int) -> Pipeline:
    """The windows example's steps; version 2 filters the events before ``key_by`` (a step the
    first version lacks) and emits the windows through another step, the window step kept."""
    p = Pipeline("windows", output_columns=["user", "window_start"])
    src = p.source(
        "events",
        TestingSource(rows),
        schema=Event,
        event_time=EventTime("ts", max_out_of_orderness_ms=events.OUT_OF_ORDER_MS),
    )
    if version == 2:
        src = src.filter("positive", lambda b: b.numpy("amount") >= 0)
    windows = src.key_by("by_user", "user").window(
        "per_user",
        Tumbling(events.SIZE_MS),
        {"n": Count(), "sum": Sum("amount"), "max": Max("amount")},
        allowed_lateness_ms=events.LATENESS_MS,
    )
    if version == 2:
        windows = windows.map_batch("emit_v2", lambda b: b)
    windows.sink("log", log)
    windows.sink("out", CollectSink())
    return p


def key(w: dict[str, Any]) -> tuple[Any, ...]:
    return (w["user"], w["window_start"], w["n"], round(w["sum"], 6), w["max"])


def test_open_windows_and_event_time_go_on_in_the_new_graph(tmp_path: Path) -> None:
    rows = events.make_events(6_000, seed=3, users=20)
    ref_log, ref_late = CollectSink(), tmp_path / "ref-late.jsonl"
    reference = windowed(ref_log, rows, version=1)
    reference.run(dead_letter=str(ref_late))
    late = len(ref_late.read_text().splitlines())
    assert late > 10 and len(ref_log.rows) > 200  # the input exercises both

    log, dead = CollectSink(), tmp_path / "late.jsonl"
    service = PipelineService(windowed(log, [], version=1), dead_letter=str(dead))
    service.start()
    admission = PipelineAdmission(service, limiter=None, wait_s=10.0)
    lines = [json.dumps(r).encode() for r in rows]
    try:
        for start in range(0, len(lines), 250):
            if start == 3_000:
                before = service.executor
                open_before, clocks_before = before.windows["per_user"].open_windows, before.clocks.snapshot()
                report = service.update(windowed(log, [], version=2))
                assert report["carried"] == ["per_user"] and report["new"] == [] and open_before > 0
                assert service.executor.windows["per_user"].open_windows == open_before
                assert service.executor.clocks.snapshot() == clocks_before  # event time goes on
            batch, chunk, errors = service.prepare(lines[start : start + 250])
            assert not errors and admission.admit(batch, chunk, key="", tier=None, first=True)
            assert chunk is not None and chunk.done.wait(10)
    finally:
        assert service.close()
    got = sorted(key(w) for w in log.rows)
    assert len(got) == len({g[:2] for g in got}), "a window was emitted twice"
    assert got == sorted(key(w) for w in ref_log.rows)
    assert len(dead.read_text().splitlines()) == late
