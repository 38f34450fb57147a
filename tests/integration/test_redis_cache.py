"""A response cache in the real Redis, shared by two caches (two workers) under one namespace:
an answer one stores is a hit for the other; a key no worker stored costs no Redis lookup
(counted by Redis itself); the answers stay under the bound; they expire; the cache works in a
pipeline in front of a model."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from aisp import CollectSink, Pipeline, PythonRuntime, TestingSource
from aisp.batch import Batch
from aisp.infer.cache.redis import RedisStore
from aisp.infer.cache.response import HIT, ResponseCache, cached
from tests.integration.test_exactly_once import redis_client

URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def namespace() -> Iterator[str]:
    ns = f"aisp-test-cache-{uuid.uuid4().hex[:8]}"
    yield ns
    redis_client()  # reachable, or a clear failure
    RedisStore(URL, ns, 1, 1.0, ResponseCache(["t"], ["s"]).bloom).clear()


def texts(values: list[str], answers: list[float] | None = None) -> Batch:
    cols: dict[str, object] = {"text": pa.array(values)}
    if answers is not None:
        cols["score"] = np.array(answers)
    return Batch.from_columns(cols)


def test_an_answer_larger_than_the_bound_is_not_stored_and_evicts_nothing(namespace: str) -> None:
    cache = ResponseCache(["text"], ["score"], redis=URL, namespace=namespace, max_bytes=1000)
    cache.store(texts([f"q{i}" for i in range(20)], [float(i) for i in range(20)]))
    store = RedisStore(URL, namespace, 1000, 60.0, cache.bloom)
    assert len(store) == 20
    huge = [b"z" * 5000]
    assert store.put([123], huge) == 0  # the store itself refuses it: nothing evicted
    assert len(store) == 20 and store.get([123]) == [None] and store.bytes <= 1000
    cache.store(Batch.from_columns({"text": pa.array(["big"]), "score": pa.array(["w" * 5000])}))
    assert cache.stats()["too_large"] == 1 and cache.stats()["entries"] == 20


def mget_calls(r: Any) -> int:
    return int(r.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


def test_workers_share_answers_and_an_unseen_key_costs_no_redis_lookup(namespace: str) -> None:
    r: Any = redis_client()
    a = ResponseCache(["text"], ["score"], redis=URL, namespace=namespace)
    b = ResponseCache(["text"], ["score"], redis=URL, namespace=namespace)
    before = mget_calls(r)
    assert not a.lookup(texts(["q1", "q2"])).numpy(HIT).any()
    assert mget_calls(r) == before and a.stats()["bloom_negatives"] == 2  # no Redis lookup
    a.store(texts(["q1", "q2"], [0.1, 0.2]))
    got = b.lookup(texts(["q2", "q3", "q1"]))  # b reloads the shared filter on its first lookup
    assert got.numpy(HIT).tolist() == [True, False, True]
    assert got.column("score").to_pylist() == [0.2, None, 0.1]
    assert b.stats()["lookups"] == 2 and b.stats()["bloom_negatives"] == 1
    assert mget_calls(r) == before + 1  # one MGET for the two keys the filter let through
    assert a.stats()["entries"] == b.stats()["entries"] == 2


def test_a_redis_cache_that_cannot_work_fails_where_declared() -> None:
    from aisp.errors import ConfigError

    with pytest.raises(ConfigError, match="redis://HOST:PORT"):
        ResponseCache(["text"], ["score"], redis="http://127.0.0.1:6379")
    with pytest.raises(ConfigError, match="cannot reach Redis"):
        ResponseCache(["text"], ["score"], redis="redis://127.0.0.1:1/0")


def test_answers_in_redis_stay_under_the_bound_and_expire(namespace: str) -> None:
    r: Any = redis_client()
    cache = ResponseCache(["text"], ["score"], redis=URL, namespace=namespace, max_bytes=4000, ttl_s=1.0)
    for i in range(0, 2000, 100):
        cache.store(texts([f"t{j}" for j in range(i, i + 100)], [float(j) for j in range(i, i + 100)]))
        stored = sum(r.strlen(k) for k in r.scan_iter(f"{namespace}:a:*", count=1000))
        assert cache.bytes <= 4000 and stored <= 4000
    assert cache.evictions > 0
    got = cache.lookup(texts(["t1999", "t0"]))
    assert got.numpy(HIT).tolist() == [True, False]  # the least recently used went first
    time.sleep(1.2)
    assert not cache.lookup(texts(["t1999"])).numpy(HIT).any()  # expired


def test_two_pipelines_share_a_redis_cache_in_front_of_a_model(namespace: str) -> None:
    """Two pipelines (two workers) with caches in one namespace: what the first answered, the
    second takes from Redis, equal and marked cached, calling its model for the rest only."""

    def run(values: list[float]) -> tuple[list[dict[str, Any]], int]:
        p = Pipeline("cache-redis")
        out = CollectSink(columns=["x", "y", "cached"])
        rt = PythonRuntime(
            lambda xs: {"y": xs["x"] * 2.0}, input_names=["x"], output_names=["y"], name="double"
        )
        cache = ResponseCache(["x"], ["y"], redis=URL, namespace=namespace)
        source = p.source("xs", TestingSource([{"x": v} for v in values], batch_rows=4))

        def model(stream: Any) -> Any:
            return stream.infer("double", rt, inputs={"x": "x"}, outputs={"y": "y"})

        cached(source, "cache", cache, model).sink("out", out)
        summary = p.run()
        return sorted(out.rows, key=lambda r: r["x"]), summary.models["double"]["rows"]

    first, called = run([1.0, 2.0, 3.0])
    assert called == 3 and not any(r["cached"] for r in first)
    again, called = run([3.0, 1.0, 4.0])
    assert called == 1
    assert again == [
        {"x": 1.0, "y": 2.0, "cached": True},
        {"x": 3.0, "y": 6.0, "cached": True},
        {"x": 4.0, "y": 8.0, "cached": False},
    ]
