"""Savepoints: the state of one version of a pipeline carried into another.

``carry_state`` decides what a new graph takes of an old graph's state: the state of each
stateful step goes to the step with the same id when its state columns (names and types) are the
same, or through the migration the new pipeline declares for that step (``Pipeline.migrate``: a
function from the old state table to the new one, one row per key); a keyed step's rows need
their key space (the ``key_by`` step id) in the new graph too; new steps start empty; the state of
steps the new graph lacks, or cannot take, is dropped with a warning. A served pipeline's
topology update uses it in memory (``aisp.serve.pipelines.topology``); ``aisp run NEW_PIPELINE
--from-savepoint DIR`` uses it on the newest verified checkpoint in ``DIR`` (the files a restart
would read), when the run's own checkpoint directory has none yet: the sources read on from the
positions of the steps with the same ids; the new version's outputs and dead letters start in
their own files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from aisp.errors import ConfigError
from aisp.graph import Graph
from aisp.state.checkpoint import Checkpoint, CheckpointStore
from aisp.transform.operators import Checkpointable, OperatorContext

__all__ = ["Migration", "carry_checkpoint", "carry_state", "from_savepoint", "restore_point"]

log = logging.getLogger("aisp.savepoints")

Migration = Callable[[pa.Table], pa.Table]


def _layout(columns: Mapping[str, Any]) -> dict[str, str]:
    return {name: np.asarray(col).dtype.str for name, col in columns.items()}


def carry_state(
    state: Mapping[str, Mapping[str, Any]],
    graph: Graph,
    migrations: Mapping[str, Migration],
    shared: Iterable[str],
) -> tuple[dict[str, pa.Table], dict[str, list[str]]]:
    """The part of ``state`` (a savepoint: each step's state columns) that ``graph`` takes, as
    ``op.<step>`` tables, given the key spaces it shares with the old graph (see the module
    docstring); and what happened to each step: carried, migrated, new, dropped."""
    kept: dict[str, pa.Table] = {}
    report: dict[str, list[str]] = {"carried": [], "migrated": [], "new": [], "dropped": []}
    spaces: dict[str, str] = {}
    expected: dict[str, dict[str, str]] = {}
    for node in graph.nodes:
        if node.kind in ("source", "sink", "infer", "llm"):
            continue
        op = node.spec.build(OperatorContext(node.step_id, lambda *_: None, {}))
        if isinstance(op, Checkpointable):
            expected[node.step_id] = _layout(op.snapshot())
            space = getattr(op, "space", None)
            if space is not None:
                spaces[node.step_id] = space
    shared = set(shared)
    for step, columns in state.items():
        layout = expected.get(step)
        space = spaces.get(step)
        if layout is None or (space is not None and space not in shared):  # keyed rows need their keys
            report["dropped"].append(step)
            continue
        migrate = migrations.get(step)
        if migrate is not None:
            table = migrate(pa.table(dict(columns)))
            columns = {c: table.column(c).to_numpy() for c in table.column_names}
            migrated = _layout(columns)
            if migrated != layout:
                raise ConfigError(
                    f"step {step!r}: its migration gives state columns {migrated}, the step keeps {layout}"
                )
            report["migrated"].append(step)
        elif _layout(columns) != layout:
            report["dropped"].append(step)
            continue
        else:
            report["carried"].append(step)
        kept[f"op.{step}"] = pa.table(dict(columns))
    report["new"] = sorted(set(expected) - set(state))
    if report["dropped"]:
        log.warning("topology update: the state of steps %s is dropped", report["dropped"])
    return kept, report


def restore_point(graph: Graph, store: CheckpointStore | None, workers: int = 1) -> Checkpoint | None:
    """The newest verified checkpoint of ``store`` to restart ``graph`` from (None: none)."""
    latest = store.latest() if store is not None else None
    if latest is not None and latest.meta.get("pipeline") != graph.name:
        raise ConfigError(
            f"checkpoint {latest.path} is of pipeline {latest.meta.get('pipeline')!r}, not {graph.name!r}"
        )
    if latest is not None and latest.meta.get("workers", 1) != workers:
        raise ConfigError(
            f"checkpoint {latest.path} was taken with --workers {latest.meta.get('workers', 1)}; restart with"
            f" the same number (keyed state is split by it), not {workers}"
        )
    return latest


def from_savepoint(
    directory: str | Path, graph: Graph, migrations: Mapping[str, Migration]
) -> tuple[Checkpoint, dict[str, list[str]]]:
    """The newest verified checkpoint in ``directory``, taken by any version of ``graph``'s
    pipeline, as a restore point for ``graph`` (see the module docstring), and what happened to
    each step's state."""
    found = CheckpointStore(directory).latest()
    if found is None:
        raise ConfigError(f"no verified checkpoint in {directory} to start from")
    carried, report = carry_checkpoint(found, graph, migrations, outputs=False)
    log.info("starting from savepoint %s: %s", found.path, report)
    return carried, report


def carry_checkpoint(
    found: Checkpoint, graph: Graph, migrations: Mapping[str, Migration], *, outputs: bool
) -> tuple[Checkpoint, dict[str, list[str]]]:
    """``found`` (a checkpoint of another version of ``graph``'s pipeline) as a restore point for
    ``graph``: the state it takes (``carry_state``), the positions of the sources with the same
    ids, and with ``outputs`` those of the sinks and dead letters too (a run that switches graphs
    writes on in the same outputs; a savepoint start begins its own); what happened to each
    step's state."""
    meta = found.meta
    if meta.get("pipeline") != graph.name:
        raise ConfigError(
            f"savepoint {found.path} is of pipeline {meta.get('pipeline')!r}, not {graph.name!r}"
        )
    if "state_store" in meta or meta.get("workers", 1) != 1:
        raise ConfigError(
            f"savepoint {found.path} keeps its state in a state store or per worker: start from a"
            " savepoint of a single-process run with the state in its checkpoint files"
        )
    spaces = {n.step_id for n in graph.nodes if n.kind == "key_by"}
    shared = sorted(t[len("keys.") :] for t in found.tables if t.startswith("keys.") and t[5:] in spaces)
    state = {
        name[len("op.") :]: {c: table.column(c).to_numpy() for c in table.column_names}
        for name, table in found.tables.items()
        if name.startswith("op.")
    }
    tables, report = carry_state(state, graph, migrations, shared)
    tables.update({f"keys.{space}": found.tables[f"keys.{space}"] for space in shared})
    steps = {n.step_id for n in graph.nodes}
    kept = {
        **{k: v for k, v in meta.items() if outputs or k != "dead_letter_bytes"},
        "sources": {s: p for s, p in meta.get("sources", {}).items() if s in steps},
        "sinks": {s: p for s, p in meta.get("sinks", {}).items() if s in steps} if outputs else {},
        "watermarks": {s: w for s, w in meta.get("watermarks", {}).items() if s in steps},
    }
    return Checkpoint(found.id, found.path, kept, tables), report
