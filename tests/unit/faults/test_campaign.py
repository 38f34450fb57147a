"""The fault campaign's draw (deterministic, every case in range, every shape reachable) and its
report; the scenarios themselves run in tests/integration/test_chaos_campaign.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from aisp.faults.campaign import OUTAGES, CaseResult, Workload, _Campaign, draw_case, draw_cases
from aisp.faults.chaos import ChaosReport, _wait_or_dump

LOADS = [
    Workload(name="fraud", pipeline="p.py", data="d.jsonl"),
    Workload(name="windows", pipeline="w.py", data="w.jsonl", key="user,window_start", partitioned=False),
]


@given(st.integers(0, 2**31 - 1))
def test_a_seed_always_draws_the_same_case_and_every_case_is_in_range(seed: int) -> None:
    case = draw_case(seed, LOADS)
    assert case == draw_case(seed, LOADS)
    assert 1 <= case.partitions <= 8
    assert case.via in ("file", "redis", "nats", "kafka")
    if case.outage:  # through a broker only, instead of kills
        assert case.via != "file" and case.kills == 0 and case.outage in OUTAGES
        assert 1.0 <= case.down_s <= 20.0 and 0.0 <= case.after_s <= 2.0
        assert f"{case.outage} outage of {case.down_s:g} s" in case.describe()
    else:
        assert 1 <= case.kills <= 8 and (case.down_s, case.after_s) == (0.0, 0.0)
        assert f"{case.kills} kills" in case.describe()
    if case.via != "kafka":  # one ordered input, no transactions, no changelog topics
        assert (case.partitions, case.partition_state, case.standbys) == (1, "", 0)
    if case.workload == "windows":  # event time over several partitions depends on interleaving
        assert case.partitions == 1
    assert case.standbys == 0 or case.partition_state == "changelog"
    assert str(case.seed) in case.describe()


def test_a_campaign_reaches_every_shape() -> None:
    cases = draw_cases(3, 400, LOADS)
    assert {c.via for c in cases} == {"file", "redis", "nats", "kafka"}
    kafka = [c for c in cases if c.via == "kafka"]
    assert {c.partitions for c in kafka} == set(range(1, 9))
    assert {c.kills for c in cases if not c.outage} == set(range(1, 9))
    outages = [c for c in cases if c.outage]
    assert {c.via for c in outages} == {"redis", "nats", "kafka"} and {c.outage for c in outages} == set(
        OUTAGES
    )
    assert min(c.down_s for c in outages) < 3 and max(c.down_s for c in outages) > 15
    assert 0.15 < len(outages) / sum(c.via != "file" for c in cases) < 0.35
    assert {(c.group, c.transactional, c.partition_state, c.standbys) for c in kafka} >= {
        (True, True, "", 0),
        (False, False, "", 0),
        (True, False, "changelog", 1),
        (False, True, "changelog", 0),
    }
    assert len({c.seed for c in cases}) == len(cases)
    assert draw_cases(3, 400, LOADS) == cases and draw_cases(4, 400, LOADS) != cases


def test_the_report_names_each_case_its_seed_and_what_failed(tmp_path: Path) -> None:
    ok, bad = draw_cases(11, 2, LOADS)
    campaign = _Campaign(
        [
            CaseResult(ok, ChaosReport("kill", ok.via, 10, 10, 0, 0, 0, 2, [1.5, 2.5]), seconds=3.0),
            CaseResult(bad, ChaosReport("kill", bad.via, 10, 12, 0, 2, 1, 3, [1.0]), seconds=4.0),
        ]
    )
    campaign.write(tmp_path)
    body = json.loads((tmp_path / "campaign.json").read_text())
    assert (body["cases"], body["failed"], body["failed_seeds"]) == (2, 1, [bad.seed])
    md = (tmp_path / "campaign.md").read_text()
    assert ok.describe() in md and "FAIL" in md and "median 2.50, max 2.50" in md


def test_a_run_that_does_not_end_is_killed_after_its_stacks_are_dumped(tmp_path: Path) -> None:
    hangs = (
        "import faulthandler, signal, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    log = tmp_path / "run.log"
    with log.open("wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", hangs], stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    started = time.monotonic()
    assert _wait_or_dump(proc, 0.3) == -9
    assert time.monotonic() - started < 30 and proc.poll() is not None
    assert "Current thread" in log.read_text() or "Thread 0x" in log.read_text()
    proc.stdout.close()
