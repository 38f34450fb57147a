"""A pipeline behind a ``PipelineService``: each event's result, in request order, whatever became of it."""

from __future__ import annotations

import json
import threading
import time

import msgspec
import numpy as np
import pytest

from aisp import Batch, CollectSink, Pipeline, WorkloadFSource
from aisp.serve.admission import PipelineAdmission
from aisp.serve.pipelines.service import Inbox, InboxClosed, PipelineService


class Ev(msgspec.Struct):
    id: int
    x: float


def lines(values: list[float]) -> list[bytes]:
    return [json.dumps({"id": i, "x": v}).encode() for i, v in enumerate(values)]


def submit(service: PipelineService, batch: list[bytes], **kw: object) -> tuple[object, list[object], bool]:
    """Decode and admit ``batch`` as a transport does: (chunk, errors, admitted)."""
    prepared, chunk, errors = service.prepare(batch, **kw)  # type: ignore[arg-type]
    admission = PipelineAdmission(service, limiter=None, wait_s=10.0)
    return chunk, errors, admission.admit(prepared, chunk, key="", tier=None, first=True)


def results(service: PipelineService, batch: list[bytes], **kw: object) -> list[dict[str, object]]:
    chunk, _, admitted = submit(service, batch, **kw)
    assert admitted and chunk is not None
    assert chunk.done.wait(10)
    return [json.loads(x) for x in chunk.lines(0, chunk.n).splitlines()]


def shapes_pipeline() -> Pipeline:
    """x < 0 is filtered out; x > 100 fails in an operator; x >= 10 also goes to a side sink."""

    def check(b: Batch) -> Batch:
        if (b.numpy("x") > 100).any():
            raise ValueError("x too large")
        return b

    p = Pipeline("shapes", output_columns=["id", "y"])
    src = p.source("events", WorkloadFSource(events=1), schema=Ev).filter(
        "positive", lambda b: b.numpy("x") >= 0
    )
    src.filter("big", lambda b: b.numpy("x") >= 10).sink("audit", CollectSink(columns=["id"]))
    src.map_batch("check", check).map_batch("double", lambda b: b.with_columns({"y": b.numpy("x") * 2})).sink(
        "out", CollectSink(columns=["id", "y"])
    )
    return p


@pytest.fixture
def service() -> object:
    s = PipelineService(shapes_pipeline(), chunk_rows=64)
    s.start()
    yield s
    assert s.close()


def test_results_in_request_order_with_drops_errors_and_bad_lines(service: PipelineService) -> None:
    batch = lines([1.0, -1.0, 2.5, 50.0])
    batch.insert(2, b'{"id": 9, "x": "nope"}')
    out = results(service, batch)
    assert out[0] == {"id": 0, "y": 2.0}
    assert out[1] == {"dropped": "positive"}
    assert out[2]["line"] == 3 and "Expected `float`" in out[2]["error"]  # type: ignore[operator]
    assert out[3] == {"id": 2, "y": 5.0}
    assert out[4] == {"id": 3, "y": 100.0}  # also written to the side sink: the main output wins
    assert len(out) == 5
    assert service.tracker.open_chunks == 0


def test_an_operator_error_answers_that_batch_with_the_cause(service: PipelineService) -> None:
    out = results(service, lines([500.0]))
    assert out == [{"error": "ValueError: x too large", "step": "check"}]
    assert results(service, lines([3.0])) == [{"id": 0, "y": 6.0}]  # and the pipeline goes on


def test_untracked_events_are_not_answered_and_fire_and_forget(service: PipelineService) -> None:
    chunk, errors, admitted = submit(service, lines([1.0, 2.0]) + [b"{"], track=False)
    assert chunk is None and admitted and [e["line"] for e in errors] == [3]
    assert results(service, lines([4.0])) == [{"id": 0, "y": 8.0}]


def test_an_expired_deadline_is_answered_as_an_error() -> None:
    from aisp import PythonRuntime

    p = Pipeline("slow", output_columns=["id", "y"])
    model = PythonRuntime(
        lambda inputs: {"y": inputs["x"] * 2}, name="double", input_names=["x"], output_names=["y"]
    )
    p.source("events", WorkloadFSource(events=1), schema=Ev).infer(
        "model", model, inputs={"x": "x"}, outputs={"y": "y"}
    ).sink("out", CollectSink(columns=["id", "y"]))
    s = PipelineService(p)
    s.start()
    try:
        out = results(s, lines([1.0, 2.0]), deadline_ns=time.monotonic_ns() - 1)
        assert [o["step"] for o in out] == ["model", "model"]
        assert all("deadline" in str(o["error"]) for o in out)
        assert results(s, lines([1.0]))[0]["y"] == 2.0
    finally:
        s.close()


def test_inbox_refuses_what_does_not_fit_and_takes_a_big_batch_when_empty() -> None:
    def rows(n: int) -> Batch:
        return Batch.from_columns({"x": np.zeros(n)})

    inbox = Inbox(10)
    assert inbox.offer(rows(25))  # empty: a big batch is taken whole
    assert not inbox.offer(rows(1))
    assert inbox.take(8).num_rows == 8  # type: ignore[union-attr]
    assert inbox.take(100).num_rows == 17  # type: ignore[union-attr]
    assert inbox.offer(rows(4)) and inbox.offer(rows(6)) and not inbox.offer(rows(1))
    assert inbox.take(100).num_rows == 10  # type: ignore[union-attr]  # coalesced
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(inbox.take(5)))
    t.start()
    inbox.close()
    t.join(5)
    assert got == [None]
    with pytest.raises(InboxClosed):
        inbox.offer(rows(1))


def test_an_idle_served_pipeline_takes_a_topology_update_at_once(service: PipelineService) -> None:
    """With no request coming, the source still comes back between batches (an empty read),
    where the update's barrier finds it; it waited for a request before, and the update gave up
    after 10 s."""
    assert Inbox(10).take(5, timeout_s=0.01).num_rows == 0  # type: ignore[union-attr]
    assert results(service, lines([1.0])) == [{"id": 0, "y": 2.0}]
    time.sleep(0.2)  # idle
    t0 = time.monotonic()
    report = service.update(shapes_pipeline())
    assert report["version"] == 2 and time.monotonic() - t0 < 2.0
    assert results(service, lines([3.0])) == [{"id": 0, "y": 6.0}]  # the new graph answers
