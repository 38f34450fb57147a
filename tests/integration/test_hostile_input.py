"""Hostile lines mixed into workload F, through the real ``aisp run``: the run finishes, every
valid event comes out once with the reference's values, every other line is a dead letter with
its line number and a reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.workload import parse_valid, reference_outputs
from tests.support.hostile import HOSTILE_LINES, event_line, mixed_lines

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
MODEL = ROOT / "examples" / "fraud" / "model.onnx"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def run(src: Path, tmp: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Path]]:
    paths = {"out": tmp / "out.jsonl", "dl": tmp / "dl.jsonl", "summary": tmp / "s.json"}
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--input", str(src)]
    cmd += ["--output", str(paths["out"]), "--dead-letter", str(paths["dl"])]
    cmd += ["--summary-json", str(paths["summary"]), "--no-live", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300, check=False)
    return res, paths


def check_run(lines: list[bytes], src: Path, tmp: Path, *extra: str) -> dict[str, object]:
    res, paths = run(src, tmp, *extra)
    assert res.returncode == 0, res.stderr
    valid = {n: ev for n, line in enumerate(lines, 1) if (ev := parse_valid(line)) is not None}
    outputs = [json.loads(x) for x in paths["out"].read_text().splitlines()]
    assert sorted(o["id"] for o in outputs) == sorted(ev["id"] for ev in valid.values())
    reference = reference_outputs(src, MODEL)
    by_id = {o["id"]: o for o in outputs}
    for event_id, want in reference.items():
        got = by_id[event_id]
        assert (got["user"], got["n"]) == (want["user"], want["n"])
        assert got["mean_amount"] == pytest.approx(want["mean_amount"])
        assert got["score"] == pytest.approx(want["score"], rel=1e-5, abs=1e-6)
    dead = [json.loads(x) for x in paths["dl"].read_text().splitlines()]
    assert sorted(d["line"] for d in dead) == [n for n in range(1, len(lines) + 1) if n not in valid]
    assert all(d["reason"] and d["step"] == "events" for d in dead)
    summary = json.loads(paths["summary"].read_text())
    assert summary["events_in"] == len(lines)
    assert summary["events_out"] == len(valid) and summary["dead_letters"] == len(lines) - len(valid)
    return summary


def test_every_kind_of_hostile_line_alone_in_its_batch(tmp_path: Path) -> None:
    """Batches of one line: each corpus entry is a whole batch (as a final one can be)."""
    lines = []
    for n, line in enumerate(HOSTILE_LINES.values()):
        lines += [event_line(3 * n), event_line(3 * n + 1), event_line(3 * n + 2), line]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    check_run(lines, src, tmp_path, "--batch-rows", "1")


def test_a_file_ending_in_two_newlines(tmp_path: Path) -> None:
    lines = mixed_lines(512, bad_every=10**9)
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n\n")
    check_run([*lines, b""], src, tmp_path)


def test_hostile_lines_mixed_into_workload_f(tmp_path: Path) -> None:
    lines = mixed_lines(12_000, bad_every=4, seed=11)
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    summary = check_run(lines, src, tmp_path, "--batch-rows", "256")
    assert summary["peak_rss_mb"] < 500
