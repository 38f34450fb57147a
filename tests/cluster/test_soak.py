"""``make soak``'s verdicts over sampled series (the soak itself runs for an hour: ``make soak``).
Series are drawn from a seed printed here (AISP_TEST_SEED replays it)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from tests.cluster.soak import verdicts

SEED = int(os.environ.get("AISP_TEST_SEED") or random.randrange(2**31))


def _samples(
    rng: random.Random, minutes: int, slopes: dict[str, float], p99: tuple[float, float]
) -> list[Any]:
    """One sample every 10 s: each process's RSS grows by its slope (MB/h) plus noise, the p99
    goes from ``p99[0]`` to ``p99[1]`` over the run; fds and threads stay put."""
    out = []
    for i in range(minutes * 6 + 1):
        t = i * 10.0
        procs = {
            name: {"rss_mb": 150 + slope * t / 3600 + rng.uniform(-0.2, 0.2), "fds": 40, "threads": 20}
            for name, slope in slopes.items()
        }
        p = p99[0] + (p99[1] - p99[0]) * t / (minutes * 60)
        out.append({"t_s": t, "p99_ms": p * rng.uniform(0.97, 1.03), "procs": procs})
    return out


@pytest.mark.parametrize("draw", range(3))
def test_the_broker_s_growth_is_reported_but_only_the_workers_are_judged(draw: int) -> None:
    rng = random.Random(SEED + draw)
    broker = rng.uniform(50, 5000)  # Tansu keeps every record: MB/h
    print(f"seed {SEED} (AISP_TEST_SEED={SEED} replays it): broker {broker:.0f} MB/h")
    minutes = rng.randint(30, 90)
    flat = _samples(rng, minutes, {"w0": 0.0, "w1": 1.0, "tansu": broker}, (80, 85))
    report = verdicts(flat, [], 0, 0, 10_000, 1_000)
    assert report["ok"], report
    assert report["rss_slope_mb_per_h"]["tansu#1"] == pytest.approx(broker, rel=0.05)
    leaking = _samples(rng, minutes, {"w0": rng.uniform(15, 50), "w1": 0.0, "tansu": broker}, (80, 85))
    assert not verdicts(leaking, [], 0, 0, 10_000, 1_000)["ok"]


def test_a_lost_or_doubled_event_or_a_p99_that_grew_fails_the_soak() -> None:
    rng = random.Random(SEED)
    steady = _samples(rng, 60, {"w0": 0.0, "w1": 0.0}, (80, 85))
    assert verdicts(steady, [], 0, 0, 10_000, 1_000)["ok"]
    assert not verdicts(steady, [], 1, 0, 10_000, 1_000)["ok"]
    assert not verdicts(steady, [], 0, 1, 10_000, 1_000)["ok"]
    growing = _samples(rng, 60, {"w0": 0.0, "w1": 0.0}, (80, 140))
    report = verdicts(growing, [], 0, 0, 10_000, 1_000)
    assert not report["ok"] and report["p99_ms_last_10_min"] > 1.2 * report["p99_ms_first_10_min"]


@pytest.mark.parametrize("draw", range(3))
def test_a_step_at_a_takeover_is_not_a_leak_but_a_climb_between_takeovers_is(draw: int) -> None:
    """The survivor of a kill holds the victim's partitions for a while and its RSS steps up (its
    allocator keeps the memory); that is not a leak. A climb within the stretches between kills
    is, whatever the steps."""
    rng = random.Random(SEED + 10 + draw)
    kill_every = rng.choice([600, 900, 1200])  # the soak's: 600
    minutes = rng.randint(40, 90)
    kills = [{"at_s": float(t), "worker": "w0"} for t in range(kill_every, minutes * 60, kill_every)]
    steps = {k["at_s"]: rng.uniform(10, 80) for k in kills}  # MB added 30-90 s after each kill
    leak = rng.uniform(15, 40)  # MB/h
    print(f"seed {SEED} (AISP_TEST_SEED={SEED} replays it): kills every {kill_every} s, leak {leak:.0f} MB/h")

    def rss(t: float, climb: float) -> float:
        return 160 + sum(v for at, v in steps.items() if t >= at + 60) + climb * t / 3600

    samples = []
    for i in range(minutes * 6 + 1):
        t = i * 10.0
        procs = {
            "w1": {"rss_mb": rss(t, 0.0) + rng.uniform(-0.2, 0.2), "fds": 40, "threads": 20},
            "w2": {"rss_mb": rss(t, leak) + rng.uniform(-0.2, 0.2), "fds": 40, "threads": 20},
        }
        samples.append({"t_s": t, "p99_ms": 80.0, "procs": procs})
    report = verdicts(samples, kills, 0, 0, 10_000, 1_000)
    slopes = report["rss_slope_mb_per_h"]
    assert abs(slopes["w1#1"]) < 5 and slopes["w2#1"] == pytest.approx(leak, abs=5), report
    assert report["workers_rss_slope_mb_per_h"] == pytest.approx(leak / 2, abs=3)  # the two pooled
    assert report["rss_whole_life_slope_mb_per_h"]["w1#1"] > 5  # the steps, seen over the whole life
    assert not report["ok"]
    for sample in samples:
        sample["procs"].pop("w2", None)
    assert verdicts(samples, kills, 0, 0, 10_000, 1_000)["ok"]


def test_a_finished_soak_is_judged_again_from_its_report(tmp_path: Any) -> None:
    import json

    from tests.cluster.soak import judge_again

    rng = random.Random(SEED)
    samples = _samples(rng, 20, {"w0": 0.0, "w1": 0.0}, (80, 85))
    for s in samples:
        s.update(p50_ms=40.0, lag=0, checkpoint_s={"w0": 0.01})
        for proc in s["procs"].values():
            proc["cpu"] = 0.1
    old = {"lost": 0, "duplicated": 2, "capacity_events_per_s": 9000, "rate_events_per_s": 1000, "ok": True}
    path = tmp_path / "report.json"
    path.write_text(json.dumps({**old, "samples": samples, "kills": []}))
    assert judge_again(path) == 1  # two events doubled: not ok, whatever the report said
    again = json.loads(path.read_text())
    assert again["ok"] is False and again["duplicated"] == 2 and len(again["samples"]) == len(samples)
    assert (tmp_path / "rss_mb.png").stat().st_size > 0
