"""``aisp serve``: a pipeline file or a model repository over HTTP and gRPC."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from aisp.cli.common import (
    TraceEndpoint,
    TraceMaxPerS,
    TraceSample,
    _limits,
    _params,
    _reloader,
    _tables,
    _trace_config,
    app,
    check_model_control,
    err,
    load_pipeline,
)
from aisp.errors import AispError, ConfigError


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
    grpc_server: Annotated[
        str,
        typer.Option(
            "--grpc-server",
            help="gRPC transport: native (HTTP/2 in Rust, outside the GIL; no TLS; reads a whole"
            " message before its size is checked), grpcio (grpc.aio: TLS, streams without a hop),"
            " auto (native on a loopback --host without --tls-cert, else grpcio).",
        ),
    ] = "auto",
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="TOML config: [auth] tokens, admin_tokens; [limits] per_key_rps, tiers;"
            " [anomaly.PIPELINE] an anomaly policy (aisp.admission.anomaly); [rollout.MODEL] a canary"
            " rollout policy (aisp.infer.models.rollout).",
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
        str | None,
        typer.Option(
            "--dead-letter",
            help="Where a pipeline's dead letters go: a JSONL file, or a redis:// or nats:// stream.",
        ),
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
    pipeline_dir: Annotated[
        list[str] | None,
        typer.Option(
            "--pipeline-dir",
            help="With --allow-model-control: topology updates may also load pipeline files from"
            " this directory (repeatable; the served file's own directory always may).",
        ),
    ] = None,
    trace_sample: TraceSample = 0.0,
    trace_endpoint: TraceEndpoint = None,
    trace_max_per_s: TraceMaxPerS = 100.0,
) -> None:
    """Serve a PIPELINE (events in, results out, over HTTP NDJSON and a gRPC stream) or a model
    REPOSITORY over Open Inference Protocol v2 (HTTP and gRPC).

    SIGTERM / Ctrl-C stop accepting, finish what was accepted, and exit 0. The bound addresses
    are printed on stdout as ``http HOST:PORT`` and ``grpc HOST:PORT``.
    """
    from aisp.admission.ratelimit import Limiter
    from aisp.serve.auth import Tokens
    from aisp.serve.grpc.server import GrpcServer, grpc_transport
    from aisp.serve.oip.shm import SharedMemoryRegions

    if (tls_cert is None) != (tls_key is None):
        err.print("[red]error:[/red] --tls-cert and --tls-key go together")
        raise typer.Exit(2)
    try:
        transport = grpc_transport(grpc_server, tls=tls_cert is not None, host=host)
        tokens = Tokens.load(config)
        check_model_control(host, allow_model_control, tokens)
        limits = _limits(config)
        trace = _trace_config(trace_sample, trace_endpoint, trace_max_per_s)
        served = _ServeTargets.start(
            target, model_repository, _params(param), admission_rows, admission_wait_ms, dead_letter,
            decode_process, trace, _tables(config, "anomaly"), pipeline_dir or [],
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
    grpc = None
    if grpc_port >= 0:
        grpc = GrpcServer(
            served.models,
            host=host,
            port=grpc_port,
            tls=_tls_pair(tls_cert, tls_key),
            transport=transport,
            **common,
        )
        grpc.start()
        print(f"grpc {grpc.address}", flush=True)
    try:
        if http_port >= 0:
            _serve_http(served.models, host, http_port, tls_cert, tls_key, common)
        else:
            _wait_for_a_signal()
    finally:
        if grpc is not None:
            grpc.stop(grace_s=10)  # finish accepted requests, refuse new ones
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
        pipeline_dirs: list[str],
    ) -> _ServeTargets:
        from aisp.admission.anomaly import AnomalyPolicy
        from aisp.observe.export.metrics import PipelineCollector
        from aisp.observe.export.rollouts import GraphVersions, update_counts
        from aisp.serve.metrics import ServerMetrics
        from aisp.serve.models.server import ModelServer
        from aisp.serve.pipelines.service import PipelineService

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
            service.pipeline_dirs = (str(Path(target).resolve().parent), *pipeline_dirs)
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
        from aisp.infer.models.rollout import RolloutPolicy

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

    from aisp.serve.http.app import create_app
    from aisp.serve.http.errors import JsonErrorsHttpTools

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
        # no permessage-deflate on the WebSocket: compressing every message costs more CPU than
        # the pipeline's own work on it (at 1,000 events a message, zlib on both ends held ingest
        # to a third of what it is without); clients that offer it fall back to plain frames
        ws_per_message_deflate=False,
    )
    _graceful_server(server_config).run(sockets=[sock])


def _wait_for_a_signal() -> None:
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
