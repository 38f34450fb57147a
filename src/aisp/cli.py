"""The ``aisp`` command: ``run`` or ``serve`` a pipeline file, ``chaos`` tests, ``diagnose`` a running
pipeline, print a ``topology``."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from aisp.errors import AispError
from aisp.pipeline import Pipeline

__all__ = ["app", "load_pipeline", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=True, help="AISP: AI-native stream processing.")
err = Console(stderr=True)


def load_pipeline(path: str, **params: Any) -> Pipeline:
    """Import a pipeline file and return its pipeline.

    The file defines ``build(**params) -> Pipeline`` (preferred; it receives options such as
    ``events`` and ``schema``-dependent ``input``) or a module-level ``pipeline``.
    """
    file = Path(path)
    if not file.is_file():
        raise typer.BadParameter(f"no pipeline file at {path!r}")
    spec = importlib.util.spec_from_file_location(f"aisp_user_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise typer.BadParameter(f"cannot import {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    build = getattr(module, "build", None)
    p = build(**params) if callable(build) else getattr(module, "pipeline", None)
    if not isinstance(p, Pipeline):
        raise typer.BadParameter(f"{path!r} defines neither build() -> Pipeline nor a `pipeline` object")
    return p


TraceSample = Annotated[
    float, typer.Option(help="Trace this share of the events (OpenTelemetry over OTLP/HTTP; 0: off).")
]
TraceEndpoint = Annotated[
    str | None, typer.Option(help="OTLP/HTTP traces endpoint (default: OTEL_EXPORTER_OTLP_* or :4318).")
]
TraceMaxPerS = Annotated[float, typer.Option(help="At most this many new traces a second (0: no cap).")]


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
    batch_rows: Annotated[int, typer.Option(help="Rows per source batch.")] = 512,
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
    state_store: Annotated[
        bool,
        typer.Option(help="Keep keyed state in an LMDB store in --checkpoint-dir, written incrementally."),
    ] = False,
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
    """Run PIPELINE to the end of its input (Ctrl-C / SIGTERM drain cleanly)."""
    from aisp.runner import RunOptions
    from aisp.runner import run as run_pipeline

    params: dict[str, Any] = _params(param)
    if events is not None:
        params["events"] = events
    if model_repository is not None:
        params["model_repository"] = model_repository
    try:
        p = load_pipeline(pipeline, **params)
        _bind(p, input, output)
        show_live = sys.stderr.isatty() if live is None else live
        summary = run_pipeline(
            p,
            RunOptions(
                dead_letter=dead_letter,
                rate_events_per_s=rate,
                batch_rows=batch_rows,
                live=show_live,
                handle_signals=True,
                summary_json=summary_json,
                repository_poll_s=repository_poll_s,
                checkpoint_dir=checkpoint_dir,
                checkpoint_interval_s=checkpoint_interval_s,
                state_store=state_store,
                metrics_port=metrics_port,
                trace=_trace_config(trace_sample, trace_endpoint, trace_max_per_s),
                slo_ms=slo_ms,
                dashboard_port=dashboard_port if dashboard else None,
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


def _trace_config(sample: float, endpoint: str | None, max_per_s: float) -> Any:
    """``--trace-*`` options as a ``TraceConfig`` (None: tracing off). With an endpoint and no
    sample, only events whose client sent a sampled ``traceparent`` are traced. Without either,
    the standard ``OTEL_*`` variables decide (``TraceConfig.from_env``)."""
    from aisp.observe.tracing import TraceConfig

    if sample <= 0 and endpoint is None:
        from_env = TraceConfig.from_env()
        return None if from_env is None else replace(from_env, max_traces_per_s=max_per_s)
    return TraceConfig(sample_ratio=sample, endpoint=endpoint, max_traces_per_s=max_per_s)


def _params(pairs: list[str] | None) -> dict[str, Any]:
    """``--param KEY=VALUE`` pairs for ``build()`` (values stay strings)."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise typer.BadParameter(f"--param takes KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def _bind(p: Pipeline, input: str | None, output: str | None) -> None:  # noqa: A002
    from aisp.connectors import sink_from_url, source_for

    if input is not None:
        p.bind(source=source_for(p, input))
    if output is not None:
        p.bind(sink=sink_from_url(output, p))


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


def _limits(config: str | None) -> Any:
    """``[limits]`` of the TOML config (rows/s per API key and per tier), or None."""
    import tomllib

    from aisp.schedule.ratelimit import RateLimits
    from aisp.transform.operators import DEFAULT_TIERS

    if config is None:
        return None
    section = tomllib.loads(Path(config).read_text()).get("limits")
    return RateLimits.from_config(section, DEFAULT_TIERS) if section else None


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
            "--config", help="TOML config: [auth] tokens, admin_tokens; [limits] per_key_rps, tiers."
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
    trace_sample: TraceSample = 0.0,
    trace_endpoint: TraceEndpoint = None,
    trace_max_per_s: TraceMaxPerS = 100.0,
) -> None:
    """Serve a PIPELINE (events in, results out, over HTTP NDJSON and a gRPC stream) or a model
    REPOSITORY over Open Inference Protocol v2 (HTTP and gRPC).

    SIGTERM / Ctrl-C stop accepting, finish what was accepted, and exit 0. The bound addresses
    are printed on stdout as ``http HOST:PORT`` and ``grpc HOST:PORT``.
    """
    import socket
    import threading

    from aisp.schedule.ratelimit import Limiter
    from aisp.serve.auth import Tokens
    from aisp.serve.grpc import GrpcServer
    from aisp.serve.metrics import ServerMetrics
    from aisp.serve.models import ModelServer
    from aisp.serve.pipelines import PipelineService

    if (tls_cert is None) != (tls_key is None):
        err.print("[red]error:[/red] --tls-cert and --tls-key go together")
        raise typer.Exit(2)
    pipelines: dict[str, PipelineService] = {}
    models: ModelServer | None = None
    try:
        tokens = Tokens.load(config)
        limits = _limits(config)
        if _is_pipeline_file(target):
            params = _params(param)
            if model_repository is not None:
                params["model_repository"] = model_repository
            service = PipelineService(
                load_pipeline(target, **params),
                capacity_rows=admission_rows,
                dead_letter=dead_letter,
                decode_process=decode_process,
                trace=_trace_config(trace_sample, trace_endpoint, trace_max_per_s),
            )
            pipelines[service.name] = service
            repository = model_repository
        else:
            repository = target
        if repository is not None:
            models = ModelServer(repository, admission_wait_ms=admission_wait_ms)
            models.start()
        for service in pipelines.values():
            service.start()
        # served models' batch sizes get their own name beside a pipeline's per-stage family
        metrics = ServerMetrics(models, batch_metric="aisp_model_batch_size_rows" if pipelines else None)
        for service in pipelines.values():  # the pipeline's stages on the same /metrics
            from aisp.observe.metrics import PipelineCollector

            metrics.registry.register(PipelineCollector(service.executor, service.admission))
    except AispError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    grpc_server = None
    limiter = Limiter(limits) if limits is not None and limits.enabled else None
    if grpc_port >= 0:
        grpc_server = GrpcServer(
            models,
            host=host,
            port=grpc_port,
            tokens=tokens,
            tls=_tls_pair(tls_cert, tls_key),
            metrics=metrics,
            limiter=limiter,
            pipelines=pipelines,
            admission_wait_ms=admission_wait_ms,
        )
        grpc_server.start()
        print(f"grpc {grpc_server.address}", flush=True)
    try:
        if http_port >= 0:
            import uvicorn

            from aisp.serve.http import create_app

            sock = socket.create_server((host, http_port))
            print(f"http {host}:{sock.getsockname()[1]}", flush=True)
            asgi = create_app(
                models,
                pipelines=pipelines,
                admission_wait_ms=admission_wait_ms,
                tokens=tokens,
                metrics=metrics,
                limiter=limiter,  # one set of buckets for HTTP and gRPC
            )
            server_config = uvicorn.Config(
                asgi,
                log_level="warning",
                http="httptools",
                loop="uvloop",
                lifespan="off",
                timeout_graceful_shutdown=10,
                ssl_certfile=tls_cert,
                ssl_keyfile=tls_key,
            )
            _graceful_server(server_config).run(sockets=[sock])
        else:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            stop.wait()
    finally:
        if grpc_server is not None:
            grpc_server.stop(grace_s=10)  # finish accepted requests, refuse new ones
        for service in pipelines.values():
            service.close()
        if models is not None:
            models.close()
    err.print("stopped")


chaos_app = typer.Typer(no_args_is_help=True, help="Fault injection that proves recovery.")
app.add_typer(chaos_app, name="chaos")
Via = Annotated[str, typer.Option(help="Where events come from and go to: file, redis, nats or kafka.")]


def _report(report: Any, json_out: str | None) -> None:
    from rich.table import Table

    table = Table(title=f"chaos: {report.scenario} via {report.via}")
    cells = {
        "expected": report.expected,
        "outputs": report.outputs,
        "dead-lettered": report.dead_lettered,
        "lost": report.lost,
        "duplicates": report.duplicates,
        "wrong values": report.wrong_values,
        "faults": report.faults,
        "recover s": ", ".join(f"{x:.2f}" for x in report.recover_s) or "-",
        "result": "[green]pass[/green]" if report.passed else "[red]FAIL[/red]",
    }
    for column in cells:
        table.add_column(column)
    table.add_row(*map(str, cells.values()))
    Console().print(table)
    if json_out:
        Path(json_out).write_text(json.dumps(report.to_dict(), indent=1))
    if not report.passed:
        raise typer.Exit(1)


@chaos_app.command("kill")
def chaos_kill(
    pipeline: Annotated[str, typer.Argument(help="Pipeline file.")],
    data: Annotated[str, typer.Option("--data", help="JSON-lines events to run.")],
    via: Via = "file",
    kills: Annotated[int, typer.Option(help="SIGKILLs at random moments.")] = 5,
    seed: Annotated[int, typer.Option(help="Seed of the kill times.")] = 0,
    rate: Annotated[float, typer.Option(help="Pace the input (events/s) so kills land mid-run.")] = 20_000,
    workdir: Annotated[str, typer.Option(help="Scratch directory (outputs, checkpoints).")] = "chaos-work",
    json_out: Annotated[str | None, typer.Option("--json", help="Write the report here.")] = None,
    bootstrap: Annotated[
        str, typer.Option(help="Kafka bootstrap HOST:PORT for --via kafka (default: start a Tansu broker).")
    ] = "",
) -> None:
    """SIGKILL `aisp run --checkpoint-dir` at random moments, restart it each time, and check the
    output against an uninterrupted run: nothing lost, nothing twice, same values."""
    from aisp.faults.chaos import kill_scenario

    try:
        report = kill_scenario(
            pipeline, data, via=via, kills=kills, seed=seed, rate=rate, work=workdir, bootstrap=bootstrap
        )
    except AispError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    _report(report, json_out)


@chaos_app.command("outage")
def chaos_outage(
    pipeline: Annotated[str, typer.Argument(help="Pipeline file.")],
    data: Annotated[str, typer.Option("--data", help="JSON-lines events to run.")],
    via: Via = "redis",
    down_s: Annotated[float, typer.Option(help="How long the broker stays away.")] = 3.0,
    rate: Annotated[float, typer.Option(help="Pace the input (events/s).")] = 20_000,
    workdir: Annotated[str, typer.Option(help="Scratch directory (outputs, checkpoints).")] = "chaos-work",
    json_out: Annotated[str | None, typer.Option("--json", help="Write the report here.")] = None,
    mode: Annotated[
        str, typer.Option(help="refuse, blackhole, slow (delay + jitter) or narrow (bandwidth).")
    ] = "refuse",
) -> None:
    """Cut the run off its broker for a while through a fault proxy, and check that it resumes
    by itself and ends with exactly-once output."""
    from aisp.faults.chaos import outage_scenario

    try:
        report = outage_scenario(pipeline, data, via=via, down_s=down_s, rate=rate, work=workdir, mode=mode)
    except AispError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    _report(report, json_out)


@chaos_app.command("restart")
def chaos_restart(
    pipeline: Annotated[str, typer.Argument(help="Pipeline file.")],
    data: Annotated[str, typer.Option("--data", help="JSON-lines events to run.")],
    via: Annotated[str, typer.Option(help="The broker to restart: nats or redis.")] = "nats",
    down_s: Annotated[float, typer.Option(help="How long the broker stays down.")] = 2.0,
    rate: Annotated[float, typer.Option(help="Pace the input (events/s).")] = 20_000,
    workdir: Annotated[str, typer.Option(help="Scratch directory (outputs, checkpoints).")] = "chaos-work",
    json_out: Annotated[str | None, typer.Option("--json", help="Write the report here.")] = None,
) -> None:
    """SIGKILL the broker (a private one on a free port, data on disk) mid-run and start it again;
    check that the run resumes by itself and ends with exactly-once output."""
    from aisp.faults.chaos import restart_scenario

    try:
        report = restart_scenario(pipeline, data, via=via, down_s=down_s, rate=rate, work=workdir)
    except AispError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    _report(report, json_out)


@chaos_app.command("model")
def chaos_model(
    pipeline: Annotated[str, typer.Argument(help="Pipeline file whose build() takes model_url.")],
    data: Annotated[str, typer.Option("--data", help="JSON-lines events to run.")],
    repository: Annotated[str, typer.Option(help="Model repository to serve with `aisp serve`.")],
    fault: Annotated[str, typer.Option(help="slow (added latency) or failing (refused).")] = "slow",
    delay_ms: Annotated[float, typer.Option(help="Latency added by a slow model.")] = 200.0,
    down_s: Annotated[float, typer.Option(help="How long the fault lasts.")] = 3.0,
    rate: Annotated[float, typer.Option(help="Pace the input (events/s).")] = 20_000,
    workdir: Annotated[str, typer.Option(help="Scratch directory (outputs, checkpoints).")] = "chaos-work",
    json_out: Annotated[str | None, typer.Option("--json", help="Write the report here.")] = None,
) -> None:
    """Make the pipeline's remote model slow or failing for a while (through a fault proxy in
    front of `aisp serve`); every event must come out once or be dead-lettered with its cause."""
    from aisp.faults.chaos import model_scenario

    try:
        report = model_scenario(
            pipeline, data, repository, fault=fault, delay_ms=delay_ms, down_s=down_s, rate=rate, work=workdir
        )
    except AispError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    _report(report, json_out)


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


@app.command()
def bench(
    target: Annotated[
        str,
        typer.Argument(help="http://HOST:PORT/v1/pipelines/NAME, grpc://HOST:PORT/NAME, or a pipeline file."),
    ],
    rate: Annotated[float, typer.Option(help="Open loop: events/s (the start of an automatic sweep).")] = 0.0,
    concurrency: Annotated[int, typer.Option(help="Closed loop: requests in flight.")] = 0,
    duration_s: Annotated[float, typer.Option(help="Measured seconds per point.")] = 5.0,
    warmup_s: Annotated[float, typer.Option(help="Unmeasured seconds before each point.")] = 0.5,
    events_per_request: Annotated[int, typer.Option(help="Events (NDJSON lines) per request.")] = 1,
    slo_ms: Annotated[float, typer.Option(help="The p99 latency target.")] = 50.0,
    sweep_rates: Annotated[
        str | None,
        typer.Option(
            "--sweep",
            help="Rates to run, comma-separated, or 'auto': double until the SLO fails, then bisect.",
        ),
    ] = None,
    data: Annotated[str | None, typer.Option(help="JSON-lines events to send (default: workload F).")] = None,
    json_out: Annotated[str | None, typer.Option("--json", help="Write the results here.")] = None,
    plot: Annotated[
        list[str] | None, typer.Option(help="Write latency percentiles vs rate to FILE.png or FILE.html.")
    ] = None,
) -> None:
    """Load a pipeline at a fixed arrival rate (open loop) or concurrency (closed loop) and
    report latency percentiles, throughput, SLO attainment and errors."""
    from rich.live import Live

    from aisp.bench import LoadSpec, PointResult, make_target, plot_html, plot_png, run_point, workload_lines
    from aisp.bench import sweep as run_sweep
    from aisp.bench.report import Sweep

    rates = None
    if sweep_rates not in (None, "auto"):
        rates = [float(r) for r in sweep_rates.split(",") if r.strip()]
        rate = rate or (rates[0] if rates else 0.0)
    try:
        spec = LoadSpec(
            rate=rate,
            concurrency=concurrency,
            duration_s=duration_s,
            warmup_s=warmup_s,
            events_per_request=events_per_request,
            slo_ms=slo_ms,
        )
        where = make_target(target)
        lines = None if isinstance(where, str) else workload_lines(max(events_per_request * 256, 8192), data)
        table = Table(title=f"aisp bench {target} (SLO p99 <= {slo_ms:g} ms)")
        for column in (
            "offered/s",
            "achieved/s",
            "p50",
            "p90",
            "p99",
            "p99.9",
            "max",
            "in SLO",
            "errors",
            "ok",
        ):
            table.add_column(column, justify="right")

        def add(p: PointResult) -> None:
            lat = p.latency_ms
            table.add_row(
                f"{p.offered_rate:,.0f}" if p.mode == "open" else f"c={p.concurrency}",
                f"{p.achieved_rate:,.0f}",
                *(f"{lat[q]:g}" for q in ("p50", "p90", "p99", "p999", "max")),
                f"{100 * p.slo_attainment:.1f}%",
                f"{sum(p.errors.values()):,}",
                "yes" if p.meets_slo() else "no",
            )

        with Live(table, console=err, refresh_per_second=4, transient=False):
            if sweep_rates is None:
                result = Sweep(target, spec)
                result.points.append(run_point(where, spec, lines=lines))
                add(result.points[-1])
            else:
                result = run_sweep(where, target, spec, rates=rates, lines=lines, on_point=add)
    except (AispError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    if any(p.client_cpu_share > 0.9 for p in result.points):
        err.print("[yellow]note:[/yellow] the client used a whole core: raise --events-per-request")
    best = result.best
    err.print(
        f"highest rate meeting the SLO: {best.offered_rate:,.0f} events/s"
        if best and best.mode == "open"
        else ("the SLO was met" if best else "the SLO was not met")
    )
    report = result.as_dict()
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2) + "\n")
    else:
        print(json.dumps(report, indent=2))
    for out in plot or []:
        try:
            (plot_png if out.endswith(".png") else plot_html)(result, out)
        except AispError as exc:
            err.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from exc


@app.command()
def diagnose(
    url: Annotated[
        str | None, typer.Option(help="A running pipeline or server: http://HOST:PORT (its /metrics).")
    ] = None,
    window_s: Annotated[float, typer.Option(help="Seconds between the two scrapes compared.")] = 3.0,
    snapshot: Annotated[
        list[str] | None,
        typer.Option(help="Recorded /metrics text instead of --url: one (since start) or two (a window)."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the findings as JSON.")] = False,
) -> None:
    """Name what makes a running pipeline slow: the findings, most likely first."""
    import httpx

    from aisp.observe.diagnose import Scrape, metrics_url
    from aisp.observe.diagnose import diagnose as find_causes

    files = snapshot or []
    before: Scrape | None
    if (url is None) == (not files) or len(files) > 2:
        raise typer.BadParameter("give --url, or one or two --snapshot files")
    try:
        if url is not None:
            address = metrics_url(url)
            before = Scrape(httpx.get(address, timeout=10).raise_for_status().text)
            time.sleep(window_s)
            after = Scrape(httpx.get(address, timeout=10).raise_for_status().text)
        else:
            texts = [Path(f).read_text() for f in files]
            before = Scrape(texts[0]) if len(texts) == 2 else None
            after = Scrape(texts[-1])
    except (httpx.HTTPError, OSError, ValueError) as exc:
        err.print(f"[red]error:[/red] cannot read metrics: {exc}")
        raise typer.Exit(2) from exc
    findings = find_causes(before, after, seconds=window_s if url is not None else None)
    if json_out:
        print(json.dumps([f.as_dict() for f in findings], indent=2))
        return
    table = Table(title="diagnosis (most likely first)")
    for column in ("cause", "stage", "score", "evidence", "suggestion"):
        table.add_column(column, overflow="fold")
    for f in findings:
        evidence = ", ".join(f"{k}={v}" for k, v in f.evidence.items())
        table.add_row(f.cause, f.stage, f"{f.score:.2f}", evidence, f.suggestion)
    Console().print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
