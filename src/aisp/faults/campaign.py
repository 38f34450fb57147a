"""A seeded fault campaign: fault scenarios drawn at random over the shapes a deployment takes.

Each case is a ``kill_scenario`` (or an ``outage_scenario``) with its own seed: a workload (a
pipeline file, its data and the output key it is compared by), a connector (``file``, ``redis``,
``nats``, ``kafka``), for Kafka 1 to 8 input partitions keyed by user, a named consumer group or
the default one, transactional or plain output and keyed state in changelog topics (with 0 or 1
standby) or in the process's checkpoints; then 1 to 8 SIGKILLs at random moments, or (through a
broker, about one case in four) an outage of the path to the broker: connections refused, a
blackhole, a slow, narrow or flaky link, 1 to 20 s long, struck 0 to 2 s after the run's second
checkpoint (mid-run at the campaign's pace). Every case must end with each input output once and
the same values as an uninterrupted run (state features included).

``draw_cases(seed, n)`` is deterministic: a failing case replays from its seed (``Case.seed``,
printed in every report) with ``aisp chaos campaign --replay SEED``. ``run_campaign`` runs the
cases one after another and writes ``campaign.json`` and ``campaign.md`` (cases, seeds,
failures, recovery times) as it goes, so an interrupted campaign still leaves a report.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from aisp.connectors.base import ScenarioShape
from aisp.errors import AispError, ConfigError
from aisp.faults.chaos import ChaosReport, kill_scenario, outage_scenario

__all__ = ["Case", "CaseResult", "Workload", "draw_cases", "run_campaign"]

VIAS = ("file", "redis", "nats", "kafka")
OUTAGES = ("refuse", "blackhole", "slow", "narrow", "flaky")
"""The outage modes a case draws from (``outage_scenario``'s ``mode``)."""
OUTAGE_SHARE = 0.25
"""The share of cases through a broker that are an outage instead of kills."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A pipeline file, its JSON-lines data and the output fields a row is compared by."""

    name: str
    pipeline: str
    data: str
    key: str = "id"
    """The output field (or fields, comma-separated) that names a row."""
    partitioned: bool = True
    """Whether its output is the same however the input is cut into partitions by user (keyed
    state: yes; event-time windows over several partitions: no, the watermark depends on how
    the partitions interleave)."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One drawn scenario (see the module docstring)."""

    seed: int
    workload: str
    via: str
    kills: int
    partitions: int = 1
    group: bool = True
    transactional: bool = True
    partition_state: str = ""
    """``changelog`` (Kafka only) or empty: keyed state in the process's checkpoints."""
    standbys: int = 0
    window_s: tuple[float, float] = (1.0, 3.0)
    """When a kill comes, after the run started (start-up is part of the window: kills land
    in start-up, restore, rebalancing and processing)."""
    outage: str = ""
    """An outage mode (``OUTAGES``) instead of kills (``kills`` is then 0); empty: kills."""
    down_s: float = 0.0
    """How long the outage lasts."""
    after_s: float = 0.0
    """When it strikes, after the run's second checkpoint."""

    def describe(self) -> str:
        shape = f"{self.partitions}p " if self.via == "kafka" else ""
        if self.outage:
            shape += f"{self.outage} outage of {self.down_s:g} s at +{self.after_s:g} s"
        else:
            shape += f"{self.kills} kills"
        extra = [
            "" if self.group else "default group",
            "" if self.via != "kafka" else ("transactional" if self.transactional else "plain output"),
            f"state {self.partition_state} +{self.standbys} standby" if self.partition_state else "",
        ]
        tail = ", ".join(x for x in extra if x)
        return f"#{self.seed} {self.workload} via {self.via} {shape}" + (f" ({tail})" if tail else "")


def draw_case(
    seed: int,
    workloads: Sequence[Workload],
    vias: Sequence[str] = VIAS,
    *,
    outage_share: float = OUTAGE_SHARE,
) -> Case:
    """The case of ``seed`` (the same seed gives the same case); ``outage_share`` of the cases
    through a broker are outages (1.0: all of them)."""
    rng = random.Random(seed)
    case = _draw_shape(rng, seed, workloads, vias)
    if case.via != "file" and rng.random() < outage_share:  # drawn last: kill cases keep their seeds
        mode = rng.choice(OUTAGES)
        down_s, after_s = round(rng.uniform(1.0, 20.0), 1), round(rng.uniform(0.0, 2.0), 1)
        case = replace(case, kills=0, outage=mode, down_s=down_s, after_s=after_s)
    return case


def _draw_shape(rng: random.Random, seed: int, workloads: Sequence[Workload], vias: Sequence[str]) -> Case:
    w = rng.choice(list(workloads))
    via = rng.choice(list(vias))
    kills = rng.randint(1, 8)
    if via != "kafka":
        return Case(seed=seed, workload=w.name, via=via, kills=kills, group=rng.random() < 0.5)
    partitions = rng.randint(1, 8) if w.partitioned else 1
    state = "changelog" if rng.random() < 0.3 else ""
    return Case(
        seed=seed,
        workload=w.name,
        via=via,
        kills=kills,
        partitions=partitions,
        group=rng.random() < 0.5,
        transactional=rng.random() < 0.5,
        partition_state=state,
        standbys=rng.randint(0, 1) if state else 0,
        window_s=(1.0, 10.0),  # a group join, and a dead member's session, take seconds
    )


def draw_cases(seed: int, n: int, workloads: Sequence[Workload], vias: Sequence[str] = VIAS) -> list[Case]:
    """``n`` cases drawn from ``seed``: each case has a seed of its own, from this one."""
    rng = random.Random(seed)
    return [draw_case(rng.randrange(2**31), workloads, vias) for _ in range(n)]


@dataclass
class CaseResult:
    """A case and what came of it: its chaos report, or the error that stopped it."""

    case: Case
    report: ChaosReport | None = None
    error: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.report is not None and self.report.passed

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": asdict(self.case),
            "describe": self.case.describe(),
            "passed": self.passed,
            "report": self.report.to_dict() if self.report else None,
            "error": self.error,
            "seconds": round(self.seconds, 2),
        }


@dataclass
class _Campaign:
    results: list[CaseResult] = field(default_factory=list)

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        failed = [r for r in self.results if not r.passed]
        body = {
            "cases": len(self.results),
            "failed": len(failed),
            "failed_seeds": [r.case.seed for r in failed],
            "results": [r.to_dict() for r in self.results],
        }
        (out / "campaign.json").write_text(json.dumps(body, indent=1))
        lines = [
            "# Fault campaign",
            "",
            f"{len(self.results)} cases, {len(failed)} failed.",
            "",
            "| case | result | lost | duplicates | wrong values | recover s | seconds |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.results:
            rep = r.report
            cells = (
                [str(rep.lost), str(rep.duplicates), str(rep.wrong_values), _recovery(rep)]
                if rep
                else ["-", "-", "-", "-"]
            )
            verdict = "pass" if r.passed else ("FAIL" if rep else f"ERROR: {r.error.splitlines()[-1][:120]}")
            lines.append(
                f"| {r.case.describe()} | {verdict} | " + " | ".join(cells) + f" | {r.seconds:.0f} |"
            )
        (out / "campaign.md").write_text("\n".join(lines) + "\n")


def _recovery(report: ChaosReport) -> str:
    if not report.recover_s:
        return "-"
    ordered = sorted(report.recover_s)
    return f"median {ordered[len(ordered) // 2]:.2f}, max {ordered[-1]:.2f}"


def run_case(
    case: Case,
    workload: Workload,
    work: Path,
    *,
    rate: float = 4000,
    bootstrap: str = "",
    run_timeout_s: float = 300,
) -> CaseResult:
    """Run one case in ``work`` (emptied first by the scenario); a last run that has not ended
    after ``run_timeout_s`` (for an outage: after the outage began) makes the case an error (with
    the run's stacks in its log), and the campaign goes on. ``bootstrap``: a Kafka broker for
    kill cases (an outage case starts its own, which tells clients to go through the proxy)."""
    started = time.monotonic()
    extra: list[str] = []
    if case.partition_state:
        extra += ["--partition-state", case.partition_state, "--standby-replicas", str(case.standbys)]
    shape = ScenarioShape(partitions=case.partitions, group=case.group, transactional=case.transactional)
    try:
        if case.outage:
            report = outage_scenario(
                workload.pipeline, workload.data, via=case.via, down_s=case.down_s, after_s=case.after_s,
                rate=rate, key=workload.key, work=work, mode=case.outage, shape=shape, extra=extra,
                run_timeout_s=run_timeout_s,
            )  # fmt: skip
        else:
            report = kill_scenario(
                workload.pipeline, workload.data, via=case.via, kills=case.kills, seed=case.seed, rate=rate,
                key=workload.key, work=work, window_s=case.window_s, bootstrap=bootstrap, shape=shape,
                extra=extra, run_timeout_s=run_timeout_s,
            )  # fmt: skip
    except (AispError, OSError, ValueError, TimeoutError, subprocess.SubprocessError) as exc:
        return CaseResult(
            case, None, "".join(traceback.format_exception_only(exc)).strip(), time.monotonic() - started
        )
    return CaseResult(case, report, "", time.monotonic() - started)


def run_campaign(
    cases: Sequence[Case],
    workloads: Sequence[Workload],
    out: str | Path,
    *,
    rate: float = 4000,
    on_case: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Run ``cases`` one after another (each in ``out``/case-SEED), writing the report to ``out``
    after each; returns the results."""
    out = Path(out)
    by_name = {w.name: w for w in workloads}
    campaign = _Campaign()
    for case in cases:
        if case.workload not in by_name:
            raise ConfigError(
                f"case {case.seed} names workload {case.workload!r}, not one of {sorted(by_name)}"
            )
        result = run_case(case, by_name[case.workload], out / f"case-{case.seed}", rate=rate)
        campaign.results.append(result)
        campaign.write(out)
        if on_case is not None:
            on_case(result)
    return campaign.results
