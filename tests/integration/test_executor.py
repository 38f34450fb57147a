"""The local executor on small pipelines built with the public API."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from aisp import (
    Batch,
    CollectSink,
    ExecutorOptions,
    GraphError,
    JsonlFileSource,
    Pipeline,
    PythonRuntime,
    RunOptions,
    WorkloadFSource,
    run,
)
from aisp.ingest.base import Source, SourceContext, SourcePartition
from aisp.sinks.base import Sink, SinkPartition


def ids(sink: CollectSink) -> list[int]:
    return sorted(r["id"] for r in sink.rows)


def test_filter_route_union_map_end_to_end() -> None:
    p = Pipeline("shapes")
    src = p.source("events", WorkloadFSource(events=3000, seed=1))
    branches = src.route(
        "split", ["big", "small"], predicates={"big": lambda b: b.numpy("amount") > 50}, default="small"
    )
    big = branches["big"].map_batch("tag_big", lambda b: b.with_columns({"kind": np.full(b.num_rows, 1)}))
    small = branches["small"].map(
        "tag_small", lambda row: {"id": row["id"], "amount": row["amount"], "kind": 0}
    )
    merged = p.union("merge", big.map_batch("sel", lambda b: b.select(["id", "amount", "kind"])), small)
    out = CollectSink(columns=["id", "amount", "kind"])
    merged.sink("out", out)
    summary = run(p)
    assert summary.events_in == summary.events_out == 3000
    assert ids(out) == list(range(3000))
    assert all((r["kind"] == 1) == (r["amount"] > 50) for r in out.rows)


def test_operator_error_dead_letters_the_batch_and_goes_on(tmp_path: Path) -> None:
    def explode_on_odd_batches(b: Batch) -> Batch:
        if int(b.numpy("id")[0]) // 100 % 2:
            raise ValueError("bad batch")
        return b

    p = Pipeline("errors")
    out = CollectSink(columns=["id"])
    p.source("events", WorkloadFSource(events=1000)).map_batch("maybe", explode_on_odd_batches).sink(
        "out", out
    )
    dl = tmp_path / "dl.jsonl"
    summary = run(p, RunOptions(execution=ExecutorOptions(source_batch_rows=100), dead_letter=str(dl)))
    assert summary.events_out == 500 and summary.dead_letters == 500
    rec = msgspec.json.decode(dl.read_text().splitlines()[0])
    assert rec["step"] == "maybe" and rec["reason"] == "ValueError: bad batch" and "amount" in rec["row"]
    assert sorted(
        ids(out) + sorted(msgspec.json.decode(x)["row"]["id"] for x in dl.read_text().splitlines())
    ) == list(range(1000))


def test_row_map_error_dead_letters_only_that_row() -> None:
    def fn(row: dict[str, Any]) -> dict[str, Any]:
        if row["id"] == 7:
            raise KeyError("seven")
        return {"id": row["id"]}

    p = Pipeline("rows")
    out = CollectSink(columns=["id"])
    p.source("events", WorkloadFSource(events=50)).map("per_row", fn).sink("out", out)
    summary = run(p)
    assert ids(out) == [i for i in range(50) if i != 7] and summary.dead_letters == 1


def test_infer_with_python_runtime_batches_rows() -> None:
    rt = PythonRuntime(
        lambda x: {"y": x["x"].sum(axis=1, keepdims=True)},
        input_names=("x",),
        output_names=("y",),
        name="sum",
    )
    p = Pipeline("infer")
    out = CollectSink(columns=["id", "y"])
    (
        p.source("events", WorkloadFSource(events=2000))
        .map_batch("x", lambda b: b.with_columns({"x": b.numpy("f")[:, :2].astype(np.float32)}))
        .infer("model", rt, inputs={"x": "x"}, outputs={"y": "y"})
        .sink("out", out)
    )
    summary = run(p)
    assert ids(out) == list(range(2000))
    assert summary.models["model"]["rows"] == 2000
    assert summary.models["model"]["batches"] >= 4


def test_invalid_graph_is_rejected_before_running() -> None:
    p = Pipeline("dangling")
    p.source("events", WorkloadFSource(events=10)).map_batch("lost", lambda b: b)
    with pytest.raises(GraphError, match="'lost'"):
        run(p)


class _Counting(Source):
    """Counts rows handed out, to observe backpressure."""

    def __init__(self) -> None:
        self.emitted = 0

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        outer = self

        class Part(SourcePartition):
            def next_batch(self, max_rows: int) -> Batch | None:
                if outer.emitted >= 5000:
                    return None
                outer.emitted += 10
                return Batch.from_columns({"id": np.arange(outer.emitted - 10, outer.emitted)})

        return Part()


class _GatedSink(Sink):
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.written = 0
        self.max_lead = 0
        self.source: _Counting | None = None

    def open(self) -> SinkPartition:
        outer = self

        class Part(SinkPartition):
            def write(self, batch: Batch) -> None:
                outer.gate.wait(10)
                assert outer.source is not None
                outer.max_lead = max(outer.max_lead, outer.source.emitted - outer.written)
                outer.written += batch.num_rows

        return Part()


def test_backpressure_bounds_what_the_source_reads_ahead() -> None:
    src, sink = _Counting(), _GatedSink()
    sink.source = src
    p = Pipeline("bp")
    p.source("events", src).map_batch("m", lambda b: b).map_batch("n", lambda b: b).sink("out", sink)
    timer = threading.Timer(0.2, sink.gate.set)
    timer.start()
    summary = run(p, RunOptions(execution=ExecutorOptions(channel_capacity_rows=50, source_batch_rows=10)))
    timer.join()
    assert summary.events_out == 5000
    # the chain runs in the source's thread, so the source can be at most a batch or two ahead
    assert sink.max_lead <= 50


def test_latency_is_recorded_per_event() -> None:
    p = Pipeline("lat")
    out = CollectSink(columns=["id"])
    p.source("events", WorkloadFSource(events=1000)).sink("out", out)
    summary = run(p)
    assert summary.latency_ms["p50"] > 0 and summary.latency_ms["max"] >= summary.latency_ms["p99"]


class Ev(msgspec.Struct):
    id: int
    amount: float


@pytest.mark.parametrize("offload", [False, True])
def test_jsonl_pipeline_same_output_with_and_without_process_offload(tmp_path: Path, offload: bool) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"id": {i}, "amount": {i * 1.5}}}\n' for i in range(5000)) + "oops\n")
    out = tmp_path / "out.jsonl"
    from aisp import JsonlFileSink

    p = Pipeline("offload")
    p.source("events", JsonlFileSource(path=str(src), schema=Ev)).sink("out", JsonlFileSink(path=str(out)))
    summary = run(p, RunOptions(execution=ExecutorOptions(offload_sources=offload, offload_sinks=offload)))
    rows = [msgspec.json.decode(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(5000))
    assert summary.events_out == 5000 and summary.dead_letters == 1
