"""The live dashboard in headless Chromium, while a pipeline runs (`aisp run --dashboard` and
`aisp serve`): the DAG and live numbers appear; the JSON and SSE endpoints behind it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks.workload import write_events
from tests.support.browser import dump_dom
from tests.support.serving import aisp_serve, wait_http

ROOT = Path(__file__).resolve().parents[2]
FRAUD = ROOT / "examples" / "fraud" / "pipeline.py"
STAGES = ["events", "by_user", "user_stats", "features", "score", "emit", "out"]


def number(dom: str, element_id: str) -> float:
    m = re.search(rf'id="{element_id}">([^<]*)<', dom)
    assert m is not None, f"no #{element_id} in the page"
    return float(m.group(1).replace(",", ""))


def check_page(dom: str) -> None:
    for stage in STAGES:  # the DAG's nodes and the stages table
        assert dom.count(f'data-stage="{stage}"') >= 2, stage
    assert "<line" in dom  # edges
    assert number(dom, "events-in-rate") > 0
    assert number(dom, "e2e-p99") > 0
    assert re.search(r'<li data-cause="[a-z_]+">', dom)
    assert re.search(r'<polyline[^>]*class="p99"', dom)


@contextmanager
def dashboard_run(tmp_path: Path, pipeline: Path, *args: str) -> Iterator[str]:
    """``aisp run PIPELINE ARGS --dashboard`` in a subprocess; yields the dashboard's address."""
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(pipeline), *args, "--no-live", "--dashboard"]
    log = (tmp_path / "run.log").open("w+")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        url = ""
        deadline = time.monotonic() + 60
        while not url and time.monotonic() < deadline:
            found = re.search(r"^dashboard (\S+)", (tmp_path / "run.log").read_text(), re.M)
            url = found.group(1) if found else ""
            assert proc.poll() is None, (tmp_path / "run.log").read_text()
            time.sleep(0.1)
        assert url, "no dashboard address announced"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_dashboard_of_aisp_run_shows_the_graph_and_live_numbers(tmp_path: Path) -> None:
    with dashboard_run(tmp_path, FRAUD, "--events", "10000000", "--rate", "20000") as url:
        time.sleep(3.5)  # nobody watches yet: the engine keeps the latency trail all the same
        # opened now, the page draws the seconds before it on its first state
        first = dump_dom(url, budget_ms=300)
        points = re.search(r'<polyline[^>]*points="([^"]*)"[^>]*class="p99"', first)
        assert points is not None and len(points.group(1).split()) >= 3, first[-3000:]
        check_page(dump_dom(url))
        state = httpx.get(url + "dashboard/state", timeout=10).json()
        assert [n["id"] for n in state["graph"]["nodes"]] == STAGES
        assert state["events_in_per_s"] > 0 and state["diagnosis"] and "history" not in state
        history = httpx.get(url + "dashboard/state?history=1", timeout=10).json()["history"]
        assert len(history) >= 3 and all(h["p99"] > 0 for h in history)
        assert [h["t"] for h in history] == sorted(h["t"] for h in history)
        with httpx.stream("GET", url + "dashboard/events", timeout=10) as events:
            first = next(line for line in events.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["pipeline"] == "fraud"
        assert "aisp_stage_latency_seconds" in httpx.get(url + "metrics", timeout=10).text


def test_dashboard_of_a_served_pipeline(tmp_path: Path) -> None:
    write_events(tmp_path / "in.jsonl", 2000)
    body = (tmp_path / "in.jsonl").read_bytes()
    with aisp_serve(FRAUD, http=True, grpc=False) as (addresses, _):
        wait_http(addresses["http"])
        base = f"http://{addresses['http']}"
        stop = threading.Event()

        def load() -> None:  # keep events flowing while the page is open
            with httpx.Client(timeout=30) as client:
                while not stop.is_set():
                    client.post(f"{base}/v1/pipelines/fraud/events", content=body)

        feeder = threading.Thread(target=load)
        feeder.start()
        try:
            time.sleep(1.5)
            check_page(dump_dom(f"{base}/dashboard"))
            assert httpx.get(f"{base}/dashboard/state?pipeline=nope", timeout=10).status_code == 404
            state = httpx.get(f"{base}/dashboard/state?pipeline=fraud&history=1", timeout=10).json()
            assert state["history"] and state["history"][-1]["t"] <= state["time_s"]
        finally:
            stop.set()
            feeder.join()


def test_dashboard_shows_a_window_steps_watermark(tmp_path: Path) -> None:
    pipeline = ROOT / "examples" / "windows" / "pipeline.py"
    with dashboard_run(tmp_path, pipeline, "--events", "200000", "--rate", "5000") as url:
        time.sleep(2.5)
        (window,) = httpx.get(url + "dashboard/state", timeout=10).json()["windows"]
        assert window["stage"] == "per_user" and window["watermark_ms"] > 1_699_999_990_000
        assert window["open_windows"] > 0 and window["lag_s"] > 0
        dom = dump_dom(url)
        row = re.search(
            r'<tr data-stage="per_user"><td class="l">per_user</td><td class="l">(20\d\d-[^<]+)<', dom
        )
        assert row is not None, dom[-3000:]  # the watermark, as a UTC time
        assert "aisp_watermark_lag_seconds" in httpx.get(url + "metrics", timeout=10).text


def test_dashboard_shows_a_vector_search_steps_retrieval_confidence(tmp_path: Path) -> None:
    pipeline = ROOT / "examples" / "diagnose" / "retrieval_confidence" / "pipeline.py"
    with dashboard_run(tmp_path, pipeline, "--rate", "3000") as url:
        deadline = time.monotonic() + 30
        while True:  # three windows of 500 queries (a hop of 125 apart) over the target: the alert
            (row,) = httpx.get(url + "dashboard/state", timeout=10).json()["retrieval"]
            if row["alerts"] or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert row["stage"] == "index" and row["alerts"] == 1 and row["queries"] >= 750
        assert row["low_share"] > row["target_share"] == 0.2 and row["threshold"] == 0.5
        dom = dump_dom(url)
        table = dom[dom.index('id="retrieval"') :]
        assert re.search(r'<td class="l">index</td><td>\d+</td><td>0\.[3-6]\d*</td><td>0\.2', table), table[
            :2000
        ]
        assert "aisp_retrieval_low_confidence_share" in httpx.get(url + "metrics", timeout=10).text
