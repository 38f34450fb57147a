"""`aisp run --workers N`: the fraud example on several worker processes, checked against plain
Python (outputs and dead letters), across SIGKILLs, and refusing what it cannot do."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from benchmarks.workload import parse_valid, reference_outputs, write_events
from tests.support.hostile import event_line, mixed_lines

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
MODEL = ROOT / "examples" / "fraud" / "model.onnx"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def aisp_run(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--input", str(data),
        "--output", str(out), "--dead-letter", str(out.with_suffix(".dl")), "--no-live", *extra,
    ]  # fmt: skip


def held_out_lines() -> list[bytes]:
    """Hot keys, planted bad lines of many kinds, unusual valid lines and edge-case values."""
    rng = random.Random(5)
    lines = mixed_lines(4000, bad_every=9, seed=3)  # 97 users, hostile lines, odd valid shapes
    for i in range(4000, 7000):
        user = "hot" if rng.random() < 0.4 else rng.choice(["", "ü—😀", 'q"\\', f"u{rng.randrange(3000)}"])
        amount = rng.choice([0.0, -0.0, 1e-300, 1e30, -5.5, 123456789.125, 3.0])
        lines.append(event_line(i, user=user).replace(b'"amount":', f'"amount":{amount!r},"a0":'.encode(), 1))
    rng.shuffle(lines)
    return lines


@pytest.fixture(scope="module")
def held_out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, object]]]:
    d = tmp_path_factory.mktemp("held_out")
    data = d / "events.jsonl"
    lines = held_out_lines()
    data.write_bytes(b"\n".join(lines))  # the last line has no newline
    return data, reference_outputs(data, MODEL)


def check_against_reference(out: Path, lines: list[bytes], expected: dict[int, dict[str, object]]) -> None:
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an event was written twice"
    assert set(ids) == set(expected)
    for r in rows:
        e = expected[r["id"]]
        assert (r["user"], r["n"], r["mean_amount"], r["alert"]) == (
            e["user"],
            e["n"],
            e["mean_amount"],
            e["alert"],
        )
        assert abs(r["score"] - e["score"]) <= 1e-5  # type: ignore[operator]
    dead = [json.loads(x) for x in out.with_suffix(".dl").read_text().splitlines()]
    invalid = {i + 1 for i, line in enumerate(lines) if parse_valid(line) is None}
    assert sorted(d["line"] for d in dead) == sorted(invalid)
    for d in dead:
        assert d["step"] == "events" and d["reason"]
        assert d["raw"] == lines[d["line"] - 1].decode("utf-8", "replace")


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_held_out_set_matches_plain_python_with_n_workers(
    tmp_path: Path, held_out: tuple[Path, dict[int, dict[str, object]]], workers: int
) -> None:
    data, expected = held_out
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    # small batches: the file is cut into many blocks, so rows of each key cross between workers
    cmd = aisp_run(data, out, "--workers", str(workers), "--batch-rows", "64", "--summary-json", str(summary))
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    check_against_reference(out, data.read_bytes().split(b"\n"), expected)
    s = json.loads(summary.read_text())
    assert s["events_in"] == 7000 == s["events_out"] + s["dead_letters"]
    assert s["events_out"] == len(expected)


def test_a_keyless_pipeline_spreads_blocks_and_writes_each_row_once(tmp_path: Path) -> None:
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    data.write_bytes(b"\n".join(event_line(i) for i in range(5000)) + b"\n")
    pipeline = tmp_path / "keyless.py"
    pipeline.write_text(
        "import msgspec\n"
        "from aisp import NullSink, Pipeline, JsonlFileSource\n"
        "class Ev(msgspec.Struct):\n    id: int\n    amount: float\n"
        "def build():\n"
        "    p = Pipeline('keyless')\n"
        "    s = p.source('events', JsonlFileSource(path='-', schema=Ev), schema=Ev)\n"
        "    twice = lambda b: b.with_columns({'twice': b.numpy('amount') * 2})\n"
        "    s.map_batch('double', twice).sink('out', NullSink())\n"
        "    return p\n"
    )
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(pipeline), "--input", str(data), "--output", str(out)]
    res = subprocess.run(
        [*cmd, "--workers", "2", "--batch-rows", "100", "--no-live"],
        env=ENV, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(5000))
    assert all(r["twice"] == 2 * r["amount"] for r in rows)


@pytest.fixture(scope="module")
def kill_reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[dict[str, object]], list[str]]:
    d = tmp_path_factory.mktemp("kill_ref")
    data = d / "events.jsonl"
    write_events(data, 60_000, seed=11, bad_every=499)
    out = d / "ref.jsonl"
    subprocess.run(aisp_run(data, out), env=ENV, check=True, capture_output=True)  # one process
    return data, sorted_rows(out), sorted(out.with_suffix(".dl").read_text().splitlines())


def sorted_rows(path: Path) -> list[dict[str, object]]:
    return sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda r: r["id"])  # type: ignore[arg-type, return-value]


def test_sigkill_with_two_workers_gives_exactly_once_outputs(
    tmp_path: Path, kill_reference: tuple[Path, list[dict[str, object]], list[str]]
) -> None:
    data, expected, dead = kill_reference
    out = tmp_path / "out.jsonl"
    cmd = aisp_run(data, out, "--workers", "2", "--checkpoint-dir", str(tmp_path / "chk"))
    cmd += ["--checkpoint-interval-s", "0.25", "--rate", "15000"]  # 4 s of input: kills land mid-run
    rng, kills = random.Random(3), 0
    while True:
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if kills < 4:
            time.sleep(rng.uniform(1.0, 2.0))  # start-up takes 0.8-1 s
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)  # the coordinator; its workers die with it
                proc.communicate()
                kills += 1
                continue
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        break
    assert kills >= 3
    assert sorted_rows(out) == expected  # each output once, with the same state-dependent values
    assert sorted(out.with_suffix(".dl").read_text().splitlines()) == dead


def test_a_worker_that_dies_fails_the_run_clearly(tmp_path: Path) -> None:
    data = tmp_path / "events.jsonl"
    write_events(data, 200_000, seed=1)
    cmd = aisp_run(data, tmp_path / "out.jsonl", "--workers", "2", "--rate", "20000")
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    workers: list[int] = []
    while not workers and time.monotonic() < deadline:
        time.sleep(0.2)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        workers = [int(x) for x in children.read_text().split()] if children.exists() else []
    assert workers, "no worker process appeared"
    time.sleep(0.5)
    os.kill(workers[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "worker" in err.decode() and "exited" in err.decode()


def test_metrics_and_the_dashboard_sum_the_workers(tmp_path: Path) -> None:
    data, out = tmp_path / "events.jsonl", tmp_path / "out.jsonl"
    write_events(data, 36_000, seed=2)
    # paced to last ~12 s: the metrics and the dashboard are read while it runs (they go with it;
    # on a starved machine one read can take seconds)
    cmd = aisp_run(data, out, "--workers", "2", "--rate", "3000", "--metrics-port", "0", "--dashboard")
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = ""
        for line in proc.stderr:
            if line.startswith("metrics http://"):
                url = line.split()[1].removesuffix("/metrics")
                break
        assert url, "no metrics address announced"
        by_worker: dict[str, float] = {}
        state: dict[str, Any] = {}
        while len(by_worker) < 2 or not state.get("events_out"):
            time.sleep(0.5)  # both read in one round, while the run is on
            assert proc.poll() is None, "the run ended before both workers' numbers were read"
            state = json.loads(urllib.request.urlopen(f"{url}/dashboard/state?history=1", timeout=30).read())
            text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
            by_worker = {
                m.group(1): float(m.group(2))
                for m in re.finditer(r'aisp_worker_events_total\{direction="out",worker="(\d)"\} (\S+)', text)
                if float(m.group(2)) > 0
            }
        assert set(by_worker) == {"0", "1"}, "each worker's events are shown"
        total = re.search(r'aisp_events_total\{direction="out"\} (\S+)', text)
        assert total is not None and float(total.group(1)) >= sum(by_worker.values()) > 0
        assert state["events_out"] > 0 and [s["id"] for s in state["stages"]][0] == "events"
        proc.communicate(timeout=120)
    finally:  # a failed assertion must not leave the run behind
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0
    assert len(out.read_text().splitlines()) == 36_000


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--trace-sample", "0.1"], "--trace-sample cannot be combined with --workers"),
        (["--state-store", "--checkpoint-dir", "CHK"], "--state-store cannot be combined"),
    ],
)
def test_what_workers_cannot_do_yet_is_refused_clearly(tmp_path: Path, extra: list[str], reason: str) -> None:
    data = tmp_path / "in.jsonl"
    data.write_bytes(event_line(1) + b"\n")
    extra = [str(tmp_path / "chk") if x == "CHK" else x for x in extra]
    res = subprocess.run(
        aisp_run(data, tmp_path / "out.jsonl", "--workers", "2", *extra),
        env=ENV, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 2
    assert reason in " ".join(res.stderr.split())


def test_generated_events_are_split_by_range_with_the_same_results(tmp_path: Path) -> None:
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "aisp.cli",
            "run",
            str(PIPELINE),
            "--events",
            "30000",
            "--output",
            str(out),
        ]
        res = subprocess.run(
            [*cmd, "--workers", str(workers), "--no-live"],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        outs[workers] = sorted_rows(out)
    assert len(outs[1]) == 30_000
    assert [(r["id"], r["n"], r["mean_amount"], r["alert"]) for r in outs[2]] == [
        (r["id"], r["n"], r["mean_amount"], r["alert"]) for r in outs[1]
    ]


def test_a_source_that_cannot_be_split_is_refused_with_the_reason(tmp_path: Path) -> None:
    pipeline = tmp_path / "unsplit.py"
    pipeline.write_text(
        "from aisp import Batch, NullSink, Pipeline\n"
        "from aisp.ingest.base import Source, SourcePartition\n"
        "class Once(SourcePartition):\n"
        "    def next_batch(self, max_rows):\n"
        "        return None\n"
        "class Mine(Source):\n"
        "    def open(self, ctx, resume_from=None):\n"
        "        return Once()\n"
        "def build():\n"
        "    p = Pipeline('unsplit')\n"
        "    p.source('events', Mine()).sink('out', NullSink())\n"
        "    return p\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "aisp.cli", "run", str(pipeline), "--workers", "2", "--no-live"],
        env=ENV, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 2
    assert "needs one source that can be split" in " ".join(res.stderr.split())


def test_a_checkpoint_restarts_only_with_the_same_number_of_workers(tmp_path: Path) -> None:
    data, out, chk = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "chk"
    data.write_bytes(b"\n".join(event_line(i) for i in range(300)) + b"\n")
    first = aisp_run(data, out, "--workers", "2", "--checkpoint-dir", str(chk))
    subprocess.run(first, env=ENV, check=True, capture_output=True, timeout=60)
    res = subprocess.run(
        aisp_run(data, out, "--checkpoint-dir", str(chk)),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2
    assert "taken with --workers 2" in " ".join(res.stderr.split())
