"""``ModelServer.collect`` / ``submit_collected``: many requests admitted at once, each answered
through its callback, in whichever thread finishes it (``collect(None, ...)`` on an event loop:
the loop's)."""

from __future__ import annotations

import asyncio
import functools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aisp.errors import AispError
from aisp.infer.batching.config import BatcherConfig
from aisp.serve.models.served import InferResult
from aisp.serve.models.server import ModelServer
from tests.support.models import expected_score, fraud_repository, slow_linear_model


def _round(models: ModelServer, rng: np.random.Generator, seed: int) -> None:
    n = int(rng.integers(1, 40))
    rows = [int(rng.choice([0, 1, 1, 2, 7])) for _ in range(n)]
    inputs = [rng.normal(size=(r, 18)).astype(np.float32) for r in rows]
    answers: dict[int, list[InferResult | AispError]] = {i: [] for i in range(n)}
    done = threading.Event()
    lock = threading.Lock()

    def answer(i: int, result: InferResult | AispError) -> None:
        with lock:
            answers[i].append(result)
            if all(answers.values()):
                done.set()

    collected: dict[Any, Any] = {}
    for i, x in enumerate(inputs):
        models.collect(collected, "fraud", {"features": x}, functools.partial(answer, i))
    models.submit_collected(collected)
    assert done.wait(30), f"seed {seed}: {sum(map(bool, answers.values()))} of {n} answered"
    for i, x in enumerate(inputs):
        (result,) = answers[i]  # once
        assert isinstance(result, InferResult), f"seed {seed}: {result!r}"
        score = result.outputs["score"].reshape(-1)
        np.testing.assert_allclose(score, expected_score(x, 0.1), rtol=1e-5, err_msg=f"seed {seed}")


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_collected_requests_are_answered_once_each_with_their_own_rows(tmp_path: Path, seed: int) -> None:
    """Seeded: how many requests, their row counts (empty ones too), inline or through the batcher."""
    rng = np.random.default_rng(seed)
    inline = bool(seed % 2)
    models = ModelServer(fraud_repository(tmp_path, {1: 0.1}), inline_max_us=1000.0 if inline else 0.0)
    models.start()
    try:
        for _ in range(3):
            _round(models, rng, seed)
    finally:
        models.close()


def test_a_full_queue_fails_what_does_not_fit_as_overloaded(tmp_path: Path) -> None:
    slow_linear_model(tmp_path / "fraud" / "1" / "model.onnx", 0.1, work=4000)
    fraud_repository(tmp_path, {})
    config = BatcherConfig(max_batch_size=1, capacity_rows=2)
    models = ModelServer(tmp_path, batching={"fraud": config}, inline_max_us=0.0)
    models.start()
    try:
        results: list[InferResult | AispError] = []
        done = threading.Event()

        def answer(result: InferResult | AispError) -> None:
            results.append(result)
            if len(results) == 20:
                done.set()

        collected: dict[Any, Any] = {}
        for _ in range(20):
            models.collect(collected, "fraud", {"features": np.ones((1, 18), np.float32)}, answer)
        models.submit_collected(collected)
        assert done.wait(60)
        failed = [r for r in results if isinstance(r, AispError)]
        assert failed and len(failed) < 20
        assert all(getattr(r, "reason", "") == "overloaded" for r in failed)
    finally:
        models.close()


def test_a_request_that_cannot_be_admitted_raises_at_once(tmp_path: Path) -> None:
    models = ModelServer(fraud_repository(tmp_path, {1: 0.1}))
    models.start()
    try:
        collected: dict[Any, Any] = {}
        with pytest.raises(AispError, match="features"):
            models.collect(collected, "fraud", {"features": np.ones((1, 3), np.float32)}, print)
        assert collected == {}
    finally:
        models.close()


@pytest.mark.parametrize("seed", [5, 6, 7, 8])
def test_gathered_requests_are_answered_once_each_in_the_loop_thread(tmp_path: Path, seed: int) -> None:
    """``collect(None, ...)`` (the event loop's form: the turn's gather). Seeded: how many requests per turn,
    their row counts (empty ones too), inline or through the batcher; every answer comes back
    once, with its own rows, in the loop's thread."""
    rng = np.random.default_rng(seed)
    inline = bool(seed % 2)
    models = ModelServer(fraud_repository(tmp_path, {1: 0.1}), inline_max_us=1000.0 if inline else 0.0)
    models.start()

    async def turns() -> None:
        loop = asyncio.get_running_loop()
        loop_thread = threading.get_ident()
        for _ in range(3):
            n = int(rng.integers(1, 40))
            inputs = [
                rng.normal(size=(int(rng.choice([0, 1, 1, 2, 7])), 18)).astype(np.float32) for _ in range(n)
            ]
            answers: list[asyncio.Future[InferResult | AispError]] = [loop.create_future() for _ in range(n)]
            threads: set[int] = set()

            def answer(
                answers: list[asyncio.Future[Any]], threads: set[int], i: int, result: InferResult | AispError
            ) -> None:
                threads.add(threading.get_ident())
                answers[i].set_result(result)  # a second answer would raise InvalidStateError here

            for i, x in enumerate(inputs):
                models.collect(None, "fraud", {"features": x}, functools.partial(answer, answers, threads, i))
            results = await asyncio.wait_for(asyncio.gather(*answers), 30)
            assert threads == {loop_thread}, f"seed {seed}"
            for x, result in zip(inputs, results, strict=True):
                assert isinstance(result, InferResult), f"seed {seed}: {result!r}"
                score = result.outputs["score"].reshape(-1)
                np.testing.assert_allclose(score, expected_score(x, 0.1), rtol=1e-5, err_msg=f"seed {seed}")

    try:
        asyncio.run(turns())
    finally:
        models.close()
