"""Run a pipeline to completion: executor, dead letters, signals, live view and the summary."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aisp.admission.anomaly import control_run
from aisp.connectors import dead_letter_sink
from aisp.errors import ConfigError
from aisp.graph import Graph
from aisp.infer.models.versions import VersionWatcher
from aisp.observe.stats import peak_rss_mb
from aisp.schedule.checkpointing.coordinator import open_partition_states
from aisp.schedule.checkpointing.savepoints import from_savepoint, restore_point
from aisp.schedule.executor import ExecutorOptions, LocalExecutor
from aisp.schedule.model_steps import verify_models
from aisp.schedule.run_control import Checkpointer, RunUpdates, install_signals, tune_gc
from aisp.schedule.watermarks import check_event_time_options
from aisp.state.checkpoint import Checkpoint, CheckpointStore
from aisp.summary import RunSummary, summarize

if TYPE_CHECKING:
    import pyarrow as pa

    from aisp.admission.anomaly import AnomalyPolicy
    from aisp.infer.models.rollout import Rollout
    from aisp.observe.latency import LatencyHistogram
    from aisp.observe.remote import RemoteObserver
    from aisp.observe.tracing.config import TraceConfig

__all__ = ["CheckpointOptions", "ObserveOptions", "RunOptions", "RunSummary", "Runnable", "run", "tune_gc"]

log = logging.getLogger("aisp.runner")


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Checkpoints, so that a run survives ``kill -9``, and where keyed state lives."""

    dir: str
    """Take checkpoints here, and restore from the newest verified one at start."""
    interval_s: float = 1.0
    keep: int = 3
    state_store: bool = False
    """Keep keyed state in an LMDB store (``DIR/state/``), written incrementally at checkpoints
    (only keys that changed), instead of whole in each checkpoint."""
    state_max_keys: int = 0
    """With ``state_store``: keep about this many keys per key space in memory (0: all); the
    least recently seen are evicted at checkpoints and read back from the store when seen again,
    so keyed state may be larger than memory."""
    partition_state_dir: str | None = None
    """With a Kafka input: checkpoint keyed state per input partition, so the state moves with
    the partitions when the consumer group rebalances (each process keeps its own ``dir``): in
    changelog topics on the input's broker when this is ``CHANGELOG`` (the workers share nothing
    but the broker), else in this directory, shared by the group's processes."""
    standby_replicas: int = 0
    """With ``partition_state_dir=CHANGELOG``: keep warm copies of this many times as many
    partitions as the process owns (the ones after its own), so taking one over reads only the
    tail (see ``aisp.connectors.kafka.standby.ring``)."""
    from_savepoint: str | None = None
    """When ``dir`` has no checkpoint yet: start from the newest one in this directory, taken by
    another version of the pipeline (``aisp.schedule.checkpointing.savepoints``)."""
    allow_model_change: bool = False
    """Restore even when a model step's version or weights differ from the checkpoint's (else
    ``ModelChanged``); the summary's ``model_changes`` and the log say which."""


@dataclass(frozen=True, kw_only=True)
class ObserveOptions:
    """What a run shows of itself while it runs, and what it reports at the end."""

    live: bool = False
    """A live view on the terminal."""
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` on 127.0.0.1 at this port while the run lasts (0: a free
    port, announced on stderr as ``metrics http://127.0.0.1:PORT/metrics``)."""
    dashboard_port: int | None = None
    """Serve the live dashboard on 127.0.0.1 at this port while the run lasts (0: a free port,
    announced on stderr as ``dashboard http://127.0.0.1:PORT/``). One server per process serves
    both: with ``metrics_port`` too, the dashboard is on that port (this one is 0 or the same)."""
    trace: TraceConfig | None = None
    """Trace a sample of the events (OpenTelemetry, exported over OTLP/HTTP)."""
    slo_ms: float | None = None
    """The end-to-end latency target the summary's ``slo_attainment`` is measured against
    (default: the pipeline's static latency bound)."""
    summary_json: str | None = None
    on_progress: Callable[[LocalExecutor], None] | None = None

    def __post_init__(self) -> None:
        both = self.metrics_port is not None and self.dashboard_port is not None
        if both and self.dashboard_port not in (0, self.metrics_port):
            raise ConfigError(
                "/metrics and the dashboard share one server: give the dashboard no port of its own"
                f" (--metrics-port {self.metrics_port} serves it), not {self.dashboard_port}"
            )


class Runnable(Protocol):
    """What ``run`` reads of a pipeline (``aisp.pipeline.Pipeline`` is one): its graph, built and
    validated by ``build()``, the anomaly policy and rollouts of its steps, and its state
    migrations. A Protocol, so that the runner never imports the builder whose ``run`` calls it."""

    graph: Graph
    anomaly: AnomalyPolicy | None
    rollouts: dict[str, Rollout]
    migrations: dict[str, Callable[[pa.Table], pa.Table]]

    def build(self) -> Graph: ...


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How to run, by concern: the executor (``execution``: batch and queue sizes, pacing,
    worker processes), ``checkpoints`` (None: none), ``observe``; and the dead-letter target,
    signal handling, GC tuning and how often versioned models are polled."""

    dead_letter: str | None = None
    execution: ExecutorOptions = field(default_factory=ExecutorOptions)
    checkpoints: CheckpointOptions | None = None
    observe: ObserveOptions = field(default_factory=ObserveOptions)
    handle_signals: bool = False
    tune_gc: bool = True
    repository_poll_s: float = 1.0
    reload: Callable[[], Any] | None = None
    """Loads the pipeline again (bound as this one): with checkpoints, SIGHUP (when signals are
    handled) switches the run to the new version at a checkpoint (``schedule.run_control``)."""


def run(pipeline: Runnable, options: RunOptions | None = None) -> RunSummary:
    """Build, start and drain ``pipeline``; SIGINT/SIGTERM (when handled) trigger a clean drain."""
    opts = options or RunOptions()
    graph = pipeline.build()
    ck = opts.checkpoints
    check_event_time_options(
        graph,
        workers=opts.execution.workers,
        state_max_keys=ck.state_max_keys if ck is not None else 0,
        partition_state=ck is not None and ck.partition_state_dir is not None,
    )
    if opts.execution.workers > 1:
        return _run_workers(graph, opts)
    with ExitStack() as resources:
        ck = opts.checkpoints
        store = None
        if ck is not None:
            store = CheckpointStore(ck.dir, keep=ck.keep)
            store.lock()  # one process per checkpoint directory
            resources.callback(store.unlock)
        latest = restore_point(graph, store)
        savepoint = ck.from_savepoint if latest is None and ck is not None else None
        if savepoint is not None:  # another version of the pipeline: its models may differ (reported)
            latest, _ = from_savepoint(savepoint, graph, pipeline.migrations)
        allowed = savepoint is not None or (ck is not None and ck.allow_model_change)
        changes = verify_models(graph, latest, allow_change=allowed)
        ex = _executor(graph, opts, store, latest, resources)
        if pipeline.anomaly is not None:  # sources read no faster than the controlled rate
            control_run(ex, graph, pipeline.anomaly)
        current = [ex]  # the running executor (a topology update replaces it)
        updates = _updates(pipeline, opts, store, resources)
        if opts.handle_signals:
            stop = lambda: current[0].request_stop()  # noqa: E731
            resources.callback(install_signals(stop, updates.request if updates else None) or (lambda: None))
        if opts.tune_gc:
            resources.callback(tune_gc())
        _observe(current, opts.observe, resources)  # starts the executor
        _drive(current, opts, store, updates)
        ex = current[0]
        stopped_early = ex.stopping  # before the resources close (which stop the executor)
    if ex.errors:
        raise ex.errors[0]
    if updates is not None and updates.version > 1:
        pipeline, graph, latest = updates.pipeline, ex.graph, updates.restored
    rollouts = {sid: rollout.status() for sid, rollout in pipeline.rollouts.items()}
    summary = _summary(ex, graph, opts, latest, stopped_early, rollouts)
    summary.model_changes = changes
    return summary


def _updates(
    pipeline: Runnable, opts: RunOptions, store: CheckpointStore | None, res: ExitStack
) -> RunUpdates | None:
    """Topology updates of this run (``schedule.run_control``), when it can take them."""
    ck = opts.checkpoints
    if opts.reload is None or store is None or ck is None:
        return None
    if ck.state_store or ck.partition_state_dir is not None:
        log.info("topology updates are off: keyed state in a state store or per partition")
        return None

    def build(graph: Graph, restore: Checkpoint, dead_letter: Any) -> LocalExecutor:
        ex = _executor(graph, opts, store, restore, res, dead_letter=dead_letter)
        anomaly = updates.pipeline.anomaly if graph is updates.pipeline.graph else None
        if anomaly is not None:
            control_run(ex, graph, anomaly)
        return ex

    def check(graph: Graph) -> None:
        check_event_time_options(graph, workers=1, state_max_keys=0, partition_state=False)

    updates = RunUpdates(pipeline, opts.reload, store, build, check)
    return updates


def _executor(
    graph: Graph,
    opts: RunOptions,
    store: CheckpointStore | None,
    latest: Checkpoint | None,
    res: ExitStack,
    *,
    dead_letter: Any = None,
) -> LocalExecutor:
    """The executor and what it owns (dead letters, unless ``dead_letter`` gives the writer,
    state store, partition states), each closed by ``res`` when the run ends."""
    ck = opts.checkpoints
    writer = dead_letter
    if writer is None:
        writer = dead_letter_sink(opts.dead_letter).open(
            latest.meta.get("dead_letter_bytes") if latest is not None else None
        )
        res.callback(writer.close)
    partition_states = state_store = None
    if ck is not None and ck.partition_state_dir is not None:
        partition_states = open_partition_states(
            graph, ck.partition_state_dir, keep=ck.keep, standby_replicas=ck.standby_replicas,
            local_dir=str(Path(ck.dir) / "changelog"),
        )  # fmt: skip
        res.callback(partition_states.close)
    if ck is not None and ck.state_max_keys and not ck.state_store:
        raise ConfigError("a bound on the keys in memory needs the state store (--state-store)")
    if ck is not None and ck.state_store:
        from aisp.state.store import LmdbStateStore

        state_store = LmdbStateStore(Path(ck.dir) / "state", writer_process=True)
        res.callback(state_store.close)
    execution = opts.execution
    if ck is not None and ck.state_max_keys:
        execution = replace(execution, state_max_keys=ck.state_max_keys)
    return LocalExecutor(
        graph,
        state_store=state_store,
        partition_states=partition_states,
        restore=latest,
        dead_letter=writer,
        options=execution,
    )


def _observe(current: list[LocalExecutor], opts: ObserveOptions, res: ExitStack) -> None:
    """Tracing, /metrics and the dashboard for the running executor (``current[0]``, which a
    topology update replaces), stopped by ``res`` when the run ends."""
    ex = current[0]
    observer = _observer(ex.graph, opts, res)
    if opts.trace is not None:
        from aisp.observe.tracing.spans import EventTracer

        ex.tracer = EventTracer(opts.trace, ex.graph.name)
        res.callback(ex.tracer.close)
    ex.start()
    res.callback(lambda: current[0].request_stop())  # a failure below still drains what started
    if ex.tracer is not None:  # after start: its export thread must not keep workers from forking
        ex.tracer.start()
    if observer is not None:
        from aisp.observe.remote import snapshot

        observer.start(lambda: snapshot(current[0]))
        _announce(observer.port, opts)


def _observer(graph: Graph, opts: ObserveOptions, res: ExitStack) -> RemoteObserver | None:
    """The process serving /metrics and the dashboard, if asked for (``observe/remote.py``):
    forked now, while this process has one thread; closed by ``res``."""
    if opts.metrics_port is None and opts.dashboard_port is None:
        return None
    from aisp.observe.remote import RemoteObserver

    port = opts.metrics_port if opts.metrics_port is not None else opts.dashboard_port
    observer = RemoteObserver(graph, port or 0, dashboard=opts.dashboard_port is not None)
    res.callback(observer.close)
    return observer


def _announce(port: int, opts: ObserveOptions) -> None:
    print(f"metrics http://127.0.0.1:{port}/metrics", file=sys.stderr, flush=True)
    if opts.dashboard_port is not None:
        print(f"dashboard http://127.0.0.1:{port}/", file=sys.stderr, flush=True)


def _drive(
    current: list[LocalExecutor], opts: RunOptions, store: CheckpointStore | None, updates: RunUpdates | None
) -> None:
    """Run until the pipeline is drained, switching graphs when a topology update is asked for
    (``current[0]``: the running executor)."""
    while not _drive_one(current[0], opts, store, updates):
        assert updates is not None
        current[0] = updates.apply(current[0])


def _drive_one(
    ex: LocalExecutor, opts: RunOptions, store: CheckpointStore | None, updates: RunUpdates | None
) -> bool:
    """Checkpoints, model version polls, the live view until ``ex`` drained (True) or a topology
    update is asked for (False)."""
    interval = opts.checkpoints.interval_s if opts.checkpoints is not None else 1.0
    watcher = VersionWatcher([b.runtime for b in ex.batchers.values()], opts.repository_poll_s)
    checkpoints = Checkpointer(ex, store, interval)
    ex.on_drained = (
        (lambda: ex.checkpoints.checkpoint(store)) if store is not None else ex.checkpoints.commit_sources
    )
    bounded = opts.checkpoints is not None and opts.checkpoints.state_max_keys
    tick = 0.05 if bounded else 0.25  # a bounded hot layer is watched closely

    def poll() -> bool:
        watcher.poll()
        if opts.observe.on_progress is not None:
            opts.observe.on_progress(ex)
        checkpoints.poll()
        return updates is None or not updates.requested or ex.stopping

    if not opts.observe.live:
        while not ex.join(timeout_s=tick):
            if not poll():
                return False
        return True
    from aisp.live import LiveView

    with LiveView(ex) as view:
        while not ex.join(timeout_s=0.25):
            view.update()
            if not poll():
                return False
    return True


def _run_workers(graph: Graph, opts: RunOptions) -> RunSummary:
    """``graph`` on ``opts.execution.workers`` processes (``schedule/workers/pool.py``)."""
    from aisp.live import merged_live_view
    from aisp.schedule.workers.exchange import plan_exchange
    from aisp.schedule.workers.pool import WorkerPool

    n = opts.execution.workers
    plan = plan_exchange(graph)
    _check_worker_options(opts)
    ck = opts.checkpoints
    started = time.monotonic_ns()
    with ExitStack() as resources:
        store = None
        if ck is not None:
            store = CheckpointStore(ck.dir, keep=ck.keep)
            store.lock()
            resources.callback(store.unlock)
        latest = restore_point(graph, store, n)
        changes = verify_models(graph, latest, allow_change=ck is not None and ck.allow_model_change)
        writer = dead_letter_sink(opts.dead_letter).open(
            latest.meta.get("dead_letter_bytes") if latest is not None else None
        )
        resources.callback(writer.close)
        sinks, encoders = {}, {}
        for node in graph.nodes:
            if node.kind == "sink":
                position = latest.meta["sinks"].get(node.step_id) if latest is not None else None
                part = node.spec.open() if position is None else node.spec.resume(position)
                resources.callback(part.close)
                sinks[node.step_id], encoders[node.step_id] = part, node.spec.line_encoder()
        stop = threading.Event()
        if opts.handle_signals:
            resources.callback(install_signals(stop.set) or (lambda: None))
        observer = _observer(graph, opts.observe, resources)  # forked before the workers
        pool = WorkerPool(
            graph, plan, n, options=opts.execution, sinks=sinks, encoders=encoders, dead_letter=writer,
            store=store, restore={"id": latest.id, "position": latest.meta["position"]} if latest else None,
            observe=observer is not None or opts.observe.live, repository_poll_s=opts.repository_poll_s,
        )  # fmt: skip
        pool.start()
        resources.callback(pool.close)
        if observer is not None:
            observer.start(pool.merged)
            _announce(observer.port, opts.observe)
        tick = resources.enter_context(merged_live_view(graph, pool.merged)) if opts.observe.live else None
        pool.run(stop=stop, interval_s=ck.interval_s if ck is not None else None, tick=tick)
    e2e, fields = pool.summary((time.monotonic_ns() - started) / 1e9)
    summary = RunSummary(
        pipeline=graph.name,
        dead_letters=writer.count,
        latency_ms=e2e.summary_ms(),
        peak_rss_mb=round(peak_rss_mb() + fields.pop("peak_rss_mb"), 1),
        stopped_early=stop.is_set(),
        dead_letters_by_step=dict(writer.by_step),
        restored_from=latest.id if latest is not None else None,
        model_changes=changes,
        **fields,
    )
    _finish_summary(summary, e2e, graph, opts)
    return summary


def _check_worker_options(opts: RunOptions) -> None:
    """What does not run on several workers yet: a clear error instead of a silent difference."""
    ck, obs = opts.checkpoints, opts.observe
    unsupported = {
        "--state-store": ck is not None and ck.state_store,
        "--partition-state": ck is not None and ck.partition_state_dir is not None,
        "--from-savepoint": ck is not None and ck.from_savepoint is not None,
        "--trace-sample": obs.trace is not None,
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise ConfigError(f"{', '.join(named)} cannot be combined with --workers N > 1 yet")


def _finish_summary(summary: RunSummary, e2e: LatencyHistogram, graph: Graph, opts: RunOptions) -> None:
    """The SLO attainment, and the summary file."""
    slo_ms = opts.observe.slo_ms
    summary.slo_ms = slo_ms if slo_ms is not None else graph.latency_bound_ms()
    if summary.slo_ms > 0 and e2e.count:
        within = e2e.cumulative([summary.slo_ms * 1e6])[0]
        summary.slo_attainment = round(within / e2e.count, 6)
    if opts.observe.summary_json:
        with open(opts.observe.summary_json, "wb") as fh:
            fh.write(summary.to_json())


def _summary(
    ex: LocalExecutor,
    graph: Graph,
    opts: RunOptions,
    latest: Checkpoint | None,
    stopped_early: bool,
    rollouts: dict[str, dict[str, Any]],
) -> RunSummary:
    summary = summarize(ex)
    summary.stopped_early, summary.rollouts = stopped_early, rollouts
    summary.checkpoints = ex.stats.checkpoints
    summary.restored_from = latest.id if latest is not None else None
    _finish_summary(summary, ex.stats.e2e, graph, opts)
    return summary
