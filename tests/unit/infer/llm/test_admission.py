"""The LLM step's admission by time to first token: the prediction (a high quantile of recent
times, each counting for a while), the probe that lets an idle step learn again after refusing,
a Retry-After that holds, admissions on their way that stop counting when their events come or end
elsewhere, and queued rows shed when their wait reaches the target. A fake LLM client moves a
settable clock, so nothing here sleeps."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.infer.llm.admission import LlmSlo, Load, RecentTimes, TtftPredictor
from aisp.infer.llm.client import Generation, OpenAIClient
from aisp.infer.llm.stage import LlmSpec, LlmStage
from aisp.observe.export.llm import llm_families

MS = 1_000_000


class Clock:
    def __init__(self, now_ns: int = 100_000 * MS) -> None:
        self.now = now_ns

    def __call__(self) -> int:
        return self.now

    def advance_s(self, seconds: float) -> None:
        self.now += int(round(seconds * 1e9))


class FakeLlm:
    """An LLM server whose ``n``-th generation's first piece comes ``first_ms(n)`` after it is
    sent (on the settable clock), the second 1 ms later; ``gate``: generations wait for it."""

    name, version = "fake", "1"

    def __init__(
        self, clock: Clock, first_ms: Callable[[int], float], gate: threading.Event | None = None
    ) -> None:
        self.clock, self.first_ms, self.gate = clock, first_ms, gate
        self.calls = 0

    @property
    def capacity(self) -> int:
        return 1

    def endpoints(self) -> list[dict[str, Any]]:
        return []

    async def generate(
        self, prompt: str, on_piece: Callable[[str], None], *, max_tokens: int | None = None,
        deadline_ns: int | None = None,
    ) -> Generation:  # fmt: skip
        n, self.calls = self.calls, self.calls + 1
        sent = self.clock()
        if self.gate is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.gate.wait)
        self.clock.advance_s(self.first_ms(n) / 1000)
        first = self.clock()
        on_piece("a")
        self.clock.advance_s(0.001)
        on_piece("b")
        return Generation("ab", 2, 2, 1, "stop", "fake", 1, sent, first, self.clock())

    async def aclose(self) -> None:
        pass


class Step:
    """An ``LlmStage`` on a fake LLM, with what it emitted and dead-lettered."""

    def __init__(self, slo: LlmSlo, first_ms: Callable[[int], float], gate: threading.Event | None = None,
                 clock: Callable[[], int] | None = None) -> None:  # fmt: skip
        self.clock = Clock()
        self.llm = FakeLlm(self.clock, first_ms, gate)
        self.answers: list[dict[str, Any]] = []
        self.dead: list[str] = []
        self.answered = threading.Event()
        self.shed = threading.Event()
        self.stage = LlmStage(
            LlmSpec(client=self.llm, slo=slo, tokens=False), emit=self._emit, emit_made=lambda b: None,
            dead_letter=self._dead, clock=clock or self.clock,
        )  # fmt: skip
        self.ids = 0

    def _emit(self, batch: Batch) -> None:
        self.answers += batch.rows()
        self.answered.set()

    def _dead(self, batch: Batch, reason: str) -> None:
        self.dead += [reason] * batch.num_rows
        self.shed.set()

    def batch(self, n: int = 1, born_ns: int | None = None) -> Batch:
        ids = np.arange(self.ids, self.ids + n, dtype=np.int64)
        self.ids += n
        born = self.clock() if born_ns is None else born_ns
        return Batch.from_columns({"prompt": ["q"] * n}, ids=ids, ingest_ns=born)

    def settle(self) -> None:
        """Wait until the step's loop has run what is ready (a generation that just ended)."""
        loop = self.stage._loop
        assert loop is not None
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)

    def ask(self) -> dict[str, Any]:
        """One question through the step, to its answer (the step idle again after it)."""
        self.answered.clear()
        self.stage.feed(self.batch())
        assert self.answered.wait(10), self.dead
        self.settle()
        return self.answers[-1]


@pytest.fixture
def steps() -> Iterator[list[Step]]:
    made: list[Step] = []
    yield made
    for s in made:
        s.stage.close()


def test_a_slo_that_cannot_work_fails_where_declared() -> None:
    for bad in ({"margin": 0.0}, {"quantile": 1.5}, {"window": 0}, {"memory_s": 0.0}, {"probe_ms": -1.0},
                {"ttft_ms": 0.0}):  # fmt: skip
        with pytest.raises(ConfigError, match=next(iter(bad))):
            LlmSlo(**bad)  # type: ignore[arg-type]


def test_recent_times_count_for_their_memory_only() -> None:
    times = RecentTimes(window=4, memory_ns=1000)
    times.add(0, 50)
    times.add(500, 70)
    assert times.quantile(1.0, 900) == 70 and times.values(1000) == [70]
    assert times.quantile(0.5, 1500) is None  # all forgotten
    assert times.expiries(0) == [1000, 1500]


def test_ttft_prediction_from_running_requests_and_recent_times() -> None:
    p = TtftPredictor(LlmSlo(ttft_ms=1000.0))
    now = 10_000 * MS
    idle = Load((), 0, 1)
    assert p.predict_ns(idle, 0, now) is None  # nothing measured yet
    for i in range(8):
        p.record(now - i * MS, 50 * MS, 400 * MS)
    assert p.predict_ns(idle, 0, now) == 50 * MS  # a free slot: the server's first token
    busy = Load((now - 100 * MS,), 0, 1)  # one slot, busy for 100 ms of its 400
    assert p.predict_ns(busy, 0, now) == 300 * MS + 50 * MS
    assert p.predict_ns(Load((now - 100 * MS,), 2, 1), 0, now) == 300 * MS + 2 * 400 * MS + 50 * MS
    assert p.predict_ns(idle, 0, now + 11_000 * MS) is None  # forgotten after memory_s


def test_the_prediction_covers_the_slowest_percent_not_the_slowest_tenth() -> None:
    """With one answer in ten slow, a prediction from p90 admits requests that one time in ten
    miss the target, so the target cannot hold at p99; from p99 it refuses them."""
    p = TtftPredictor(LlmSlo(ttft_ms=1000.0, window=100))
    now = 10_000 * MS
    for i in range(100):
        p.record(now - i * MS, (950 if i % 10 == 0 else 100) * MS, 1000 * MS)
    assert p.over(Load((), 0, 1), 0, now) is not None
    assert p.over(Load((), 0, 1), 0, now) == (950 * MS, 1000 * MS)


def test_refusal_when_the_predicted_ttft_is_over_the_target_and_admitted_requests_count(
    steps: list[Step],
) -> None:
    step = Step(LlmSlo(ttft_ms=1000.0, margin=0.9), lambda n: 50)
    steps.append(step)
    s, now = step.stage, step.clock.now
    for i in range(8):
        s.predictor.record(now - i * MS, 50 * MS, 400 * MS)
    s._running[1] = now
    assert s.refusal(1) is None  # waits 400 + 50 ms
    assert s.refusal(1) is None  # behind one on its way: 850 ms
    refused = s.refusal(1)  # 1250 ms > 900 ms
    assert refused is not None and "over the target" in refused[1]
    assert refused[0] == pytest.approx(0.35)  # when the running one is predicted to end
    assert s.stats.refused == 1
    step.clock.now += 1_100 * MS  # the admitted ones did not come within a second: no longer counted
    s._running[1] = step.clock.now
    assert s.refusal(1) is None


def test_after_one_slow_first_answer_a_request_sent_after_the_retry_after_is_admitted(
    steps: list[Step],
) -> None:
    """The server's first generation starts after 3 s, every later one after 50 ms; the target
    is 1 s. The step forgets the slow answer in time, and an idle step admits a probe."""
    slo = LlmSlo(ttft_ms=1000.0)
    step = Step(slo, lambda n: 3000 if n == 0 else 50)
    steps.append(step)
    s = step.stage
    assert s.refusal(1) is None
    assert step.ask()["ttft_ms"] == pytest.approx(3001, abs=2)
    refused = s.refusal(1)
    assert refused is not None and "3000 ms is over the target 1000 ms" in refused[1]
    retry_s = refused[0]
    assert 0 < retry_s <= slo.probe_ms / 1000
    step.clock.advance_s(retry_s / 2)
    assert s.refusal(1) is not None  # not before its Retry-After
    step.clock.advance_s(retry_s / 2)
    assert s.refusal(1) is None and s.stats.probes == 1  # the probe
    assert step.ask()["ttft_ms"] < 100
    answered = 1
    for _ in range(200):  # clients that retry after each Retry-After: all answered, never stuck
        refused = s.refusal(1)
        if refused is not None:
            step.clock.advance_s(refused[0])
            assert s.refusal(1) is None
        step.ask()
        answered += 1
        step.clock.advance_s(0.2)
        if step.clock.now > s.predictor.first.expiries(0)[0] + 1:
            break
    assert s.refusal(1) is None and s.refusal(1) is None  # the slow answer forgotten: two at once
    assert answered >= 2 and not step.dead
    probes = {f.name: f for f in llm_families({"llm": s})}["aisp_llm_probes"]
    assert [x.value for x in probes.samples] == [s.stats.probes] and s.stats.probes >= 1


@settings(max_examples=40, deadline=None)
@given(
    st.floats(200, 2000),
    st.lists(st.tuples(st.booleans(), st.floats(0, 15_000)), min_size=1, max_size=12),
    st.floats(0, 1).map(lambda x: x * x),
)
def test_an_idle_step_never_refuses_for_long_and_its_retry_after_holds(
    target_ms: float, requests: list[tuple[bool, float]], fast_share: float
) -> None:
    """Any sequence of slow (over the target) and fast answers, at any gaps: at idle, a refused
    request gets a Retry-After no longer than the probe interval, and sent after it is admitted."""
    fast_ms = max(1.0, fast_share * target_ms)
    slow = [s for s, _ in requests]
    slo = LlmSlo(ttft_ms=target_ms)
    step = Step(slo, lambda n: 3 * target_ms if slow[n] else fast_ms)
    try:
        for _, gap_ms in requests:
            step.clock.advance_s(gap_ms / 1000)
            refused = step.stage.refusal(1)
            if refused is not None:
                assert refused[0] <= slo.probe_ms / 1000 + 0.001, refused
                step.clock.advance_s(refused[0])
                assert step.stage.refusal(1) is None
            step.ask()
    finally:
        step.stage.close()


def test_an_admission_whose_events_never_come_stops_counting_when_released(steps: list[Step]) -> None:
    step = Step(LlmSlo(ttft_ms=1000.0), lambda n: 50)
    steps.append(step)
    s = step.stage
    assert s.refusal(3, first_id=100) is None and s.refusal(2, first_id=200) is None
    refused = s.refusal(1, first_id=300)  # nothing measured: two on their way fill the one slot
    assert refused is not None and "1000 ms is over the target 1000 ms" in refused[1]
    s.release(100)  # (a passage upsert: its events went elsewhere and are done)
    assert s.refusal(1, first_id=300) is None
    step.stage.feed(Batch.from_columns({"prompt": ["q"]}, ids=np.array([201]), ingest_ns=step.clock()))
    assert step.answered.wait(10)
    step.settle()
    assert set(s._reserved) == {300}  # the one whose event came no longer counts


def test_a_queued_row_is_shed_when_its_wait_reaches_the_target_while_the_slot_is_busy(
    steps: list[Step],
) -> None:
    gate = threading.Event()
    step = Step(LlmSlo(ttft_ms=200.0), lambda n: 1, gate=gate, clock=time.monotonic_ns)
    steps.append(step)
    now = time.monotonic_ns()
    step.stage.feed(Batch.from_columns({"prompt": ["a"]}, ids=np.array([0]), ingest_ns=now))
    step.stage.feed(Batch.from_columns({"prompt": ["b"]}, ids=np.array([1]), ingest_ns=now))
    try:
        assert step.shed.wait(30), "the queued row was not shed while the slot stayed busy"
        assert len(step.dead) == 1 and "past the TTFT target 200 ms" in step.dead[0]
        assert step.stage.running == 1 and step.stage.queued_rows == 0
    finally:
        gate.set()
    assert step.answered.wait(10) and [r["_id"] for r in step.answers] == [0]


def test_an_empty_batch_starts_nothing() -> None:
    s = LlmStage(LlmSpec(client=OpenAIClient("http://127.0.0.1:9")), emit=lambda b: None,
                 emit_made=lambda b: None, dead_letter=lambda b, r: None)  # fmt: skip
    s.feed(Batch.from_columns({"prompt": np.array([], dtype=object)}))
    assert s._loop is None
    s.close()


def test_jitter_and_rate_of_recent_requests() -> None:
    s = LlmStage(LlmSpec(client=OpenAIClient("http://127.0.0.1:9")), emit=lambda b: None,
                 emit_made=lambda b: None, dead_letter=lambda b, r: None)  # fmt: skip
    assert s.stats.jitter == 0.0 and s.stats.tokens_per_s == 0.0
    s.stats.recent_jitter.extend([0.1, 0.3])
    assert s.stats.jitter == pytest.approx(0.2)
