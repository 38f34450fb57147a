"""The endpoint pool every client of remote servers shares: which endpoint a try goes to, how calls
are counted, and how breakers keep failing endpoints out until their trial."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from aisp.errors import ConfigError
from aisp.infer.runtimes.endpoints import BreakerConfig, EndpointPool, RetryPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ConfigError, match="needs at least one endpoint"):
        EndpointPool([], BreakerConfig(), what="x")
    with pytest.raises(ConfigError, match="endpoints repeat"):
        EndpointPool(["a", "a"], BreakerConfig(), what="x")
    with pytest.raises(ConfigError, match="slots must be >= 1"):
        EndpointPool(["a"], BreakerConfig(), what="x", slots=0)
    with pytest.raises(ConfigError, match="attempts must be >= 1"):
        RetryPolicy(attempts=0)
    pool: EndpointPool[object] = EndpointPool(["a"], BreakerConfig(), what="model pool 'm'")
    with pytest.raises(ConfigError, match="model pool 'm' already has endpoint a"):
        pool.add("a")
    with pytest.raises(ConfigError, match="has no endpoint b"):
        pool.remove("b")
    with pytest.raises(ConfigError, match="needs at least one endpoint"):
        pool.remove("a")


def test_calls_spread_to_the_least_busy_then_the_least_used() -> None:
    pool: EndpointPool[object] = EndpointPool(["a", "b", "c"], BreakerConfig(), what="x")
    picked = [pool.pick(set()) for _ in range(3)]
    assert sorted(e.url for e in picked if e is not None) == ["a", "b", "c"]
    for e in picked:
        assert e is not None
        pool.end(e)
    a = pool.endpoints[0]
    pool.end(e := pool.pick(set()) or a)  # one more call on the first of the least used
    assert e.url == "a" and a.calls == 2
    assert pool.pick(set()).url in ("b", "c")  # type: ignore[union-attr]


def test_a_failed_connect_keeps_an_endpoint_out_until_its_breaker_resets() -> None:
    clock = Clock()
    pool: EndpointPool[str] = EndpointPool(
        ["a", "b"], BreakerConfig(failures=5, reset_s=2.0), what="x", connected=False, clock=clock
    )
    first = pool.pick(set())
    assert first is not None and first.connecting and first.url == "a"
    assert pool.pick(set()).url == "b"  # type: ignore[union-attr]  # a is being connected
    pool.not_connected(first, "refused")
    pool.end(first, called=False)
    assert first.error == "refused" and first.calls == 0 and first.breaker.state == "open"
    assert pool.pick({"b"}, again=False) is None  # a waits for its reset, b was tried
    clock.now = 2.0
    again = pool.pick({"b"}, again=False)
    assert again is first and again.connecting
    pool.connected(again, "client")
    assert again.connected and again.client == "client" and again.error == "" and not again.connecting


OPS = ("pick", "pick", "end", "fail", "time")


@settings(max_examples=400, deadline=None)
@given(
    n=st.integers(1, 4),
    slots=st.one_of(st.none(), st.integers(1, 3)),
    steps=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 15), st.booleans()), max_size=60),
)
@example(n=2, slots=1, steps=[("pick", 0, False), ("pick", 2, True)])  # a free slot before one not tried
def test_any_sequence_of_calls_keeps_the_pools_promises(
    n: int, slots: int | None, steps: list[tuple[str, int, bool]]
) -> None:
    """Whatever calls start, fail and end in whatever order: each pick is an endpoint whose breaker
    let a call through, one with a free slot whenever there is one, never one a call tried when
    it must not; in-flight counts are the calls picked and not ended."""
    clock = Clock()
    pool: EndpointPool[object] = EndpointPool(
        [f"e{i}" for i in range(n)], BreakerConfig(failures=2, reset_s=1.0), what="x", slots=slots,
        clock=clock,
    )  # fmt: skip
    running: list[str] = []
    by_url = {e.url: e for e in pool.endpoints}
    for op, k, again in steps:
        if op == "pick":
            tried = {f"e{i}" for i in range(n) if k >> i & 1}
            ready = {u for u, e in by_url.items() if e.breaker.ready() and (again or u not in tried)}
            free = {u for u in ready if slots is None or by_url[u].outstanding < slots}
            best = (free - tried) or free or (ready - tried) or ready  # a free slot, then not tried
            busy = {u: by_url[u].outstanding for u in best}
            e = pool.pick(tried, again=again)
            if not ready:
                assert e is None
                continue
            assert e is not None and e.url in best and busy[e.url] == min(busy.values())
            running.append(e.url)
        elif op in ("end", "fail") and running:
            url = running.pop(k % len(running))
            if op == "fail":
                by_url[url].breaker.failure()
            else:
                by_url[url].breaker.success()
            pool.end(by_url[url], failed=op == "fail")
        elif op == "time":
            clock.now += k / 4
        for url, e in by_url.items():
            assert e.outstanding == running.count(url)
    open_ = sum(1 for e in by_url.values() if e.breaker.state == "open")
    assert pool.capacity == max(1, (slots or 1) * (n - open_))
