"""Several versions of a model served at once, as its version policy says, with the unmodified
tritonclient HTTP and gRPC clients: each version answers when asked by number, the newest when
none is given; loading and unloading versions touches no other version."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from tests.support.models import FRAUD_CONFIG, expected_score, fraud_repository, linear_model
from tests.support.serving import aisp_serve

ALL = FRAUD_CONFIG.replace("version_policy: { latest: { num_versions: 1 } }", "version_policy: { all { } }")
SCALES = {1: 0.1, 2: 0.2, 3: 0.3}


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, str], Path, subprocess.Popen[str]]]:
    repo = fraud_repository(tmp_path_factory.mktemp("repo"), {1: SCALES[1], 2: SCALES[2]}, config=ALL)
    with aisp_serve(repo, http=True, grpc=True, extra_args=("--allow-model-control",)) as (addresses, proc):
        yield addresses, repo, proc


def features(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, 18)).astype(np.float32)


def infer(client: Any, module: Any, x: np.ndarray, version: str = "") -> tuple[np.ndarray, str]:
    inp = module.InferInput("features", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("fraud", [inp], model_version=version)
    return result.as_numpy("score")[:, 0], result.get_response()["model_version"] if module is th else (
        result.get_response().model_version
    )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_version_the_policy_selects_is_ready_and_answers_by_number(
    served: tuple[dict[str, str], Path, subprocess.Popen[str]], protocol: str
) -> None:
    addresses, _, _ = served
    module: Any = th if protocol == "http" else tg
    client = module.InferenceServerClient(addresses[protocol])
    assert client.is_model_ready("fraud", "1") and client.is_model_ready("fraud", "2")
    assert not client.is_model_ready("fraud", "7")
    meta = (
        client.get_model_metadata("fraud", as_json=True)
        if protocol == "grpc"
        else client.get_model_metadata("fraud")
    )
    assert meta["versions"] == ["1", "2"]
    x = features(5)
    for version in ("1", "2"):
        scores, answered = infer(client, module, x, version)
        assert answered == version
        np.testing.assert_allclose(scores, expected_score(x, SCALES[int(version)]), rtol=1e-6)
    scores, answered = infer(client, module, x)  # no version: the newest
    assert answered == "2"
    np.testing.assert_allclose(scores, expected_score(x, SCALES[2]), rtol=1e-6)
    with pytest.raises(InferenceServerException, match="version 7 is not found"):
        infer(client, module, x, "7")


def test_each_version_has_its_own_batcher_and_statistics(
    served: tuple[dict[str, str], Path, subprocess.Popen[str]],
) -> None:
    addresses, _, _ = served
    client = th.InferenceServerClient(addresses["http"])
    x = features(1, seed=3)
    errors: list[BaseException] = []

    def hammer(version: str) -> None:
        own = th.InferenceServerClient(addresses["http"])  # (gevent: a client per thread)
        try:
            for _ in range(40):
                scores, answered = infer(own, th, x, version)
                assert answered == version
                np.testing.assert_allclose(scores, expected_score(x, SCALES[int(version)]), rtol=1e-6)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    before = {
        s["version"]: int(s["inference_count"])
        for s in client.get_inference_statistics("fraud")["model_stats"]
    }
    threads = [threading.Thread(target=hammer, args=(v,)) for v in ("1", "2", "1", "2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
    after = {
        s["version"]: int(s["inference_count"])
        for s in client.get_inference_statistics("fraud")["model_stats"]
    }
    assert after["1"] - before.get("1", 0) == 80 and after["2"] - before.get("2", 0) == 80
    one = client.get_inference_statistics("fraud", "1")["model_stats"]
    assert [s["version"] for s in one] == ["1"]


def test_a_new_version_joins_and_an_explicit_load_adds_one_without_touching_the_others(
    served: tuple[dict[str, str], Path, subprocess.Popen[str]],
) -> None:
    addresses, repo, _ = served
    client = tg.InferenceServerClient(addresses["grpc"])
    x = features(3, seed=5)
    linear_model(repo / "fraud" / "3" / "model.onnx", SCALES[3])
    try:
        client.load_model("fraud")  # the policy (all) now selects 1, 2 and 3
        assert [
            e["version"]
            for e in client.get_model_repository_index(as_json=True)["models"]
            if e.get("state") == "READY"
        ] == ["1", "2", "3"]
        for version in ("1", "2", "3"):
            scores, answered = infer(client, tg, x, version)
            assert answered == version
            np.testing.assert_allclose(scores, expected_score(x, SCALES[int(version)]), rtol=1e-6)
        assert infer(client, tg, x)[1] == "3"
    finally:
        (repo / "fraud" / "3" / "model.onnx").unlink()
        (repo / "fraud" / "3").rmdir()
    client.load_model("fraud")  # version 3 left the disk: it is retired, 1 and 2 stay
    assert client.get_model_metadata("fraud", as_json=True)["versions"] == ["1", "2"]
    assert infer(client, tg, x)[1] == "2" and infer(client, tg, x, "1")[1] == "1"


def test_a_hot_swap_under_load_fails_no_request(tmp_path: Path) -> None:
    """With the latest-1 policy a new version replaces the old one: requests in flight during
    the switch are answered (by the old version or the new), none fails."""
    repo = fraud_repository(tmp_path / "repo", {1: SCALES[1]})
    with aisp_serve(repo, http=True, grpc=False, extra_args=("--allow-model-control",)) as (addresses, _):
        stop = threading.Event()
        answered: list[str] = []
        errors: list[BaseException] = []
        x = features(2, seed=9)

        def load() -> None:
            client = th.InferenceServerClient(addresses["http"])
            try:
                while not stop.is_set():
                    scores, version = infer(client, th, x)
                    np.testing.assert_allclose(scores, expected_score(x, SCALES[int(version)]), rtol=1e-6)
                    answered.append(version)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        control = th.InferenceServerClient(addresses["http"])
        try:
            while len(answered) < 200 and not errors:
                stop.wait(0.01)
            linear_model(repo / "fraud" / "2" / "model.onnx", SCALES[2])
            control.load_model("fraud")
            seen = len(answered)
            while len(answered) < seen + 200 and not errors:
                stop.wait(0.01)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors[:1]
        assert answered[0] == "1" and answered[-1] == "2"
        assert control.is_model_ready("fraud", "2") and not control.is_model_ready("fraud", "1")
