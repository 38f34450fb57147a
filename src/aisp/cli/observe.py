"""``aisp bench`` and ``aisp diagnose``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from aisp.cli.common import app, err
from aisp.errors import AispError


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

    from aisp.observe.diagnose.pipeline import Scrape, metrics_url
    from aisp.observe.diagnose.pipeline import diagnose as find_causes

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
