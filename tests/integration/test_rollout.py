"""Canary rollouts on a running ``aisp serve`` under steady load: a candidate 20 ms slower per
batch and one with shifted scores are rolled back automatically, a healthy one is promoted
through every step; no request fails meanwhile. The status endpoint and /metrics show the
decisions."""

from __future__ import annotations

import asyncio
import functools
import re
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from onnx import TensorProto

from aisp.errors import AispError
from aisp.infer.models.rollout import RolloutPolicy
from aisp.serve.http.app import create_app
from aisp.serve.models.server import ModelServer
from tests.support.browser import dump_dom
from tests.support.models import (
    FRAUD_CONFIG,
    expected_score,
    fraud_repository,
    linear_model,
    onnx_model,
    picky_model,
    slow_linear_model,
)
from tests.support.serving import aisp_serve
from tests.support.stepping import at_every_step

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


# -- in process: versions checked at load, the first rollout's routing, errors with shadow off -----

BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 18], "data": [0.5] * 18}]}


def http(app: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    """One request to the ASGI ``app``."""

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://aisp") as client:
            return await client.request(method, path, **kw)

    return asyncio.run(call())


CONTRADICTING = {
    "[N, 2] output": (
        {"size": 2, "output": ("score", TensorProto.FLOAT, ["N", 2])},
        "output 'score' has shape [-1, 2] in the model, config.pbtxt gives [-1, 1]",
    ),
    "FP64 output": (
        {"output": ("score", TensorProto.DOUBLE, ["N", 1])},
        "output 'score' is TYPE_FP64 in the model, TYPE_FP32 in config.pbtxt",
    ),
    "renamed input": (
        {"inputs": {"x": (TensorProto.FLOAT, ["N", 18])}},
        "config.pbtxt lists input 'features', the model has no such input (it has ['x'])",
    ),
    "17 features": (
        {"inputs": {"features": (TensorProto.FLOAT, ["N", 17])}, "width": 17},
        "input 'features' has shape [-1, 17] in the model, config.pbtxt gives [-1, 18]",
    ),
}


@pytest.mark.parametrize("case", sorted(CONTRADICTING))
def test_a_version_that_contradicts_its_config_is_refused_at_load_and_at_rollout(
    tmp_path: Path, case: str
) -> None:
    shape, reason = CONTRADICTING[case]
    repo = fraud_repository(tmp_path, {1: SCALES[1]})
    models = ModelServer(repo)
    models.start()
    try:
        onnx_model(repo / "fraud" / "2" / "model.onnx", **shape)  # type: ignore[arg-type]
        app = create_app(models, model_control=True)
        r = http(app, "POST", "/v2/repository/models/fraud/load", json={"parameters": {"version": 2}})
        assert r.status_code == 400 and reason in r.json()["error"], r.text
        assert "model 'fraud' version 2 contradicts" in r.json()["error"]
        r = http(app, "POST", "/v2/models/fraud/rollout", json={"version": 2, **POLICY})
        assert r.status_code == 400 and reason in r.json()["error"], r.text
        assert http(app, "GET", "/v2/models/fraud/rollout").status_code == 404  # none started
        meta = http(app, "GET", "/v2/models/fraud").json()
        assert meta["versions"] == ["1"] and meta["outputs"][0]["shape"] == [-1, 1]
        r = http(app, "POST", "/v2/models/fraud/infer", json=BODY)
        assert r.status_code == 200 and r.json()["model_version"] == "1"
        assert r.json()["outputs"][0]["shape"] == [1, 1]
    finally:
        models.close()


def test_first_rollouts_under_load_never_answer_from_a_shadowed_candidate(tmp_path: Path) -> None:
    """Ten models, each rolled out for the first time (shadow) while four threads send requests
    without a version; one more request is sent at every line the server's rollout start runs,
    so the moment the candidate would be the default is always looked at."""
    names, scales = [f"m{i}" for i in range(10)], {"1": 0.1, "2": 0.6}
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(FRAUD_CONFIG.replace('"fraud"', f'"{name}"'))
        linear_model(tmp_path / name / "1" / "model.onnx", scales["1"])
    models = ModelServer(tmp_path)
    models.start()
    for name in names:  # the candidates arrive once version 1 serves
        linear_model(tmp_path / name / "2" / "model.onnx", scales["2"])
    answered: list[tuple[str, str]] = []
    failures: list[str] = []
    current, stop = [names[0]], threading.Event()

    def ask(name: str, rng: np.random.Generator) -> None:
        x = rng.normal(size=(1, 18)).astype(np.float32)
        try:
            r = models.infer(name, {"features": x}, key=f"user-{rng.integers(1000)}")
        except AispError as exc:
            failures.append(f"{name}: {exc}")
            return
        answered.append((name, r.version))
        if abs(float(r.outputs["score"][0, 0]) - float(expected_score(x, scales[r.version])[0])) > 1e-5:
            failures.append(f"{name} version {r.version} answered a score of another version")

    def load(worker: int) -> None:
        rng = np.random.default_rng(worker)
        while not stop.is_set():
            ask(current[0], rng)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        rng = np.random.default_rng(99)
        for name in names:
            current[0] = name
            deadline = time.monotonic() + 30
            while sum(n == name for n, _ in answered) < 20 and time.monotonic() < deadline:
                time.sleep(0.005)
            policy = RolloutPolicy(version=2, window_s=3600)
            status = at_every_step(
                functools.partial(models.start_rollout, name, policy),
                functools.partial(ask, name, rng),
                files=("model_versions.py", "model_control.py"),
            )
            assert (status["state"], status["candidate"]) == ("shadow", "2")
            for _ in range(20):
                ask(name, rng)
    finally:
        stop.set()
        for t in threads:
            t.join()
    try:
        assert failures == [], failures[:3]
        from_candidate = [(n, v) for n, v in answered if v != "1"]
        assert from_candidate == [], f"{len(from_candidate)} of {len(answered)} answers: {from_candidate[:5]}"
        assert {n for n, _ in answered} == set(names)
        deadline = time.monotonic() + 30  # the shadow copies reach the candidates (answers discarded)
        while time.monotonic() < deadline and not all(
            models.statistics(n, "2")[0]["inference_count"] for n in names
        ):
            time.sleep(0.01)
        assert all(models.statistics(n, "2")[0]["inference_count"] for n in names)
    finally:
        models.close()


def test_with_shadow_off_a_candidates_errors_reach_its_clients_as_500(tmp_path: Path) -> None:
    """A candidate that fails on some rows, rolled out straight to half the keys: a request it
    fails gets HTTP 500 with the model's error (no retry on the stable version); the same request
    on a stable key gets 200; the failures count as the candidate's errors and roll it back."""
    repo = fraud_repository(tmp_path, {1: SCALES[1]})
    models = ModelServer(repo)
    models.start()
    try:
        picky_model(repo / "fraud" / "2" / "model.onnx")  # fails on a row whose first feature is >= 2
        app = create_app(models, model_control=True)
        policy = {"version": 2, "shadow": False, "steps": [0.5, 1.0], "window_s": 1e-6, "min_samples": 5}
        assert http(app, "POST", "/v2/models/fraud/rollout", json=policy).status_code == 200
        buckets = {f"user-{i}": zlib.crc32(f"user-{i}".encode()) % 10_000 for i in range(100)}
        keys = {share: next(k for k, b in buckets.items() if (b < 5_000) == share) for share in (True, False)}
        bad = {**BODY, "inputs": [{**BODY["inputs"][0], "data": [5.0] * 18}]}

        def infer(body: dict[str, Any], key: str) -> httpx.Response:
            return http(
                app, "POST", "/v2/models/fraud/infer", json={**body, "parameters": {"rollout_key": key}}
            )

        r = infer(BODY, keys[True])
        assert r.status_code == 200 and r.json()["model_version"] == "2"  # the candidate's share
        for _ in range(5):
            r = infer(bad, keys[True])
            assert r.status_code == 500, r.text
            assert r.json()["error"].startswith("model 'fraud': ") and "Gather" in r.json()["error"], r.text
        for _ in range(5):
            r = infer(bad, keys[False])
            assert r.status_code == 200 and r.json()["model_version"] == "1"
        status = http(app, "GET", "/v2/models/fraud/rollout").json()
        assert status["state"] == "rolled_back", status
        assert "error rate" in status["decisions"][-1]["breaches"]
        r = infer(bad, keys[True])
        assert r.status_code == 200 and r.json()["model_version"] == "1"
    finally:
        models.close()
