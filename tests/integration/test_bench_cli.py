"""`aisp bench` against a real `aisp serve` (HTTP and gRPC) and a local pipeline file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.serving import aisp_serve, wait_http

ROOT = Path(__file__).resolve().parents[2]
FRAUD = ROOT / "examples" / "fraud" / "pipeline.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "aisp.cli", "bench", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120, check=False)


def test_open_loop_sweep_over_http_writes_json_png_and_html(tmp_path: Path) -> None:
    with aisp_serve(FRAUD, http=True, grpc=True) as (addresses, _):
        wait_http(addresses["http"])
        url = f"http://{addresses['http']}/v1/pipelines/fraud"
        out = tmp_path / "sweep.json"
        done = bench(
            url,
            *("--sweep", "500,1000", "--events-per-request", "10", "--duration-s", "1", "--warmup-s", "0.2"),
            *("--json", str(out), "--plot", str(tmp_path / "p.png"), "--plot", str(tmp_path / "p.html")),
        )
        assert done.returncode == 0, done.stderr
        closed = bench(
            f"grpc://{addresses['grpc']}/fraud",
            *("--concurrency", "2", "--events-per-request", "20", "--duration-s", "1", "--warmup-s", "0.2"),
        )
        assert closed.returncode == 0, closed.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "open" and report["slo_ms"] == 50.0
    points = report["points"]
    assert [p["offered_rate"] for p in points] == [500.0, 1000.0]
    for p in points:
        assert set(p["latency_ms"]) >= {"p50", "p90", "p99", "p999", "max"}
        assert 0.8 * p["offered_rate"] <= p["events_sent"] <= 1.2 * p["offered_rate"]
        assert p["errors"] == {} and p["events_ok"] == p["events_sent"]
        assert 0 < p["latency_ms"]["p50"] <= p["latency_ms"]["p99"] <= p["latency_ms"]["max"]
    assert report["best_rate"] in (None, 500.0, 1000.0)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<polyline" in (tmp_path / "p.html").read_text()
    grpc_point = json.loads(closed.stdout)["points"][0]
    assert grpc_point["mode"] == "closed" and grpc_point["concurrency"] == 2
    assert grpc_point["events_ok"] > 0 and grpc_point["errors"] == {}


def test_a_local_pipeline_is_run_open_loop(tmp_path: Path) -> None:
    done = bench(
        str(FRAUD),
        "--rate",
        "5000",
        "--duration-s",
        "1",
        "--warmup-s",
        "0.2",
        "--json",
        str(tmp_path / "r.json"),
    )
    assert done.returncode == 0, done.stderr
    p = json.loads((tmp_path / "r.json").read_text())["points"][0]
    assert p["events_sent"] == 6000 and p["events_ok"] == 6000
    assert 0 <= p["slo_attainment"] <= 1 and p["latency_ms"]["p99"] > 0


def test_bad_targets_are_refused_clearly() -> None:
    done = bench("ftp://nowhere", "--rate", "10")
    assert done.returncode == 2 and "bench target" in done.stderr


@pytest.mark.parametrize("broker", ["redis", "nats"])
def test_open_loop_through_a_broker_matches_results_to_events(tmp_path: Path, broker: str) -> None:
    import asyncio
    import uuid

    tag = uuid.uuid4().hex[:8].upper()
    src, dst = f"AISPBENCHIN{tag}", f"AISPBENCHOUT{tag}"
    port = 6379 if broker == "redis" else 4222
    if broker == "nats":  # the input stream exists before the pipeline's consumer
        asyncio.run(_nats_streams("add", src))
    source = f"{broker}://127.0.0.1:{port}/{src}?" + ("group=b" if broker == "redis" else "durable=b")
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(FRAUD), "--no-live"]
    cmd += ["--input", source, "--output", f"{broker}://127.0.0.1:{port}/{dst}"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        done = bench(
            f"{broker}://127.0.0.1:{port}/{src}?output={dst}",
            *("--rate", "1000", "--events-per-request", "10", "--duration-s", "1", "--warmup-s", "0.5"),
            *("--json", str(tmp_path / "r.json")),
        )
        assert done.returncode == 0, done.stderr
    finally:
        proc.terminate()
        _, pipeline_err = proc.communicate(timeout=60)
        if broker == "redis":
            _redis_cleanup(src, dst)
        else:
            asyncio.run(_nats_streams("delete", src, dst))
    p = json.loads((tmp_path / "r.json").read_text())["points"][0]
    assert 900 <= p["events_sent"] <= 1100
    assert p["events_ok"] == p["events_sent"] and p["errors"] == {}, pipeline_err.decode()[-2000:]
    assert 0 < p["latency_ms"]["p50"] <= p["latency_ms"]["max"]


def _redis_cleanup(src: str, dst: str) -> None:
    import redis

    r = redis.Redis()
    r.delete(src, dst)
    for key in r.scan_iter(f"aisp:dedupe:{dst}:*", count=1000):
        r.delete(key)
    r.close()


async def _nats_streams(action: str, *names: str) -> None:
    import nats
    from nats.js.api import StreamConfig

    nc = await nats.connect("nats://127.0.0.1:4222", connect_timeout=2, max_reconnect_attempts=0)
    js = nc.jetstream()
    for name in names:
        if action == "add":
            await js.add_stream(StreamConfig(name=name, subjects=[f"{name}.>"]))
        else:
            try:
                await js.delete_stream(name)
            except nats.js.errors.NotFoundError:
                pass
    await nc.close()
