"""Topology updates of a served pipeline: a new graph takes over at a barrier with the state of
the steps it keeps.

``switch`` replaces a ``PipelineService``'s running graph by a new version of the pipeline:

1. the new graph is built and checked (``Pipeline.build``) and its latency bound computed; it
   must read the same input schema;
2. the new executor is started with its source paused: operators built, model batchers warmed
   up, threads waiting, while the old graph still serves;
3. at a barrier the old graph's source pauses and the rows in flight finish; the state of its
   steps is captured (``CheckpointCoordinator.savepoint``);
4. a key space goes with its ``key_by`` step id: the new graph was built on the old graph's key
   index itself (nothing copied, whatever the number of keys); the state of each stateful step
   goes to the step with the same id in the new graph when its state columns (names and types)
   are the same, or through the migration the new pipeline declares for that step
   (``Pipeline.migrate``); a window step's state is its open windows and its watermark, and
   the sources' event-time clocks go on where they were, so what is late and when a window
   closes do not change at the switch; new steps start empty; the state of steps the new graph
   lacks, or cannot take, is dropped with a warning;
5. the new graph's source resumes, reading the inbox where the old one stopped; the old
   executor stops (it has nothing left in flight).

Requests keep coming into the inbox meanwhile and wait: none is refused (unless the inbox fills
up) and none is answered twice. A failure before step 5 leaves the old graph running (resumed)
and raises the reason.

A new version given as a file path (``POST /v1/pipelines/P/graph {"path": ...}``) runs that
file's code in the server process, so ``allowed_file`` admits only files inside the served
pipeline's own directory or a directory the server was started with (``--pipeline-dir``),
after resolving symlinks and ``..``; anything else is ``Forbidden``. ``load_guarded`` turns
whatever the file raises while it loads (``SystemExit`` and syntax errors included, signals
such as ``KeyboardInterrupt`` excepted) into a ``ConfigError`` with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from aisp.errors import AispError, ConfigError, Forbidden, Unavailable
from aisp.graph import Graph
from aisp.observe.clock import wall_ms
from aisp.schedule.checkpointing.savepoints import carry_state
from aisp.state.checkpoint import Checkpoint

if TYPE_CHECKING:
    from aisp.pipeline import Pipeline

PipelineService = Any  # aisp.serve.pipelines.service.PipelineService (which imports this module)

__all__ = ["allowed_file", "load_guarded", "short_gil_slices", "switch"]

log = logging.getLogger("aisp.serve")


def allowed_file(path: str, directories: Sequence[str | Path]) -> Path:
    """``path`` resolved (symlinks followed, ``..`` removed), if it lies inside one of
    ``directories`` (each resolved too); ``Forbidden`` names the directories otherwise.

    >>> allowed_file("/srv/p/../p/v2.py", ["/srv/p"]).as_posix()
    '/srv/p/v2.py'
    >>> try:
    ...     allowed_file("/srv/p/../secret.py", ["/srv/p"])
    ... except Forbidden as exc:
    ...     print(exc.http_status)
    403
    """
    resolved = Path(path).resolve()
    roots = [Path(d).resolve() for d in directories]
    if any(resolved.is_relative_to(root) for root in roots):
        return resolved
    allowed = ", ".join(str(r) for r in roots) or "none"
    raise Forbidden(
        f"pipeline file {path!r} ({resolved}) is outside the directories updates may load from: {allowed};"
        " start the server with --pipeline-dir DIR to allow another"
    )


def load_guarded(load: Callable[[str | None], Pipeline], path: str | None) -> Pipeline:
    """``load(path)``; whatever the pipeline file raises while it loads (``SystemExit``, a syntax
    error, any exception) becomes a ``ConfigError`` with the reason, so the running graph stays
    and the client is told why. ``KeyboardInterrupt`` (a signal to this process) goes on."""
    try:
        return load(path)
    except (AispError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's file failed: any way is its error
        raise ConfigError(
            f"the pipeline file {path or '(served)'} failed to load: {type(exc).__name__}: {exc}"
        ) from exc


def _same_schema(a: type[msgspec.Struct] | None, b: type[msgspec.Struct] | None) -> bool:
    if a is None or b is None:
        return a is b
    fields = msgspec.structs.fields
    return [(f.name, f.type) for f in fields(a)] == [(f.name, f.type) for f in fields(b)]


def _savepoint(executor: Any, name: str, timeout_s: float) -> dict[str, dict[str, Any]]:
    state = executor.checkpoints.savepoint(timeout_s)
    if state is None:
        raise Unavailable(f"pipeline {name!r} did not go quiet in {timeout_s:g} s; nothing changed")
    return dict(state)


def switch(service: PipelineService, pipeline: Pipeline, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Replace ``service``'s running graph by ``pipeline``'s (see the module docstring); a
    report of the update."""
    t0 = time.monotonic()
    if pipeline.name != service.name:
        raise ConfigError(f"the new pipeline is {pipeline.name!r}; this service serves {service.name!r}")
    if not _same_schema(pipeline.input_schema, service.pipeline.input_schema):
        raise ConfigError("the new pipeline reads another input schema; serve it as a new pipeline")
    old = service.executor
    graph = service.bound(pipeline)
    bound = graph.latency_bound_ms()
    new = service.new_executor(graph)
    shared = sorted({n.step_id for n in graph.nodes if n.kind == "key_by"} & set(old.keyed.spaces))
    new.keyed.share(old.keyed, shared)  # the keys stay where they are: nothing to copy
    new.flight.pause()
    new.start()  # operators built, batchers warmed up; the source waits
    return _at_the_barrier(service, pipeline, graph, old, new, shared, timeout_s, t0, bound)


@contextlib.contextmanager
def short_gil_slices(seconds: float = 0.0005) -> Iterator[None]:
    """Lower the interpreter's thread switch interval (5 ms by default) while an update loads,
    builds and starts the new graph beside the serving one: that work holds the GIL in long
    stretches, and a request's thread waiting for it would otherwise wait up to a full slice
    each time."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _at_the_barrier(
    service: PipelineService,
    pipeline: Pipeline,
    graph: Graph,
    old: Any,
    new: Any,
    shared: list[str],
    timeout_s: float,
    t0: float,
    bound: float,
) -> dict[str, Any]:
    try:
        state = _savepoint(old, service.name, timeout_s)
        paused_at = time.monotonic()
        try:
            carried, report = carry_state(state, graph, pipeline.migrations, shared)
            new.keyed.restore(Checkpoint(0, Path("topology-update"), {}, carried))
            new.clocks.restore(old.clocks.snapshot())  # event time goes on where it was
        except BaseException:
            old.flight.resume()
            raise
    except BaseException:
        new.request_stop()
        new.flight.resume()
        new.join(timeout_s)
        raise
    service.adopt(pipeline, new)
    for window_step in old.windows.values():  # the new graph has its open windows
        window_step.hand_over()
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
