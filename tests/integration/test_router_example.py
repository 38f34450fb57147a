"""The semantic router example: a classifier picks the scorer, the branches merge into one sink."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.workload import reference_outputs, write_events

ROOT = Path(__file__).resolve().parents[2]


def run_example(pipeline: Path, src: Path, out: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "aisp.cli",
        "run",
        str(pipeline),
        "--input",
        str(src),
        "--output",
        str(out),
        "--no-live",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr


def test_router_sends_risky_events_to_the_mlp_and_merges(tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_events(src, 6000, seed=2, bad_every=500)
    run_example(ROOT / "examples" / "router" / "pipeline.py", src, out)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    expected = reference_outputs(src, ROOT / "examples" / "fraud" / "model.onnx")
    assert sorted(r["id"] for r in rows) == sorted(expected)
    by_model = {"fraud_mlp": 0, "fraud_linear": 0}
    for r in rows:
        by_model[r["model"]] += 1
        assert (r["model"] == "fraud_mlp") == (r["risk"] > 0.5)
        assert 0.0 <= r["score"] <= 1.0 and r["alert"] == (r["score"] > 0.9)
        if r["model"] == "fraud_mlp":
            assert abs(r["score"] - expected[r["id"]]["score"]) <= 1e-5
    assert by_model["fraud_mlp"] > 0 and by_model["fraud_linear"] > by_model["fraud_mlp"]


def test_tiers_example_scores_bronze_with_the_int8_variant(tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_events(src, 5000, seed=4)
    run_example(ROOT / "examples" / "fraud" / "tiers.py", src, out)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    expected = reference_outputs(src, ROOT / "examples" / "fraud" / "model.onnx")
    assert sorted(r["id"] for r in rows) == sorted(expected)
    for r in rows:
        assert r["tier"] == ("gold", "silver", "bronze")[int(r["user"][1:]) % 3]
        assert r["model"] == ("fraud_int8" if r["tier"] == "bronze" else "fraud")
        if r["model"] == "fraud":
            assert abs(r["score"] - expected[r["id"]]["score"]) <= 1e-5
        else:
            assert abs(r["score"] - expected[r["id"]]["score"]) <= 0.5  # int8: close, not exact
