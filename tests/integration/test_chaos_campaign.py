"""The fault campaign's short form: the Kafka case that once lost exactly-once (three partitions
keyed by user, plain output, the default group, repeated kills while the killed process is
still a member of the group), and cases drawn from a seed printed here (set AISP_CAMPAIGN_SEED
to replay one): kills through Kafka, kills through a file, Redis or NATS, and a broker outage of
a drawn kind, length and moment. ``make chaos-campaign`` runs 50 drawn cases."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from aisp.faults.campaign import Case, CaseResult, Workload, draw_case, run_case
from benchmarks.workload import load_example, write_events

ROOT = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("AISP_CAMPAIGN_SEED") or random.randrange(2**31))


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> list[Workload]:
    here = tmp_path_factory.mktemp("campaign")
    write_events(here / "fraud.jsonl", 20_000, seed=21, bad_every=331)
    events = load_example("windows/events.py", "aisp_example_window_events").make_events(12_000, seed=5)
    (here / "windows.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return [
        Workload(
            name="fraud", pipeline=str(ROOT / "examples/fraud/pipeline.py"), data=str(here / "fraud.jsonl")
        ),
        Workload(
            name="windows",
            pipeline=str(ROOT / "examples/windows/pipeline.py"),
            data=str(here / "windows.jsonl"),
            key="user,window_start",
            partitioned=False,
        ),
    ]


def _check(result: CaseResult) -> None:
    assert result.passed, f"{result.case.describe()}: {result.report or result.error}"
    report = result.report
    assert report is not None and report.faults >= 1 and len(report.recover_s) >= report.faults - 1


def test_kafka_three_partitions_plain_output_repeated_kills_exactly_once(
    workloads: list[Workload], tmp_path: Path
) -> None:
    case = Case(
        seed=271041745, workload="fraud", via="kafka", kills=4, partitions=3, group=False,
        transactional=False, window_s=(1.0, 10.0),
    )  # fmt: skip
    _check(run_case(case, workloads[0], tmp_path))


@pytest.mark.parametrize(
    ("vias", "outage_share"),
    # the drawn Kafka kill case in `make chaos` (the fixed one above runs here): the fast suite's time
    [
        pytest.param(("kafka",), 0.0, marks=pytest.mark.slow),
        (("file", "redis", "nats"), 0.0),
        (("redis", "nats", "kafka"), 1.0),
    ],
    ids=["kafka", "other", "outage"],
)
def test_a_case_drawn_from_the_printed_seed_holds(
    workloads: list[Workload], tmp_path: Path, vias: tuple[str, ...], outage_share: float
) -> None:
    case = draw_case(SEED + len(vias) + 7 * int(outage_share), workloads, vias, outage_share=outage_share)
    print(f"campaign seed {SEED} (AISP_CAMPAIGN_SEED={SEED} replays it): {case.describe()}")
    _check(run_case(case, {w.name: w for w in workloads}[case.workload], tmp_path))
