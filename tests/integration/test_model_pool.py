"""A model pool of two real `aisp serve` processes: one is SIGKILLed and restarted mid-run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aisp import BatcherConfig, CollectSink, ExecutorOptions, Pipeline, RunOptions, WorkloadFSource, run
from aisp.errors import ConfigError, ModelError
from aisp.infer.runtimes.endpoints import BreakerConfig, RetryPolicy
from aisp.infer.runtimes.pool import RemotePool
from tests.support.models import expected_score, fraud_repository

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(repo: Path, port: int) -> subprocess.Popen[str]:
    """`aisp serve` on a fixed gRPC port (so a restarted server comes back at the same address)."""
    cmd = [
        sys.executable,
        "-m",
        "aisp.cli",
        "serve",
        str(repo),
        "--http-port",
        "-1",
        "--grpc-port",
        str(port),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "grpc HOST:PORT" once it listens
    assert line.startswith("grpc "), line
    return proc


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[Path, list[int], list[subprocess.Popen[str]]]]:
    repo = fraud_repository(tmp_path / "repo", {1: 0.1})
    ports = [free_port(), free_port()]
    procs = [serve(repo, port) for port in ports]
    yield repo, ports, procs
    for proc in procs:
        proc.kill()
        proc.communicate(timeout=30)


def features(ids: np.ndarray) -> np.ndarray:
    return np.repeat(((ids % 97) / 97.0).astype(np.float32)[:, None], 18, axis=1)


def test_a_killed_endpoint_loses_nothing_and_the_survivor_takes_the_load(
    servers: tuple[Path, list[int], list[subprocess.Popen[str]]], tmp_path: Path
) -> None:
    repo, ports, procs = servers
    urls = [f"127.0.0.1:{port}" for port in ports]
    pool = RemotePool(urls, "fraud", timeout_ms=2000, breaker=BreakerConfig(failures=1, reset_s=0.2),
                      retry=RetryPolicy(attempts=50, base_ms=20, max_ms=100))  # fmt: skip
    events = 24_000
    p = Pipeline("pool")
    out = CollectSink(columns=["id", "score"])
    (
        p.source("events", WorkloadFSource(events=events))
        .map_batch("x", lambda b: b.with_columns({"features": features(b.ids)}))
        .infer(
            "score",
            pool,
            inputs={"features": "features"},
            outputs={"score": "score"},
            batcher=BatcherConfig(max_batch_size=64, instances=2),
        )  # fmt: skip
        .sink("out", out)
    )
    seen: dict[str, Any] = {}

    def chaos() -> None:
        time.sleep(1.0)
        seen["before_kill"] = {e["url"]: e["calls"] for e in pool.endpoints()}
        procs[0].kill()
        procs[0].communicate(timeout=30)
        time.sleep(0.5)
        seen["after_kill"] = {e["url"]: e["calls"] for e in pool.endpoints()}
        procs[0] = serve(repo, ports[0])  # back at the same address
        seen["restarted"] = {e["url"]: e["calls"] for e in pool.endpoints()}

    dl = tmp_path / "dl.jsonl"
    killer = threading.Thread(target=chaos)
    killer.start()
    summary = run(p, RunOptions(execution=ExecutorOptions(rate_events_per_s=4000), dead_letter=str(dl)))
    killer.join()
    killed, survivor = urls
    assert summary.events_out == events and summary.dead_letters == 0, dl.read_text()[:500]
    ids = np.array([r["id"] for r in out.rows])
    assert sorted(ids.tolist()) == list(range(events))  # each event once
    scores = np.array([r["score"] for r in out.rows], dtype=np.float32).reshape(-1)
    np.testing.assert_allclose(scores, expected_score(features(ids), 0.1), rtol=1e-6)
    final = {e["url"]: e for e in pool.endpoints()}
    assert seen["before_kill"][killed] > 0 and seen["before_kill"][survivor] > 0  # both served
    assert seen["after_kill"][survivor] > seen["before_kill"][survivor]  # the survivor took the load
    assert final[killed]["calls"] > seen["restarted"][killed]  # and the restarted one is back in use
    assert final[killed]["state"] == "up" and final[killed]["failures"] >= 1


def test_endpoints_join_and_leave_and_one_that_stays_down_is_skipped(
    servers: tuple[Path, list[int], list[subprocess.Popen[str]]],
) -> None:
    _, ports, _ = servers
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    retry = RetryPolicy(attempts=2, base_ms=5, max_ms=20)
    breaker = BreakerConfig(failures=1, reset_s=0.1)
    pool = RemotePool([f"127.0.0.1:{ports[0]}", down], "fraud", retry=retry, breaker=breaker)
    x = features(np.arange(10))
    for _ in range(6):
        np.testing.assert_allclose(
            pool.run({"features": x})["score"][:, 0], expected_score(x, 0.1), rtol=1e-6
        )
    states = {e["url"]: e for e in pool.endpoints()}
    assert states[down]["state"] == "down" and states[down]["error"]
    pool.add(f"127.0.0.1:{ports[1]}")
    pool.remove(down)
    for _ in range(8):
        pool.run({"features": x})
    calls = [e["calls"] for e in pool.endpoints()]
    assert len(calls) == 2 and min(calls) >= 3  # spread over both
    with pytest.raises(ConfigError, match="already has"):
        pool.add(f"127.0.0.1:{ports[1]}")
    with pytest.raises(ModelError, match="no endpoint answered"):
        RemotePool([down], "fraud", connect_timeout_s=0.3)
    with pytest.raises(ModelError, match="shape|INVALID|input"):  # a bad request is not retried elsewhere
        pool.run({"features": np.zeros((2, 5), np.float32)})


def test_the_pool_endpoints_are_in_the_metrics(
    servers: tuple[Path, list[int], list[subprocess.Popen[str]]],
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from aisp.observe.export.metrics import PipelineCollector
    from aisp.schedule.executor import LocalExecutor
    from aisp.sinks.deadletter import DeadLetterSink

    _, ports, procs = servers
    urls = [f"127.0.0.1:{port}" for port in ports]
    pool = RemotePool(
        urls, "fraud", breaker=BreakerConfig(failures=1, reset_s=60.0), retry=RetryPolicy(attempts=1)
    )
    p = Pipeline("pool")
    p.source("events", WorkloadFSource(events=256)).map_batch(
        "x", lambda b: b.with_columns({"features": features(b.ids)})
    ).infer(
        "score", pool, inputs={"features": "features"}, outputs={"score": "score"},
        batcher=BatcherConfig(max_batch_size=16),
    ).sink("out", CollectSink())  # fmt: skip
    executor = LocalExecutor(p.build(), dead_letter=DeadLetterSink().open())
    registry = CollectorRegistry()
    registry.register(PipelineCollector(executor))
    executor.run()  # 16 calls or more, spread over both
    procs[1].kill()
    procs[1].communicate(timeout=30)
    x = features(np.arange(4))
    for _ in range(3):  # the first call to the dead one fails over; then its breaker is open
        pool.run({"features": x})
    samples = {
        (s.name, s.labels["endpoint"]): s.value
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        if f.name.startswith("aisp_model_endpoint")
        for s in f.samples
    }
    assert (
        samples[("aisp_model_endpoint_up", urls[0])] == 1
        and samples[("aisp_model_endpoint_up", urls[1])] == 0
    )
    assert samples[("aisp_model_endpoint_calls_total", urls[0])] >= 8
    assert samples[("aisp_model_endpoint_failures_total", urls[1])] == 1
    assert samples[("aisp_model_endpoint_outstanding", urls[0])] == 0
