"""Exactly-once results through `aisp run --checkpoint-dir`: SIGKILL at random moments, restart,
compare with an uninterrupted run (file source and file sink; brokers have their own tests)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.workload import write_events

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
EVENTS = 60_000


def aisp_run(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--input", str(data),
        "--output", str(out), "--dead-letter", str(out.with_suffix(".dl")), "--no-live", *extra,
    ]  # fmt: skip


def outputs(path: Path) -> list[dict[str, object]]:
    return sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda r: r["id"])  # type: ignore[arg-type, return-value]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]], int]:
    d = tmp_path_factory.mktemp("ref")
    data = d / "events.jsonl"
    write_events(data, EVENTS, seed=11, bad_every=499)
    out = d / "ref.jsonl"
    subprocess.run(aisp_run(data, out), env=ENV, check=True, capture_output=True)
    return data, outputs(out), len(out.with_suffix(".dl").read_text().splitlines())


def kill_and_restart(cmd: list[str], kills: int, seed: int, corrupt_latest: Path | None = None) -> int:
    """Run ``cmd``, SIGKILL it ``kills`` times at random moments, then let it finish; returns kills."""
    rng = random.Random(seed)
    done = 0
    while True:
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if done < kills:
            if corrupt_latest is not None and done == kills - 1:  # two checkpoints: one to fall back to
                deadline = time.monotonic() + 60
                while len(list(corrupt_latest.glob("chk-*"))) < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
            else:
                time.sleep(rng.uniform(0.8, 1.8))  # start-up takes 0.6-1 s
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
                done += 1
                if corrupt_latest is not None and done == kills:
                    newest = sorted(corrupt_latest.glob("chk-*"))[-1]
                    (newest / "manifest.json").write_text("{not json")
                continue
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        return done


STATE_LAYOUTS = {
    "state-in-checkpoints": [],
    "state-store": ["--state-store"],
    # about 45k users in the input: most keys are evicted and many read back from the store
    "state-store-bounded": ["--state-store", "--state-max-keys", "2000"],
}


@pytest.mark.parametrize("state", list(STATE_LAYOUTS))
def test_sigkill_at_random_moments_gives_exactly_once_outputs(
    tmp_path: Path, reference: tuple[Path, list[dict[str, object]], int], state: str
) -> None:
    data, expected, dead = reference
    out = tmp_path / "out.jsonl"
    cmd = aisp_run(data, out, "--checkpoint-dir", str(tmp_path / "chk"), "--checkpoint-interval-s", "0.25")
    cmd += STATE_LAYOUTS[state]
    cmd += ["--rate", "15000"]  # 4 s of input: most kills land mid-run
    assert kill_and_restart(cmd, kills=5, seed=1) >= 4
    assert outputs(out) == expected  # one line per valid input id, with the same state-dependent values
    assert len(out.with_suffix(".dl").read_text().splitlines()) == dead


def test_a_bounded_hot_layer_evicts_and_reads_state_back_with_the_same_results(
    tmp_path: Path, reference: tuple[Path, list[dict[str, object]], int]
) -> None:
    data, expected, _ = reference
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    cmd = aisp_run(data, out, "--checkpoint-dir", str(tmp_path / "chk"), "--checkpoint-interval-s", "0.1")
    cmd += [*STATE_LAYOUTS["state-store-bounded"], "--rate", "30000", "--summary-json", str(summary)]
    subprocess.run(cmd, env=ENV, check=True, capture_output=True)
    assert outputs(out) == expected
    state = json.loads(summary.read_text())["state"]["by_user"]
    assert state["evicted"] > 20_000 and state["reloaded"] > 1_000, state
    # the bound plus the keys seen since the last checkpoint (never evicted), far below ~45k users
    assert state["keys"] < 12_000, state
    newest = sorted((tmp_path / "chk").glob("chk-*"))[-1]
    assert not list(newest.glob("keys.*")), "keys in the checkpoint files: the state store holds them"


@pytest.mark.parametrize("state", list(STATE_LAYOUTS))
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, reference: tuple[Path, list[dict[str, object]], int], state: str
) -> None:
    data, expected, _ = reference
    out = tmp_path / "out.jsonl"
    chk = tmp_path / "chk"
    cmd = aisp_run(
        data, out, "--checkpoint-dir", str(chk), "--checkpoint-interval-s", "0.25", "--rate", "30000"
    )
    cmd += STATE_LAYOUTS[state]
    kill_and_restart(cmd, kills=1, seed=2, corrupt_latest=chk)
    assert outputs(out) == expected


def redis_client() -> object:
    import redis

    r = redis.Redis(host="127.0.0.1", port=6379)
    try:
        r.ping()
    except redis.ConnectionError as exc:
        pytest.fail(f"Redis is not reachable at 127.0.0.1:6379 ({exc}); start it (see DESIGN.md)")
    return r


def fill_stream(r: Any, stream: str, lines: list[bytes]) -> None:
    pipe = r.pipeline(transaction=False)
    for line in lines:
        pipe.xadd(stream, {"data": line})
    pipe.execute()


def drop_streams(r: Any, src: str, dst: str) -> None:
    """Delete the test's streams and the output's idempotency keys."""
    r.delete(src, dst)
    keys = list(r.scan_iter(f"aisp:dedupe:{dst}:*", count=10_000))
    for i in range(0, len(keys), 1000):
        r.delete(*keys[i : i + 1000])


def test_a_broker_that_stays_away_fails_the_run_clearly(
    tmp_path: Path, reference: tuple[Path, list[dict[str, object]], int]
) -> None:
    import uuid

    from aisp.faults import FaultProxy

    data, _, _ = reference
    r: Any = redis_client()
    name = uuid.uuid4().hex[:8]
    src, dst = f"aisp-test-in-{name}", f"aisp-test-out-{name}"
    fill_stream(r, src, data.read_bytes().splitlines()[:1000])
    try:
        with FaultProxy(("127.0.0.1", 6379)) as proxy:
            proxy.set(refuse=True)
            via = f"redis://127.0.0.1:{proxy.port}"
            cmd = [
                sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--no-live",
                "--input", f"{via}/{src}?group=g-{name}&idle_stop_s=1&retry_s=1", "--output", f"{via}/{dst}",
            ]  # fmt: skip
            started = time.monotonic()
            res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=60)
            assert res.returncode != 0 and "unreachable for 1 s" in res.stderr
            assert time.monotonic() - started < 30  # not a hang
    finally:
        drop_streams(r, src, dst)


def test_dead_letters_to_a_redis_stream_once_each_across_sigkills(
    tmp_path: Path, reference: tuple[Path, list[dict[str, object]], int]
) -> None:
    import uuid

    data, expected, dead = reference
    r: Any = redis_client()
    stream = f"aisp-test-dl-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "out.jsonl"
    cmd = aisp_run(data, out, "--checkpoint-dir", str(tmp_path / "chk"), "--checkpoint-interval-s", "0.25")
    cmd[cmd.index("--dead-letter") + 1] = f"redis://127.0.0.1:6379/{stream}"
    try:
        assert kill_and_restart([*cmd, "--rate", "20000"], kills=3, seed=9) >= 2
        records = [json.loads(f[b"data"]) for _, f in r.xrange(stream)]
        assert len(records) == dead == len({rec["line"] for rec in records})  # each bad line once
        assert all(rec["step"] == "events" and rec["reason"] for rec in records)
        assert outputs(out) == expected
    finally:
        drop_streams(r, stream, stream)
        keys = list(r.scan_iter(f"aisp:dedupe:{stream}:*", count=10_000))
        if keys:
            r.delete(*keys)
