"""``aisp run``, ``aisp serve`` and ``aisp topology``."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from aisp.cli.common import (
    TraceEndpoint,
    TraceMaxPerS,
    TraceSample,
    _bind,
    _checkpoints,
    _limits,
    _params,
    _reloader,
    _tables,
    _trace_config,
    app,
    err,
    load_pipeline,
)
from aisp.errors import AispError, ConfigError


@app.command()
def run(
    pipeline: Annotated[str, typer.Argument(help="Python file defining build() or `pipeline`.")],
    input: Annotated[str | None, typer.Option("--input", "-i", help="JSONL input file.")] = None,  # noqa: A002
    output: Annotated[str | None, typer.Option("--output", "-o", help="JSONL output file.")] = None,
    dead_letter: Annotated[
        str | None,
        typer.Option("--dead-letter", help="Dead letters: a JSONL file, redis://… or nats://… stream."),
    ] = None,
    rate: Annotated[float, typer.Option(help="Pace the source at N events/s, open loop (0: max).")] = 0.0,
    events: Annotated[int | None, typer.Option(help="Events for a generator source.")] = None,
    batch_rows: Annotated[int, typer.Option(help="Rows per source batch.")] = 2048,
    workers: Annotated[
        int,
        typer.Option(help="Worker processes that share the pipeline by key (a file input; 0: one per core)."),
    ] = 1,
    summary_json: Annotated[
        str | None, typer.Option("--summary-json", help="Write the summary here.")
    ] = None,
    live: Annotated[bool | None, typer.Option("--live/--no-live", help="Live progress view.")] = None,
    model_repository: Annotated[
        str | None, typer.Option("--model-repository", help="Triton-style model repository for the pipeline.")
    ] = None,
    repository_poll_s: Annotated[
        float, typer.Option(help="Check the repository for new model versions every N s (0: never).")
    ] = 1.0,
    checkpoint_dir: Annotated[
        str | None,
        typer.Option(
            "--checkpoint-dir", help="Checkpoint here every --checkpoint-interval-s; restart from the newest."
        ),
    ] = None,
    checkpoint_interval_s: Annotated[float, typer.Option(help="Seconds between checkpoints.")] = 1.0,
    from_savepoint: Annotated[
        str | None,
        typer.Option(
            help="With --checkpoint-dir still empty: start from the newest checkpoint in this directory,"
            " taken by another version of the pipeline (the state of the steps it keeps is carried)."
        ),
    ] = None,
    state_store: Annotated[
        bool,
        typer.Option(help="Keep keyed state in an LMDB store in --checkpoint-dir, written incrementally."),
    ] = False,
    partition_state: Annotated[
        str | None,
        typer.Option(
            help="With a Kafka --input and --checkpoint-dir: checkpoint keyed state per input partition,"
            " so it moves with rebalanced partitions: 'changelog' keeps it in changelog topics on the"
            " input's broker (workers on several machines share nothing else), a directory keeps it"
            " there, shared by the group's processes."
        ),
    ] = None,
    standby_replicas: Annotated[
        int,
        typer.Option(
            help="With --partition-state changelog: keep K warm copies of each partition in the group"
            " (each worker copies K times as many partitions as it owns, the ones after its own) by"
            " tailing their changelogs, so a takeover reads only the tail."
        ),
    ] = 0,
    state_max_keys: Annotated[
        int,
        typer.Option(
            help="With --state-store: keep about this many keys per key space in memory (0: all); the"
            " least recently seen are evicted at checkpoints and read back when seen again."
        ),
    ] = 0,
    param: Annotated[
        list[str] | None, typer.Option("--param", help="KEY=VALUE passed to the file's build() (repeatable).")
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus /metrics on 127.0.0.1:PORT during the run (0: free).")
    ] = None,
    trace_sample: TraceSample = 0.0,
    trace_endpoint: TraceEndpoint = None,
    trace_max_per_s: TraceMaxPerS = 100.0,
    slo_ms: Annotated[
        float | None,
        typer.Option(help="Latency target for the summary's SLO attainment (default: the pipeline's bound)."),
    ] = None,
    dashboard: Annotated[bool, typer.Option(help="Serve the live dashboard during the run.")] = False,
    dashboard_port: Annotated[
        int, typer.Option(help="The dashboard's port on 127.0.0.1 (0: a free one).")
    ] = 0,
) -> None:
    """Run PIPELINE to the end of its input (Ctrl-C / SIGTERM drain cleanly; with
    --checkpoint-dir, SIGHUP switches to the file's new version at a checkpoint)."""
    from aisp.runner import ObserveOptions, RunOptions
    from aisp.runner import run as run_pipeline
    from aisp.schedule.executor import ExecutorOptions

    params: dict[str, Any] = _params(param)
    if events is not None:
        params["events"] = events
    if model_repository is not None:
        params["model_repository"] = model_repository

    def reload() -> Any:  # SIGHUP: the file again, as a topology update (with --checkpoint-dir)
        again = load_pipeline(pipeline, **params)
        _bind(again, input, output)
        return again

    try:
        p = load_pipeline(pipeline, **params)
        _bind(p, input, output)
        show_live = sys.stderr.isatty() if live is None else live
        summary = run_pipeline(
            p,
            RunOptions(
                dead_letter=dead_letter,
                execution=ExecutorOptions(
                    rate_events_per_s=rate,
                    source_batch_rows=batch_rows,
                    workers=workers or os.cpu_count() or 1,
                ),
                checkpoints=_checkpoints(
                    checkpoint_dir,
                    checkpoint_interval_s,
                    state_store,
                    state_max_keys,
                    partition_state,
                    standby_replicas,
                    from_savepoint,
                ),
                observe=ObserveOptions(
                    live=show_live,
                    summary_json=summary_json,
                    metrics_port=metrics_port,
                    trace=_trace_config(trace_sample, trace_endpoint, trace_max_per_s),
                    slo_ms=slo_ms,
                    dashboard_port=dashboard_port if dashboard else None,
                ),
                handle_signals=True,
                repository_poll_s=repository_poll_s,
                reload=reload,
            ),
        )
    except AispError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    lat = summary.latency_ms
    if show_live:
        err.print()
    err.print(
        f"[bold]{summary.pipeline}[/bold]: {summary.events_in:,} in, {summary.events_out:,} out, "
        f"{summary.dead_letters:,} dead letters in {summary.seconds:.2f} s "
        f"({summary.events_per_s:,.0f} events/s); e2e p50 {lat['p50']} ms, p99 {lat['p99']} ms, "
        f"p99.9 {lat['p999']} ms, max {lat['max']} ms; peak RSS {summary.peak_rss_mb:.0f} MB"
        + (" (stopped early, drained)" if summary.stopped_early else "")
    )


class _GracefulServerMixin:
    """uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then re-raises the signal (so the
    process dies of it); a drained ``aisp serve`` exits 0 instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handle_exit = self.handle_exit  # type: ignore[attr-defined]
        old = {s: signal.signal(s, handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def _tls_pair(cert: str | None, key: str | None) -> tuple[bytes, bytes] | None:
    if cert is None or key is None:
        return None
    return Path(cert).read_bytes(), Path(key).read_bytes()


def _graceful_server(config: Any) -> Any:
    import uvicorn

    return type("_GracefulServer", (_GracefulServerMixin, uvicorn.Server), {})(config)


def _is_pipeline_file(target: str) -> bool:
    return target.endswith(".py") and Path(target).is_file()


@app.command()
def serve(
    target: Annotated[
        str, typer.Argument(metavar="PIPELINE|REPOSITORY", help="A pipeline file, or a model repository.")
    ],
    host: Annotated[
        str, typer.Option(help="Address to bind (loopback unless told otherwise).")
    ] = "127.0.0.1",
    http_port: Annotated[int, typer.Option(help="HTTP port (0: a free port, -1: off).")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="gRPC port (0: a free port, -1: off).")] = 8001,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="TOML config: [auth] tokens, admin_tokens; [limits] per_key_rps, tiers;"
            " [anomaly.PIPELINE] an anomaly policy (aisp.schedule.anomaly); [rollout.MODEL] a canary"
            " rollout policy (aisp.infer.rollout).",
        ),
    ] = None,
    tls_cert: Annotated[
        str | None, typer.Option(help="PEM certificate: serve HTTPS and gRPC over TLS.")
    ] = None,
    tls_key: Annotated[str | None, typer.Option(help="PEM private key for --tls-cert.")] = None,
    model_repository: Annotated[
        str | None,
        typer.Option(
            "--model-repository", help="With a PIPELINE: its model repository, also served over OIP."
        ),
    ] = None,
    admission_rows: Annotated[
        int, typer.Option(help="Pipeline admission queue: events accepted but not yet taken.")
    ] = 65536,
    admission_wait_ms: Annotated[
        float, typer.Option(help="How long a new request may wait for room before a 429.")
    ] = 0.0,
    dead_letter: Annotated[
        str | None, typer.Option("--dead-letter", help="JSONL file for a pipeline's dead letters.")
    ] = None,
    decode_process: Annotated[
        bool, typer.Option(help="Decode a pipeline's incoming JSON in a worker process (another core).")
    ] = True,
    param: Annotated[
        list[str] | None,
        typer.Option("--param", help="KEY=VALUE passed to a pipeline's build() (repeatable)."),
    ] = None,
    allow_model_control: Annotated[
        bool,
        typer.Option(
            "--allow-model-control",
            help="Let clients load and unload models (Triton's model control); on with admin tokens.",
        ),
    ] = False,
    allow_shared_memory: Annotated[
        bool,
        typer.Option(
            "--allow-shared-memory",
            help="Let local clients pass tensors through system shared memory (Triton's extension).",
        ),
    ] = False,
    trace_sample: TraceSample = 0.0,
    trace_endpoint: TraceEndpoint = None,
    trace_max_per_s: TraceMaxPerS = 100.0,
) -> None:
    """Serve a PIPELINE (events in, results out, over HTTP NDJSON and a gRPC stream) or a model
    REPOSITORY over Open Inference Protocol v2 (HTTP and gRPC).

    SIGTERM / Ctrl-C stop accepting, finish what was accepted, and exit 0. The bound addresses
    are printed on stdout as ``http HOST:PORT`` and ``grpc HOST:PORT``.
    """
    from aisp.schedule.ratelimit import Limiter
    from aisp.serve.auth import Tokens
    from aisp.serve.grpc import GrpcServer
    from aisp.serve.shm import SharedMemoryRegions

    if (tls_cert is None) != (tls_key is None):
        err.print("[red]error:[/red] --tls-cert and --tls-key go together")
        raise typer.Exit(2)
    try:
        tokens = Tokens.load(config)
        limits = _limits(config)
        trace = _trace_config(trace_sample, trace_endpoint, trace_max_per_s)
        served = _ServeTargets.start(
            target, model_repository, _params(param), admission_rows, admission_wait_ms, dead_letter,
            decode_process, trace, _tables(config, "anomaly"),
        )  # fmt: skip
        served.roll_out(_tables(config, "rollout"))
        if served.pipelines:  # SIGHUP: each served pipeline file is reloaded as a topology update
            signal.signal(signal.SIGHUP, lambda *_: served.update_in_background())
    except AispError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    limiter = Limiter(limits) if limits is not None and limits.enabled else None
    common = {
        "tokens": tokens,
        "metrics": served.metrics,
        "limiter": limiter,  # one set of buckets for HTTP and gRPC
        "pipelines": served.pipelines,
        "admission_wait_ms": admission_wait_ms,
        "model_control": allow_model_control or tokens.enabled,  # with tokens, only admin ones may
        "shared_memory": SharedMemoryRegions(allowed=allow_shared_memory),  # one set for HTTP and gRPC
    }
    from aisp.runner import tune_gc

    restore_gc = tune_gc()  # models and pipelines are loaded: what is left is per request
    grpc_server = None
    if grpc_port >= 0:
        grpc_server = GrpcServer(
            served.models, host=host, port=grpc_port, tls=_tls_pair(tls_cert, tls_key), **common
        )
        grpc_server.start()
        print(f"grpc {grpc_server.address}", flush=True)
    try:
        if http_port >= 0:
            _serve_http(served.models, host, http_port, tls_cert, tls_key, common)
        else:
            _wait_for_a_signal()
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace_s=10)  # finish accepted requests, refuse new ones
        served.close()
        common["shared_memory"].close()
        restore_gc()
    err.print("stopped")


@dataclass
class _ServeTargets:
    """What ``aisp serve`` serves: a pipeline service, a model server, or both, and /metrics."""

    pipelines: dict[str, Any]
    models: Any
    metrics: Any

    @classmethod
    def start(
        cls,
        target: str,
        model_repository: str | None,
        params: dict[str, Any],
        admission_rows: int,
        admission_wait_ms: float,
        dead_letter: str | None,
        decode_process: bool,
        trace: Any,
        anomaly: dict[str, Any],
    ) -> _ServeTargets:
        from aisp.observe.metrics import PipelineCollector
        from aisp.observe.rollouts import GraphVersions, update_counts
        from aisp.schedule.anomaly import AnomalyPolicy
        from aisp.serve.metrics import ServerMetrics
        from aisp.serve.models import ModelServer
        from aisp.serve.pipelines import PipelineService

        pipelines: dict[str, PipelineService] = {}
        repository: str | None = target
        if _is_pipeline_file(target):
            if model_repository is not None:
                params["model_repository"] = model_repository
            pipeline = load_pipeline(target, **params)
            unknown = sorted(set(anomaly) - {pipeline.name})
            if unknown:
                raise ConfigError(f"[anomaly]: no served pipeline named {unknown}; serving {pipeline.name!r}")
            policy = anomaly.get(pipeline.name)
            service = PipelineService(
                pipeline,
                capacity_rows=admission_rows,
                dead_letter=dead_letter,
                decode_process=decode_process,
                trace=trace,
                anomaly=AnomalyPolicy.from_config(policy) if policy is not None else None,
            )
            service.reload = _reloader(target, params)
            pipelines[service.name] = service
            repository = model_repository
        elif anomaly:
            raise ConfigError("[anomaly] applies to a served pipeline; this serves a model repository")
        models = None
        if repository is not None:
            models = ModelServer(repository, admission_wait_ms=admission_wait_ms)
            models.start()
        for service in pipelines.values():
            service.start()
        # served models' batch sizes get their own name beside a pipeline's per-stage family
        metrics = ServerMetrics(models, batch_metric="aisp_model_batch_size_rows" if pipelines else None)
        for service in pipelines.values():  # the pipeline's stages on the same /metrics
            metrics.registry.register(
                PipelineCollector(service.view, service.admission, anomaly=lambda s=service: s.control)
            )
        metrics.registry.register(
            GraphVersions(
                lambda: {n: update_counts(s.graph_version, s.updates) for n, s in pipelines.items()}
            )
        )
        return cls(pipelines, models, metrics)

    def update_in_background(self) -> None:
        """Reload every served pipeline's file as a topology update (failures are logged)."""
        import threading

        def update() -> None:
            for service in self.pipelines.values():
                with contextlib.suppress(Exception):  # reported in the log and the graph status
                    service.update()

        threading.Thread(target=update, name="aisp-update", daemon=True).start()

    def roll_out(self, policies: dict[str, Any]) -> None:
        """Start the rollouts of the config's ``[rollout.MODEL]`` tables."""
        from aisp.infer.rollout import RolloutPolicy

        if policies and self.models is None:
            raise ConfigError("[rollout] applies to served models; this serves no model repository")
        for name, table in policies.items():
            assert self.models is not None
            self.models.start_rollout(name, RolloutPolicy.parse(table))

    def close(self) -> None:
        for service in self.pipelines.values():
            service.close()
        if self.models is not None:
            self.models.close()


def _serve_http(
    models: Any, host: str, port: int, tls_cert: str | None, tls_key: str | None, common: dict[str, Any]
) -> None:
    """The HTTP app on uvicorn, until SIGTERM / Ctrl-C (then a graceful drain)."""
    import socket

    import anyio
    import uvicorn

    from aisp.serve.http import create_app
    from aisp.serve.http_errors import JsonErrorsHttpTools

    # load anyio's asyncio backend now: the first request that hands work to a thread (a topology
    # update, a model load, the dashboard) would import it in the event loop, holding up every
    # request in flight for ~30 ms
    anyio.run(anyio.sleep, 0)
    sock = socket.create_server((host, port))
    print(f"http {host}:{sock.getsockname()[1]}", flush=True)
    server_config = uvicorn.Config(
        create_app(models, **common),
        log_level="warning",
        http=JsonErrorsHttpTools,  # httptools, with JSON for requests it cannot parse
        loop="uvloop",
        lifespan="off",
        timeout_graceful_shutdown=10,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )
    _graceful_server(server_config).run(sockets=[sock])


def _wait_for_a_signal() -> None:
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


@app.command()
def topology(
    pipeline: Annotated[str, typer.Argument(help="Python file defining build() or `pipeline`.")],
) -> None:
    """Print the DAG in topological order and its static end-to-end latency bound."""
    try:
        graph = load_pipeline(pipeline).build()
    except AispError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    print(graph.render())
