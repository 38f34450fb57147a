"""``aisp run`` and ``aisp topology``."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer

from aisp.cli.common import (
    TraceEndpoint,
    TraceMaxPerS,
    TraceSample,
    _bind,
    _checkpoints,
    _params,
    _trace_config,
    app,
    err,
    load_pipeline,
)
from aisp.errors import AispError


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
    allow_model_change: Annotated[
        bool,
        typer.Option(
            "--allow-model-change",
            help="Restore from the checkpoint even when a model step's version or weights changed"
            " since (the summary names them); without it such a restore is refused.",
        ),
    ] = False,
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
                    allow_model_change,
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
    for step, change in summary.model_changes.items():
        then, now = change["checkpoint"], change["now"]
        err.print(
            f"[yellow]restored across a model change:[/yellow] step {step!r} was version {then['version']}"
            f" (weights {then['weights_sha256'][:12] or '?'}), now {now['version']}"
            f" (weights {now['weights_sha256'][:12] or '?'})"
        )


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
