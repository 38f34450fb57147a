"""Which thread does each step's work: chaining, model dispatchers, and models run inline."""

from __future__ import annotations

import numpy as np

from aisp import CollectSink, DeadLetterSink, Pipeline, PythonRuntime, WorkloadFSource
from aisp.schedule import planning
from aisp.schedule.executor import LocalExecutor


def fraudlike() -> Pipeline:
    model = PythonRuntime(
        lambda i: {"y": i["x"].sum(axis=1)}, name="m", input_names=["x"], output_names=["y"]
    )
    p = Pipeline("threads")
    p.source("events", WorkloadFSource(events=5000)).map_batch(
        "x", lambda b: b.with_columns({"x": b.numpy("f").astype(np.float32)})
    ).infer("score", model, inputs={"x": "x"}, outputs={"y": "y"}).map_batch("emit", lambda b: b).sink(
        "out", CollectSink(columns=["id"])
    )
    return p


def test_a_model_and_what_follows_it_run_on_its_dispatcher_unless_fed_inline() -> None:
    graph = fraudlike().build()
    nodes = {n.step_id: n for n in graph.topological_order()}
    task_of = planning.assign_tasks(nodes, graph.consumers())
    assert task_of["score"] == "events"  # chained: the source's thread hands the rows over
    queued = planning.thread_of(nodes, task_of)
    assert queued == {"events": "events", "x": "events", "score": "score", "emit": "score", "out": "score"}
    inline = planning.thread_of(nodes, task_of, inline={"score"})
    assert set(inline.values()) == {"events"}


def test_the_executor_names_the_thread_that_really_ran_the_model() -> None:
    ex = LocalExecutor(fraudlike().build(), dead_letter=DeadLetterSink().open())
    ex.run()
    stats = ex.batchers["score"].stats
    expected = "events" if 2 * stats.inline_batches > stats.batches else "score"
    assert ex.thread_of()["out"] == expected
    assert stats.inline_batches <= stats.batches
