"""The event loop's inline path of ``ModelServer``: requests gathered in one loop turn answered
by one model call made in the loop (arrays in, arrays out), with the same answers, statistics
and failures as the batcher's path."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from aisp.serve.models.server import ModelServer, RequestFailed
from tests.support.models import FRAUD_CONFIG, linear_model, picky_model


def repository(root: Path, write: object) -> Path:
    (root / "fraud").mkdir(parents=True)
    (root / "fraud" / "config.pbtxt").write_text(FRAUD_CONFIG)
    write(root / "fraud" / "1" / "model.onnx")  # type: ignore[operator]
    return root


async def burst(models: ModelServer, inputs: list[np.ndarray]) -> list[object]:
    calls = [models.infer_async("fraud", {"features": x}) for x in inputs]
    return await asyncio.gather(*calls, return_exceptions=True)


def test_requests_of_one_turn_share_a_call_and_get_their_own_rows(tmp_path: Path) -> None:
    models = ModelServer(repository(tmp_path, lambda p: linear_model(p, 0.1)), inline_max_us=1e6)
    models.start()
    try:
        rng = np.random.default_rng(1)
        asyncio.run(burst(models, [np.zeros((1, 18), np.float32)] * 4))  # the model's cost is learnt
        before = models.served("fraud")
        sizes = [1 + i % 3 for i in range(60)]
        inputs = [rng.normal(size=(n, 18)).astype(np.float32) for n in sizes]
        results = asyncio.run(burst(models, inputs))
        for x, r in zip(inputs, results, strict=True):
            assert not isinstance(r, BaseException), r
            expected = 1 / (1 + np.exp(-0.1 * x.sum(axis=1, keepdims=True)))
            np.testing.assert_allclose(r.outputs["score"], expected, rtol=1e-5)  # type: ignore[attr-defined]
            assert r.version == "1"  # type: ignore[attr-defined]
        stats = models.statistics("fraud")[0]
        assert stats["inference_count"] == sum(sizes) + 4
        assert stats["execution_count"] < len(sizes)  # shared calls
        batcher = models._get("fraud").batcher.stats
        assert batcher.inline_batches >= 1 and batcher.rows == sum(sizes) + 4
        assert before is models.served("fraud")
    finally:
        models.close()


def test_a_failing_call_fails_its_requests_and_the_server_goes_on(tmp_path: Path) -> None:
    models = ModelServer(repository(tmp_path, picky_model), inline_max_us=1e6)
    models.start()
    try:
        good = np.zeros((1, 18), np.float32)
        bad = np.full((1, 18), 5.0, np.float32)
        asyncio.run(burst(models, [good] * 4))
        # one turn, one call (inline when the model is idle, else one batch on a busy machine):
        # the good requests fail with the bad one
        results = asyncio.run(burst(models, [good, bad, good]))
        for r in results:
            assert isinstance(r, RequestFailed) and r.http_status == 500
            assert "Gather" in str(r) or "indices" in str(r)
        [ok] = asyncio.run(burst(models, [good]))
        assert not isinstance(ok, BaseException)
        assert ok.outputs["score"].tolist() == [[0.25]]  # type: ignore[attr-defined]
        assert models._get("fraud").batcher.stats.errors == 3
    finally:
        models.close()


@pytest.mark.parametrize("gathered", [1, 5])
def test_past_deadline_requests_take_the_queue_path_and_time_out(tmp_path: Path, gathered: int) -> None:
    models = ModelServer(repository(tmp_path, lambda p: linear_model(p, 0.1)))
    models.start()
    try:
        asyncio.run(burst(models, [np.zeros((1, 18), np.float32)] * 4))

        async def late() -> list[object]:
            calls = [
                models.infer_async("fraud", {"features": np.zeros((1, 18), np.float32)}, timeout_s=0.0)
                for _ in range(gathered)
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

        for r in asyncio.run(late()):
            assert isinstance(r, RequestFailed) and r.http_status == 504
    finally:
        models.close()
