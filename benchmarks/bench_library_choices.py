"""Library or hand-written: the two places where a well-kept library was measured against the code
it would replace, alternating, three rounds each, median reported.

* ``cache``: the response cache's in-process store (``LocalStore``: an ``OrderedDict`` with a TTL
  and an LRU byte bound) against ``cachetools.TTLCache`` with the same bound (``getsizeof=len``):
  ns per put and per get over 200,000 keys of 100-byte answers under a 5 MB bound. Needs
  ``pip install cachetools`` (not a dependency of AISP: it lost).
* ``loop``: a synchronous call into a private event loop (``aisp.aio.LoopThread``, on anyio's
  ``BlockingPortal``) against ``asyncio.run_coroutine_threadsafe`` on a loop in a thread: us per
  call of a coroutine that returns at once (the NATS connectors make one per batch).

    python benchmarks/bench_library_choices.py [cache|loop]
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from aisp.aio import LoopThread
from aisp.infer.cache.response import BloomFilter, LocalStore

ROUNDS = 3


def _cache_local(keys: list[int], blob: bytes) -> float:
    store = LocalStore(5_000_000, 60.0, BloomFilter(1 << 22), time.monotonic)
    t = time.perf_counter()
    for i in range(0, len(keys), 1000):  # as the cache stage calls it: a batch at a time
        store.put(keys[i : i + 1000], [blob] * len(keys[i : i + 1000]))
    for i in range(0, len(keys), 1000):
        store.get(keys[i : i + 1000])
    return (time.perf_counter() - t) / (2 * len(keys)) * 1e9


def _cache_cachetools(keys: list[int], blob: bytes) -> float:
    import cachetools

    cache: cachetools.TTLCache[int, bytes] = cachetools.TTLCache(maxsize=5_000_000, ttl=60.0, getsizeof=len)
    bloom = BloomFilter(1 << 22)  # the same filter in front, for a fair share of the work
    t = time.perf_counter()
    for i in range(0, len(keys), 1000):
        chunk = keys[i : i + 1000]
        for k in chunk:
            cache[k] = blob
        bloom.add(np.array(chunk, dtype=np.uint64))
    for i in range(0, len(keys), 1000):
        [cache.get(k) for k in keys[i : i + 1000]]
    return (time.perf_counter() - t) / (2 * len(keys)) * 1e9


def _loop_portal(calls: int) -> float:
    loop = LoopThread("bench-portal")

    async def nothing() -> int:
        return 1

    try:
        t = time.perf_counter()
        for _ in range(calls):
            loop.run(nothing())
        return (time.perf_counter() - t) / calls * 1e6
    finally:
        loop.close()


def _loop_asyncio(calls: int) -> float:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def nothing() -> int:
        return 1

    try:
        t = time.perf_counter()
        for _ in range(calls):
            asyncio.run_coroutine_threadsafe(nothing(), loop).result()
        return (time.perf_counter() - t) / calls * 1e6
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


Contender = tuple[str, Callable[[], float]]


def _compare(name: str, unit: str, ours: Contender, theirs: Contender) -> None:
    runs: dict[str, list[float]] = {ours[0]: [], theirs[0]: []}
    for _ in range(ROUNDS):  # alternating
        for label, fn in (ours, theirs):
            runs[label].append(fn())
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for label, values in runs.items():
        print(f"{name}: {label}: {medians[label]:.1f} {unit} (runs {', '.join(f'{v:.1f}' for v in values)})")
    print(f"{name}: {theirs[0]} / {ours[0]} = {medians[theirs[0]] / medians[ours[0]]:.2f}")


def main(which: str = "all") -> None:
    if which in ("cache", "all"):
        rng = random.Random(0)
        keys = [rng.getrandbits(63) for _ in range(200_000)]
        blob = b"x" * 100
        _compare(
            "cache store", "ns/op",
            ("LocalStore", lambda: _cache_local(keys, blob)),
            ("cachetools.TTLCache", lambda: _cache_cachetools(keys, blob)),
        )  # fmt: skip
    if which in ("loop", "all"):
        _compare(
            "loop call", "us/call",
            ("LoopThread (anyio portal)", lambda: _loop_portal(20_000)),
            ("run_coroutine_threadsafe", lambda: _loop_asyncio(20_000)),
        )  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:2])
