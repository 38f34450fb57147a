"""Drift monitoring: PSI and KS per feature, alerts after consecutive windows, none without a shift."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from typing import Any

import numpy as np
import pytest

from aisp import Batch, CollectSink, Pipeline, PythonRuntime, WorkloadFSource, run
from aisp.errors import ConfigError, GraphError
from aisp.observe.drift import DriftConfig, DriftMonitor, alert_sink, ks_statistic, psi


def test_psi_and_ks_grow_with_the_shift() -> None:
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(5000, 1))
    monitor = DriftMonitor("m", DriftConfig(window_rows=5000, reference=ref), 1, ["x"])
    values = []
    for shift in (0.0, 0.3, 1.0):
        monitor.observe(rng.normal(loc=shift, size=(5000, 1)))
        values.append((float(monitor.psi[0]), float(monitor.ks[0])))
    assert values[0][0] < 0.02 and values[0][1] < 0.04
    assert values[0] < values[1] < values[2]
    assert values[2][0] > 0.5 and values[2][1] > 0.3
    assert float(ks_statistic(np.sort(ref, axis=0), ref + 10)[0]) == 1.0
    assert float(psi(np.array([[0.5, 0.5]]), np.array([[0.9, 0.1]]))[0]) > 0.5


def test_an_alert_needs_consecutive_windows_and_is_raised_once() -> None:
    rng = np.random.default_rng(1)
    alerts: list[dict[str, Any]] = []
    cfg = DriftConfig(window_rows=1000, consecutive=3, alert=alerts.append)
    monitor = DriftMonitor("score", cfg, 2, ["a", "b"])
    monitor.observe(rng.normal(size=(1000, 2)))  # the reference
    for _ in range(2):
        monitor.observe(np.column_stack([rng.normal(size=1000), rng.normal(loc=2.0, size=1000)]))
    assert alerts == []  # two windows over: not yet
    for _ in range(3):
        monitor.observe(np.column_stack([rng.normal(size=1000), rng.normal(loc=2.0, size=1000)]))
    assert [(a["stage"], a["feature"]) for a in alerts] == [("score", "b")]  # once, only the shifted one
    assert alerts[0]["windows"] == 3 and alerts[0]["psi"] > 0.2
    with pytest.raises(ConfigError, match="window_rows"):
        DriftConfig(window_rows=10)


def test_a_pipeline_alerts_on_the_features_that_shift_mid_stream() -> None:
    alerts: list[dict[str, Any]] = []

    def features(b: Batch) -> Batch:
        f = b.numpy("f").copy()
        late = b.numpy("id") >= 40_000
        f[late, 3] += 2.0  # feature 3 shifts half-way
        return b.with_columns({"x": f.astype(np.float32)})

    model = PythonRuntime(
        lambda i: {"y": i["x"].sum(axis=1)}, name="sum", input_names=["x"], output_names=["y"]
    )
    p = Pipeline("drifting")
    p.source("events", WorkloadFSource(events=80_000, seed=4)).map_batch("features", features).infer(
        "score",
        model,
        inputs={"x": "x"},
        outputs={"y": "y"},
        drift=DriftConfig(window_rows=5000, alert=alerts.append),
    ).sink("out", CollectSink(columns=["id"]))
    run(p)
    assert {a["feature"] for a in alerts} == {"x[3]"}
    assert alerts[0]["stage"] == "score"


def test_alerts_can_go_to_a_redis_stream() -> None:
    import json
    import uuid

    import redis

    from aisp.connectors import alert_to

    stream = f"aisp-test-alerts-{uuid.uuid4().hex[:8]}"
    r = redis.Redis()
    try:
        send = alert_to(f"redis://127.0.0.1:6379/{stream}")
        alert = {
            "type": "drift",
            "stage": "score",
            "feature": "x[3]",
            "psi": 0.4,
            "ks": 0.2,
            "window": 4,
            "time_unix_ms": 1,
        }
        send(alert)
        send(alert)  # the same alert again: added once
        assert [json.loads(f[b"data"]) for _, f in r.xrange(stream)] == [alert]
    finally:
        r.delete(stream, *r.scan_iter(f"aisp:dedupe:{stream}:*"))


@pytest.mark.parametrize("alert", ["ftp://alerts", "kafka://127.0.0.1:9092/alerts", "slack"])
def test_a_bad_alert_target_fails_when_the_pipeline_is_built(alert: str) -> None:
    p = Pipeline("bad-alert")
    model = PythonRuntime(lambda xs: {"y": xs["x"]}, input_names=["x"], output_names=["y"], name="m")
    with pytest.raises(GraphError, match="step 'score': drift alert target") as info:
        p.source("events", WorkloadFSource(events=1)).infer(
            "score", model, inputs={"x": "x"}, outputs={"y": "y"}, drift=DriftConfig(alert=alert)
        )
    assert info.value.step == "score"


def test_a_webhook_with_credentials_gets_basic_auth_and_no_log_line_holds_the_password(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import http.server
    import queue

    from aisp.connectors.base import free_port

    seen: queue.Queue[tuple[str, str | None, bytes]] = queue.Queue()

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.put((self.path, self.headers.get("Authorization"), body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        alert_sink(f"http://ops:s3cr%40t@127.0.0.1:{server.server_port}/hook?team=risk")({"feature": 3})
        path, auth, body = seen.get(timeout=10)
        monkeypatch.setenv("AISP_TEST_HOOK_PASSWORD", "v-2")  # or where the password is kept
        alert_sink(f"http://ops@127.0.0.1:{server.server_port}/h?password_env=AISP_TEST_HOOK_PASSWORD&a=1")(
            {}
        )
        from_env = seen.get(timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    assert path == "/hook?team=risk" and json.loads(body) == {"feature": 3}
    assert auth == "Basic " + base64.b64encode(b"ops:s3cr@t").decode()
    assert from_env[:2] == ("/h?a=1", "Basic " + base64.b64encode(b"ops:v-2").decode())
    closed = free_port()
    with caplog.at_level(logging.WARNING, logger="aisp.drift"):
        alert_sink(f"http://ops:s3cr%40t@127.0.0.1:{closed}/hook")({"feature": 3})
        deadline = time.monotonic() + 10
        while "webhook" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert f"http://ops:***@127.0.0.1:{closed}/hook failed" in caplog.text
    assert "s3cr" not in caplog.text
    with pytest.raises(ConfigError) as bad:
        alert_sink("ftp://ops:s3cret@h/x")
    assert "s3cret" not in str(bad.value)
    with pytest.raises(ConfigError, match="the secret comes from the URL's password and password_env"):
        alert_sink("http://ops:s3cret@h/x?password_env=AISP_TEST_HOOK_PASSWORD")
