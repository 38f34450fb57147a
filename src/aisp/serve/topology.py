"""Topology updates of a served pipeline: a new graph takes over at a barrier with the state of
the steps it keeps.

``switch`` replaces a ``PipelineService``'s running graph by a new version of the pipeline:

1. the new graph is built and checked (``Pipeline.build``) and its latency bound computed; it
   must read the same input schema; a graph with window steps is refused (their open windows
   are not carried yet);
2. the new executor is started with its source paused: operators built, model batchers warmed
   up, threads waiting, while the old graph still serves;
3. at a barrier the old graph's source pauses and the rows in flight finish; the state of its
   steps is captured (``CheckpointCoordinator.savepoint``);
4. the state of each stateful step goes to the step with the same id in the new graph when its
   state columns (names and types) are the same, or through the migration the new pipeline
   declares for that step (``Pipeline.migrate``); a key space goes with its ``key_by`` step id;
   new steps start empty; the state of steps the new graph lacks, or cannot take, is dropped
   with a warning;
5. the new graph's source resumes, reading the inbox where the old one stopped; the old
   executor stops (it has nothing left in flight).

Requests keep coming into the inbox meanwhile and wait: none is refused (unless the inbox fills
up) and none is answered twice. A failure before step 5 leaves the old graph running (resumed)
and raises the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pyarrow as pa

from aisp.errors import ConfigError, Unavailable
from aisp.graph import Graph
from aisp.observe.clock import wall_ms
from aisp.state.checkpoint import Checkpoint
from aisp.transform.operators import Checkpointable, OperatorContext

if TYPE_CHECKING:
    from aisp.pipeline import Pipeline
    from aisp.serve.pipelines import PipelineService

__all__ = ["carry_state", "switch"]

log = logging.getLogger("aisp.serve")

Migration = Callable[[pa.Table], pa.Table]


def _layout(columns: Mapping[str, Any]) -> dict[str, str]:
    return {name: np.asarray(col).dtype.str for name, col in columns.items()}


def carry_state(
    tables: Mapping[str, pa.Table], graph: Graph, migrations: Mapping[str, Migration]
) -> tuple[dict[str, pa.Table], dict[str, list[str]]]:
    """The part of ``tables`` (a savepoint: ``op.<step>`` and ``keys.<space>``) that ``graph``
    takes (see the module docstring), and what happened to each step: carried, migrated, new,
    dropped."""
    kept: dict[str, pa.Table] = {}
    report: dict[str, list[str]] = {"carried": [], "migrated": [], "new": [], "dropped": []}
    spaces: dict[str, str] = {}
    expected: dict[str, dict[str, str]] = {}
    for node in graph.nodes:
        if node.kind in ("source", "sink", "infer"):
            continue
        op = node.spec.build(OperatorContext(node.step_id, lambda *_: None, {}))
        if isinstance(op, Checkpointable):
            expected[node.step_id] = _layout(op.snapshot())
            space = getattr(op, "space", None)
            if space is not None:
                spaces[node.step_id] = space
    for name, table in tables.items():
        kind, _, target = name.partition(".")
        if kind != "op":
            continue
        layout = expected.get(target)
        if layout is None:
            report["dropped"].append(target)
            continue
        space = spaces.get(target)
        if space is not None and f"keys.{space}" not in tables:
            report["dropped"].append(target)  # its keys are not carried: its rows mean nothing
            continue
        migrate = migrations.get(target)
        if migrate is not None:
            table = migrate(table)
            report["migrated"].append(target)
        elif _layout({c: table.column(c).to_numpy() for c in table.column_names}) != layout:
            report["dropped"].append(target)
            continue
        else:
            report["carried"].append(target)
        if _layout({c: table.column(c).to_numpy() for c in table.column_names}) != layout:
            raise ConfigError(
                f"step {target!r}: its migration gives state columns {table.schema.names}"
                f" ({_layout({c: table.column(c).to_numpy() for c in table.column_names})}), the step"
                f" keeps {layout}"
            )
        kept[name] = table
    used = {spaces[s] for s in (*report["carried"], *report["migrated"]) if s in spaces}
    for name, table in tables.items():
        kind, _, space = name.partition(".")
        if kind == "keys" and space in used:
            kept[name] = table
    report["new"] = sorted(set(expected) - {t.partition(".")[2] for t in tables if t.startswith("op.")})
    if report["dropped"]:
        log.warning("topology update: the state of steps %s is dropped", report["dropped"])
    return kept, report


def _same_schema(a: type[msgspec.Struct] | None, b: type[msgspec.Struct] | None) -> bool:
    if a is None or b is None:
        return a is b
    fields = msgspec.structs.fields
    return [(f.name, f.type) for f in fields(a)] == [(f.name, f.type) for f in fields(b)]


def _savepoint(executor: Any, name: str, timeout_s: float) -> dict[str, pa.Table]:
    tables = executor.checkpoints.savepoint(timeout_s)
    if tables is None:
        raise Unavailable(f"pipeline {name!r} did not go quiet in {timeout_s:g} s; nothing changed")
    return dict(tables)


def switch(service: PipelineService, pipeline: Pipeline, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Replace ``service``'s running graph by ``pipeline``'s (see the module docstring); a
    report of the update."""
    from aisp.serve.pipelines import InboxSource
    from aisp.sinks.memory import NullSink

    t0 = time.monotonic()
    if pipeline.name != service.name:
        raise ConfigError(f"the new pipeline is {pipeline.name!r}; this service serves {service.name!r}")
    if not _same_schema(pipeline.input_schema, service.pipeline.input_schema):
        raise ConfigError("the new pipeline reads another input schema; serve it as a new pipeline")
    old = service.executor
    if old.windows:
        raise ConfigError(
            f"steps {sorted(old.windows)} keep open windows, which a topology update does not carry yet"
        )
    pipeline.bind(source=InboxSource(service.inbox), sink=NullSink())
    graph = pipeline.build()
    bound = graph.latency_bound_ms()
    new = service.new_executor(graph)
    new.flight.pause()
    new.start()  # operators built, batchers warmed up; the source waits
    try:
        tables = _savepoint(old, service.name, timeout_s)
        paused_at = time.monotonic()
        try:
            carried, report = carry_state(tables, graph, pipeline.migrations)
            new.keyed.restore(Checkpoint(0, Path("topology-update"), {}, carried))
        except BaseException:
            old.flight.resume()
            raise
    except BaseException:
        new.request_stop()
        new.flight.resume()
        new.join(timeout_s)
        raise
    service.adopt(pipeline, new)
    new.flight.resume()
    old.request_stop()  # its source ends at once: nothing is in flight
    old.flight.resume()
    threading.Thread(target=old.join, name="aisp-old-graph", daemon=True).start()
    return {
        "at_ms": wall_ms(),
        "steps": [n.step_id for n in graph.nodes],
        "latency_bound_ms": bound,
        "paused_ms": round((time.monotonic() - paused_at) * 1000, 3),
        "took_ms": round((time.monotonic() - t0) * 1000, 3),
        **report,
    }
