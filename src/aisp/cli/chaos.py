"""``aisp chaos``: fault injection that proves recovery."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from aisp.cli.common import app, err
from aisp.errors import AispError

chaos_app = typer.Typer(no_args_is_help=True, help="Fault injection that proves recovery.")
app.add_typer(chaos_app, name="chaos")
Via = Annotated[str, typer.Option(help="Where events come from and go to: file, redis, nats or kafka.")]


def _report(report: Any, json_out: str | None) -> None:

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
        str,
        typer.Option(
            help="refuse, blackhole, slow (delay + jitter), narrow (bandwidth) or flaky (dropped links)."
        ),
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


def _workload(spec: str) -> Any:
    """``NAME=PIPELINE,DATA[,KEY[,windows]]`` as a campaign workload."""
    from aisp.faults.campaign import Workload

    name, _, rest = spec.partition("=")
    parts = rest.split(",") if rest else []
    if not name or len(parts) < 2:
        raise typer.BadParameter(f"a workload is NAME=PIPELINE,DATA[,KEY[,windows]], got {spec!r}")
    key = ",".join(p for p in parts[2:] if p != "windows") or "id"
    return Workload(
        name=name, pipeline=parts[0], data=parts[1], key=key, partitioned="windows" not in parts[2:]
    )


@chaos_app.command("campaign")
def chaos_campaign(
    workload: Annotated[
        list[str],
        typer.Option(
            help="NAME=PIPELINE,DATA[,KEY...][,windows]: a pipeline file, its JSON-lines events and the"
            " output fields naming a row (default id); 'windows': its output depends on how"
            " partitions interleave (one input partition). Repeat for several."
        ),
    ],
    cases: Annotated[int, typer.Option(help="Cases to draw.")] = 50,
    seed: Annotated[
        int | None, typer.Option(help="Seed of the draw (default: a random one, printed).")
    ] = None,
    replay: Annotated[
        list[int] | None, typer.Option(help="Run only the case of this seed (from a report); repeatable.")
    ] = None,
    via: Annotated[
        list[str] | None, typer.Option(help="Connectors to draw from (default: all four).")
    ] = None,
    rate: Annotated[float, typer.Option(help="Pace the input (events/s) so kills land mid-run.")] = 4000,
    out: Annotated[
        str, typer.Option(help="Where the report (campaign.json, campaign.md) goes.")
    ] = "out/chaos-campaign",
) -> None:
    """Fault scenarios drawn at random (connectors, partitions, groups, transactional outputs, state
    in changelog topics; 1-8 kills at random moments, or a 1-20 s broker outage of a drawn kind),
    each checked against an uninterrupted run; writes a report of every case, its seed and its
    recovery times. Exit 1 when a case failed."""
    from aisp.faults.campaign import VIAS, draw_case, draw_cases, run_campaign

    loads = [_workload(w) for w in workload]
    vias = via or list(VIAS)
    if replay:
        drawn = [draw_case(s, loads, vias) for s in replay]
    else:
        seed = seed if seed is not None else random.randrange(2**31)
        print(f"campaign seed {seed}: {cases} cases (replay one with --replay CASE_SEED)")
        drawn = draw_cases(seed, cases, loads, vias)

    def show(result: Any) -> None:
        verdict = "pass" if result.passed else "FAIL"
        detail = result.report.to_dict() if result.report else result.error
        print(f"{verdict} {result.case.describe()} in {result.seconds:.0f} s: {detail}", flush=True)

    try:
        results = run_campaign(drawn, loads, out, rate=rate, on_case=show)
    except AispError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    failed = [r.case.seed for r in results if not r.passed]
    print(f"{len(results) - len(failed)} of {len(results)} cases passed; report in {out}/campaign.md")
    if failed:
        print("failed case seeds: " + " ".join(map(str, failed)))
        raise typer.Exit(1)
