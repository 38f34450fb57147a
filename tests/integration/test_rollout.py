"""Canary rollouts on a running ``aisp serve`` under steady load: a candidate 20 ms slower per
batch and one with shifted scores are rolled back automatically, a healthy one is promoted
through every step; no request fails meanwhile. The status endpoint and /metrics show the
decisions."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.browser import dump_dom
from tests.support.models import (
    FRAUD_CONFIG,
    expected_score,
    fraud_repository,
    linear_model,
    slow_linear_model,
)
from tests.support.serving import aisp_serve

SCALES = {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.6}  # 2: healthy (the same model), 3: slow, 4: shifted
POLICY = {"steps": [0.5, 1.0], "window_s": 1.0, "min_samples": 100, "p99_slack_ms": 10.0}


class Load:
    """Requests without a version from 4 threads, each with its user as rollout key; every
    answer is checked against the version that gave it."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.answered: list[str] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(4)]

    def _run(self, worker: int) -> None:
        rng = np.random.default_rng(worker)
        with httpx.Client(base_url=self.url, timeout=30) as client:
            i = 0
            while not self.stop.is_set():
                i += 1
                x = rng.normal(size=(1, 18)).astype(np.float32)
                body = {
                    "inputs": [
                        {"name": "features", "shape": [1, 18], "datatype": "FP32", "data": x.ravel().tolist()}
                    ],
                    "parameters": {"rollout_key": f"user-{worker}-{i % 50}"},
                }
                r = client.post("/v2/models/fraud/infer", json=body)
                if r.status_code != 200:
                    self.failures.append(f"{r.status_code} {r.text[:200]}")
                    continue
                out = r.json()
                version = out["model_version"]
                want = expected_score(x, SCALES[int(version)])[0]
                if abs(out["outputs"][0]["data"][0] - float(want)) > 1e-5:
                    self.failures.append(
                        f"version {version} answered {out['outputs'][0]['data'][0]}, not {want}"
                    )
                self.answered.append(version)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    repo = fraud_repository(tmp_path_factory.mktemp("repo"), {1: SCALES[1]})
    with aisp_serve(repo, http=True, grpc=False, extra_args=("--allow-model-control",)) as (addresses, _):
        # the candidates arrive once version 1 serves (the policy, latest 1, would pick 4)
        linear_model(repo / "fraud" / "2" / "model.onnx", SCALES[2])
        slow_linear_model(repo / "fraud" / "3" / "model.onnx", SCALES[3])
        linear_model(repo / "fraud" / "4" / "model.onnx", SCALES[4])
        yield f"http://{addresses['http']}", repo


def roll_out(url: str, version: int, **policy: Any) -> dict[str, Any]:
    """Start a rollout of ``version`` under load and wait for its end; its last status."""
    with Load(url) as load, httpx.Client(base_url=url, timeout=30) as admin:
        while len(load.answered) < 50:
            time.sleep(0.05)
        started = admin.post("/v2/models/fraud/rollout", json={"version": version, **POLICY, **policy})
        assert started.status_code == 200, started.text
        deadline = time.monotonic() + 60
        status = started.json()
        while status["state"] in ("shadow", "canary") and time.monotonic() < deadline:
            time.sleep(0.2)
            status = admin.get("/v2/models/fraud/rollout").json()
        time.sleep(0.5)  # a little more load after the decision
    assert load.failures == [], load.failures[:3]
    status["answered"] = set(load.answered)
    status["took_s"] = time.monotonic() - deadline + 60
    return status


def test_a_slow_candidate_is_rolled_back_without_a_failed_request(served: tuple[str, Path]) -> None:
    url, _ = served
    status = roll_out(url, 3)
    assert status["state"] == "rolled_back", status
    last = status["decisions"][-1]
    assert last["decision"] == "rollback" and "p99 latency" in last["breaches"], last
    assert last["evidence"]["candidate"]["p99_ms"] > last["evidence"]["stable"]["p99_ms"] + 15
    assert status["took_s"] < 30
    with httpx.Client(base_url=url) as client:
        time.sleep(1.5)  # the candidate is retired after its grace period
        assert client.get("/v2/models/fraud/versions/3/ready").status_code == 404
        assert client.get("/v2/models/fraud/versions/1/ready").status_code == 200


def test_a_candidate_with_shifted_scores_is_rolled_back(served: tuple[str, Path]) -> None:
    url, _ = served
    status = roll_out(url, 4, shadow=False)
    assert status["state"] == "rolled_back", status
    last = status["decisions"][-1]
    assert "output distribution" in last["breaches"] and last["evidence"]["psi"] > 0.2, last


def test_a_healthy_candidate_is_promoted_through_every_step(served: tuple[str, Path]) -> None:
    url, _ = served
    status = roll_out(url, 2)
    assert status["state"] == "promoted", status
    assert [d["decision"] for d in status["decisions"] if d["decision"] != "wait"] == [
        "start",
        "pass",
        "pass",
        "promote",
    ]
    assert status["answered"] == {"1", "2"}
    with httpx.Client(base_url=url) as client:
        time.sleep(1.5)
        assert client.get("/v2/models/fraud/versions/1/ready").status_code == 404
        assert client.get("/v2/models/fraud").json()["versions"] == ["2"]
        metrics = client.get("/metrics").text
        assert 'aisp_rollout_decisions_total{decision="promote",model="fraud"} 1.0' in metrics
        assert 'aisp_rollout_state{candidate="2",model="fraud",state="promoted"} 1.0' in metrics
        (shown,) = client.get("/dashboard/state").json()["rollouts"]  # a server of models alone
        assert (shown["name"], shown["state"], shown["candidate"]) == ("fraud", "promoted", "2")
        assert shown["decisions"][0]["decision"] == "promote"
    dom = dump_dom(f"{url}/dashboard")
    assert re.search(r"<td[^>]*>fraud</td><td[^>]*>1</td><td[^>]*>2</td><td[^>]*>promoted</td>", dom), dom[
        -3000:
    ]
    assert re.search(r"<td[^>]*>fraud</td><td[^>]*>promote</td><td[^>]*>1</td>", dom), dom[-3000:]


def test_rollout_requests_that_cannot_work_get_clear_errors(served: tuple[str, Path]) -> None:
    url, _ = served
    with httpx.Client(base_url=url) as client:
        r = client.post("/v2/models/fraud/rollout", json={"version": 9})
        assert r.status_code == 404 and "no version 9" in r.json()["error"]
        r = client.post("/v2/models/fraud/rollout", json={"version": 2, "steps": [0.5]})
        assert r.status_code == 400 and "last rollout step must be 1" in r.json()["error"]
        r = client.post("/v2/models/fraud/rollout", content=b"{not json")
        assert r.status_code == 400 and "not JSON" in r.json()["error"]
        r = client.delete("/v2/models/fraud/rollout")
        assert r.status_code == 404 and "no rollout under way" in r.json()["error"]
        assert client.get("/v2/models/ghost/rollout").status_code == 404


def test_a_rollout_in_the_serve_config_starts_with_the_server(tmp_path: Path) -> None:
    specific = FRAUD_CONFIG.replace("latest: { num_versions: 1 }", "specific: { versions: [ 1 ] }")
    repo = fraud_repository(tmp_path / "repo", {1: SCALES[1], 2: SCALES[2]}, config=specific)
    config = tmp_path / "serve.toml"
    config.write_text("[rollout.fraud]\nversion = 2\nsteps = [0.1, 1.0]\nwindow_s = 60\n")
    with aisp_serve(repo, http=True, grpc=False, extra_args=("--config", str(config))) as (addresses, _):
        client = httpx.Client(base_url=f"http://{addresses['http']}")
        status = client.get("/v2/models/fraud/rollout").json()
        assert (status["stable"], status["candidate"], status["state"]) == ("1", "2", "shadow")
        assert status["steps"] == ["shadow", 0.1, 1.0]
        assert client.get("/v2/models/fraud").json()["versions"] == ["1", "2"]
        # without model control a rollout cannot be changed
        assert client.delete("/v2/models/fraud/rollout").status_code == 403
        client.close()
    config.write_text("[rollout.ghost]\nversion = 2\n")
    ghost = aisp_serve(repo, http=True, grpc=False, extra_args=("--config", str(config)))
    with pytest.raises(RuntimeError, match="unknown model: 'ghost'"), ghost:
        pass
