"""`aisp run --metrics-port`: Prometheus metrics of a running pipeline, per stage and phase."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
STAGES = {"events", "by_user", "user_stats", "features", "score", "emit", "out"}


def test_metrics_of_a_running_pipeline_parse_and_cover_every_stage(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--events", "200000", "--rate", "20000"]
    cmd += ["--output", str(tmp_path / "out.jsonl"), "--no-live", "--metrics-port", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        line = proc.stderr.readline()
        assert line.startswith("metrics http://127.0.0.1:"), line
        url = line.split()[1]
        time.sleep(2.0)
        text = httpx.get(url, timeout=5).text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    latency = families["aisp_stage_latency_seconds"]
    phases: dict[str, set[str]] = {}
    for sample in latency.samples:
        if sample.name.endswith("_count"):
            phases.setdefault(sample.labels["stage"], set()).add(sample.labels["phase"])
    assert set(phases) == STAGES
    assert all(p == {"queue", "batch", "serialize", "compute"} for p in phases.values())

    def value(family: str, suffix: str = "", **labels: str) -> float:
        return next(
            s.value
            for s in families[family].samples
            if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items())
        )

    assert value("aisp_stage_latency_seconds", "_count", stage="score", phase="compute") > 0
    assert value("aisp_stage_latency_seconds", "_count", stage="score", phase="batch") > 0
    assert value("aisp_stage_latency_seconds", "_count", stage="out", phase="serialize") > 0
    assert value("aisp_stage_latency_seconds", "_count", stage="events", phase="serialize") > 0
    assert value("aisp_e2e_latency_seconds", "_count") > 1000
    assert value("aisp_stage_rows", "_total", stage="score", direction="in") > 1000
    assert {s.labels["stage"] for s in families["aisp_stage_queue_rows"].samples} == STAGES
    assert value("aisp_batch_size_rows", "_count", stage="score") > 0
    assert value("aisp_events", "_total", direction="in") >= value("aisp_events", "_total", direction="out")
    assert value("aisp_model_rows", "_total", stage="score", outcome="scored") > 1000
    assert value("aisp_model_rows", "_total", stage="score", outcome="shed") == 0
    (info,) = families["aisp_model_info"].samples
    assert info.labels["stage"] == "score" and info.labels["provider"] == "CPUExecutionProvider"
    assert info.labels["model"] and info.labels["version"] and info.labels["precision"] == "fp32"
    assert value("aisp_stage_busy_seconds", "_total", stage="score") > 0
    assert value("aisp_stage_cpu_seconds", "_total", stage="events") > 0
    attainment = value("aisp_slo_attainment_ratio", stage="pipeline")
    assert 0.0 <= attainment <= 1.0
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "aisp_gc_pause_seconds"} <= set(families)


def test_metrics_and_the_dashboard_are_one_server(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--events", "200000", "--rate", "20000"]
    cmd += ["--output", str(tmp_path / "out.jsonl"), "--no-live", "--metrics-port", "0", "--dashboard"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        metrics, dashboard = proc.stderr.readline().split()[1], proc.stderr.readline().split()[1]
        assert metrics == dashboard + "metrics", (metrics, dashboard)
        state = httpx.get(dashboard + "dashboard/state", timeout=10).json()
        text = httpx.get(metrics, timeout=5).text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert state["pipeline"] == "fraud"
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"aisp_stage_latency_seconds", "process_cpu_seconds", "aisp_gc_pause_seconds"} <= names


def test_a_dashboard_port_apart_from_the_metrics_port_is_refused(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--events", "10", "--no-live"]
    cmd += [
        "--output",
        str(tmp_path / "out.jsonl"),
        "--metrics-port",
        "9",
        "--dashboard",
        "--dashboard-port",
        "7",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "share one server" in done.stderr, done.stderr
