"""The fraud example end to end through the real CLI, checked row by row against plain Python."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.workload import reference_outputs, write_events

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
MODEL = ROOT / "examples" / "fraud" / "model.onnx"


ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def fraud_cmd(src: Path, output: str, *extra: str) -> list[str]:
    """``aisp run`` on the fraud example, as a command line."""
    return [
        sys.executable,
        "-m",
        "aisp.cli",
        "run",
        str(PIPELINE),
        "--input",
        str(src),
        "--output",
        output,
        *extra,
    ]


def aisp(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "aisp.cli", *args]
    env = ENV
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False, **kw)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def run_with_bad_lines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fraud")
    paths = {k: d / f"{k}.jsonl" for k in ("in", "out", "dl")}
    paths["summary"] = d / "s.json"
    write_events(paths["in"], 20_000, seed=7, bad_every=97)
    res = aisp(
        "run",
        str(PIPELINE),
        "--input",
        str(paths["in"]),
        "--output",
        str(paths["out"]),
        "--dead-letter",
        str(paths["dl"]),
        "--summary-json",
        str(paths["summary"]),
        "--no-live",
    )
    assert res.returncode == 0, res.stderr
    return paths


def test_every_valid_event_scored_once_and_matches_reference(run_with_bad_lines: dict[str, Path]) -> None:
    expected = reference_outputs(run_with_bad_lines["in"], MODEL)
    rows = [json.loads(line) for line in run_with_bad_lines["out"].read_text().splitlines()]
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an event was written twice"
    assert set(ids) == set(expected), "outputs differ from the valid inputs"
    for r in rows:
        e = expected[r["id"]]
        assert set(r) == {"id", "user", "score", "alert", "n", "mean_amount"}
        assert r["user"] == e["user"]
        assert r["n"] == e["n"]
        assert r["mean_amount"] == e["mean_amount"]
        assert abs(r["score"] - e["score"]) <= 1e-5
        assert r["alert"] == (r["score"] > 0.9)


def test_bad_lines_dead_lettered_with_line_and_reason(run_with_bad_lines: dict[str, Path]) -> None:
    lines = run_with_bad_lines["in"].read_bytes().split(b"\n")
    dead = [json.loads(x) for x in run_with_bad_lines["dl"].read_text().splitlines()]
    assert dead, "no dead letters for planted bad lines"
    expected = reference_outputs(run_with_bad_lines["in"], MODEL)
    n_lines = sum(1 for x in lines if x)
    assert len(dead) == n_lines - len(expected)
    for d in dead:
        assert d["step"] == "events" and d["reason"]
        assert d["raw"] == lines[d["line"] - 1].decode()


def test_summary_has_contract_fields(run_with_bad_lines: dict[str, Path]) -> None:
    s = json.loads(run_with_bad_lines["summary"].read_text())
    expected = reference_outputs(run_with_bad_lines["in"], MODEL)
    assert s["events_out"] == len(expected)
    assert s["dead_letters"] > 0
    assert s["events_in"] == s["events_out"] + s["dead_letters"] == 20_000
    for key in ("seconds", "events_per_s"):
        assert s[key] > 0
    assert set(s["latency_ms"]) >= {"p50", "p99", "p999", "max"}
    assert 0 < s["latency_ms"]["p50"] <= s["latency_ms"]["p99"] <= s["latency_ms"]["max"]
    assert s["stopped_early"] is False  # read to the end, not stopped by a signal


def test_topology_prints_dag_and_bound() -> None:
    res = aisp("topology", str(PIPELINE))
    assert res.returncode == 0, res.stderr
    for step in ("events", "by_user", "user_stats", "features", "score", "emit", "out"):
        assert step in res.stdout
    assert "static end-to-end latency bound:" in res.stdout


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_signal_mid_run_drains_cleanly(tmp_path: Path, how: str) -> None:
    """SIGTERM to the process, or SIGINT to its whole process group as a terminal's Ctrl-C does."""
    src, out, summary = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "s.json"
    write_events(src, 200_000, seed=3)
    cmd = fraud_cmd(src, str(out), "--summary-json", str(summary), "--rate", "20000", "--no-live")
    proc = subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or out.stat().st_size < 200_000):
        time.sleep(0.05)
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    s = json.loads(summary.read_text())
    rows = out.read_text().splitlines()
    assert s["stopped_early"] is True
    assert 0 < s["events_in"] < 200_000
    assert len(rows) == s["events_out"] == s["events_in"], "an accepted event was lost in the drain"
    ids = [json.loads(r)["id"] for r in rows]
    assert len(set(ids)) == len(ids)


def test_memory_stays_bounded_on_a_large_file(tmp_path: Path) -> None:
    """The file is streamed, never loaded whole: the process tree stays far below the file size."""
    from benchmarks.bench_fraud import run_tree

    src = tmp_path / "in.jsonl"
    write_events(src, 400_000, seed=5)
    cmd = fraud_cmd(src, "null:", "--no-live")
    _, peak_mb, _ = run_tree(cmd)
    assert src.stat().st_size > 70 * 2**20
    assert peak_mb < 400, f"peak RSS of the process tree {peak_mb:.0f} MB"


@pytest.mark.parametrize("workers", [1, 2])
def test_new_model_version_mid_run_every_event_once_tagged(tmp_path: Path, workers: int) -> None:
    """A second version copied into the repository mid-run is picked up with nothing lost (by
    every worker)."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "examples" / "fraud" / "repository", repo)
    src, out, dl, summary = (tmp_path / n for n in ("in.jsonl", "out.jsonl", "dl.jsonl", "s.json"))
    write_events(src, 60_000, seed=11)
    cmd = fraud_cmd(src, str(out), "--dead-letter", str(dl), "--summary-json", str(summary), "--no-live")
    cmd += ["--model-repository", str(repo), "--repository-poll-s", "0.1", "--rate", "20000"]
    cmd += ["--workers", str(workers)]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not out.exists() or out.stat().st_size < 500_000):
        time.sleep(0.05)
    staged = repo / "fraud" / ".staging"
    staged.mkdir()
    shutil.copy(repo / "fraud" / "1" / "model.onnx", staged / "model.onnx")
    staged.rename(repo / "fraud" / "2")  # appears atomically, as a deploy would do it
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    rows = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["id"])
    ids = [r["id"] for r in rows]
    assert ids == list(range(60_000)), "an event was lost or written twice"
    versions = {r["model_version"] for r in rows}
    assert versions == {"1", "2"}
    assert all(r["model"] == "fraud" for r in rows)
    assert [r["model_version"] for r in rows[-100:]] == ["2"] * 100
    s = json.loads(summary.read_text())
    assert s["dead_letters"] == 0 and s["models"]["score"]["swaps"] == workers  # once in each
    assert not dl.read_text()
