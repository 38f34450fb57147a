"""``aisp.serve.admission``: what admission decides, for every transport.

``admit_infer``: the timeout it settles on (the transport's or the OIP ``timeout``, whichever is
sooner), the rate limits of the API key and tier (``Overloaded`` with the exact ``retry_after_s``;
the tier from the model server when the transport gives none; rows counted from the batch
dimension), the check against the model's signature, and what ``Admitted`` carries to
``infer_admitted``. ``PipelineAdmission``: a first chunk refused by a rate limit, by the
anomaly-controlled rate or by an LLM step (``Retry-After`` from each), or when the inbox stays
full for ``wait_s``; later chunks waiting instead, released by ``stop``; LLM places released
when the chunk is done or not taken. Clocks, sleeps and the service are fakes: nothing waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from aisp.admission.ratelimit import Limiter, RateLimits
from aisp.batch import Batch
from aisp.errors import BadRequest, Overloaded
from aisp.serve import admission
from aisp.serve.admission import Admitted, PipelineAdmission, admit_infer, infer_admitted
from aisp.serve.models.server import ModelServer
from aisp.serve.oip.request import InferInput, InferRequest, Signature, TensorSignature
from aisp.serve.pipelines.results import Chunk
from aisp.serve.pipelines.service import PipelineService

SIG = Signature("m", 8, (TensorSignature("x", "FP32", (2,)),), (TensorSignature("y", "FP32", (2,)),))


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class FakeModels:
    """What admission uses of a ``ModelServer``: ``tier_of`` and ``infer_async``."""

    def __init__(self, tier: int = 2) -> None:
        self.tier, self.asked, self.calls = tier, list[tuple[str, int]](), list[tuple[Any, ...]]()

    def tier_of(self, model: str, priority: int) -> int:
        self.asked.append((model, priority))
        return self.tier

    def infer_async(self, name: str, arrays: dict[str, Any], **options: Any) -> str:
        self.calls.append((name, arrays, options))
        return "the coroutine"


def request(rows: int = 1, **change: Any) -> InferRequest:
    arr = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    return InferRequest([InferInput("x", "FP32", (rows, 2), arr)], **change)


def admit(
    models: FakeModels,
    req: InferRequest,
    limiter: Limiter | None = None,
    *,
    tier: int | None = None,
    timeout_s: float | None = None,
    api_key: str = "k",
) -> Admitted:
    return admit_infer(
        cast(ModelServer, models),
        limiter,
        req,
        SIG,
        version="3",
        tier=tier,
        timeout_s=timeout_s,
        api_key=api_key,
    )


# -- admit_infer ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("timeout_us", "timeout_s", "expected"),
    [
        (None, None, None),
        (None, 3.0, 3.0),
        (2_000_000, None, 2.0),
        (2_000_000, 5.0, 2.0),
        (2_000_000, 1.5, 1.5),
        (250, 1.0, 0.00025),
    ],
)
def test_the_sooner_of_the_transports_timeout_and_the_oip_timeout(
    timeout_us: int | None, timeout_s: float | None, expected: float | None
) -> None:
    a = admit(FakeModels(), request(timeout_us=timeout_us), timeout_s=timeout_s)
    assert a.timeout_s == expected


def test_admitted_carries_the_checked_arrays_and_the_options() -> None:
    req = request(3, priority=4, rollout_key="user-1")
    a = admit(FakeModels(), req, tier=1, timeout_s=2.0)
    assert list(a.arrays) == ["x"]
    assert a.arrays["x"] is req.inputs[0].array
    assert (a.version, a.priority, a.tier, a.timeout_s, a.key) == ("3", 4, 1, 2.0, "user-1")


def test_without_a_limiter_the_tier_is_not_looked_up() -> None:
    models = FakeModels()
    a = admit(models, request(priority=5))
    assert models.asked == []
    assert a.tier is None  # the server decides it later


def test_a_request_that_does_not_fit_the_model_is_a_bad_request() -> None:
    req = InferRequest([InferInput("x", "FP32", (1, 3), np.zeros((1, 3), np.float32))])
    with pytest.raises(
        BadRequest, match=r"^unexpected shape for input 'x' for model 'm'\. Expected \[-1,2\]"
    ):
        admit(FakeModels(), req)


def test_the_per_key_limit_refuses_with_the_wait_until_there_is_room() -> None:
    clock = Clock()
    limiter = Limiter(RateLimits(per_key_rps=10.0), clock=clock)  # burst: 10 rows
    models = FakeModels()
    assert admit(models, request(4), limiter).arrays["x"].shape == (4, 2)
    assert admit(models, request(4), limiter).arrays["x"].shape == (4, 2)
    with pytest.raises(Overloaded, match=r"^rate limit: retry in 0\.200 s$") as refused:
        admit(models, request(4), limiter)  # 2 rows left: 2 more take 0.2 s
    assert refused.value.retry_after_s == pytest.approx(0.2)
    assert refused.value.http_status == 429 and refused.value.grpc_code == "RESOURCE_EXHAUSTED"
    assert admit(models, request(4), limiter, api_key="other").arrays["x"].shape == (4, 2)  # its own bucket
    clock.now += 0.2
    assert admit(models, request(4), limiter).arrays["x"].shape == (4, 2)
    assert models.asked == [("m", 0)] * 5  # the tier is looked up for every request, refused or not


def test_the_tier_limit_applies_to_the_tier_the_model_server_gives() -> None:
    clock = Clock()
    limiter = Limiter(RateLimits(per_tier_rps={2: 5.0}), clock=clock)  # burst: 5 rows for tier 2
    models = FakeModels(tier=2)
    admit(models, request(4, priority=7), limiter)
    with pytest.raises(Overloaded, match=r"^rate limit: retry in 0\.600 s$") as refused:
        admit(models, request(4, priority=7), limiter)
    assert refused.value.retry_after_s == pytest.approx(0.6)
    assert models.asked == [("m", 7), ("m", 7)]
    a = admit(models, request(4), limiter, tier=1)  # a tier given: not looked up, and tier 1 is unlimited
    assert a.tier == 1 and len(models.asked) == 2
    with pytest.raises(Overloaded, match=r"^rate limit: retry in 0\.200 s$"):
        admit(models, request(2), limiter, tier=2)  # tier 2 given: 1 row left of its burst


def test_rows_are_the_batch_dimension_and_limits_come_before_the_check() -> None:
    limiter = Limiter(RateLimits(per_key_rps=1.0), clock=Clock())  # burst: 1 row
    models = FakeModels()
    with pytest.raises(BadRequest, match=r"^expected 1 inputs but got 0 inputs for model 'm'"):
        admit(models, InferRequest([]), limiter)  # no input: one row, taken before the check fails
    with pytest.raises(Overloaded, match=r"^rate limit: retry in 1\.000 s$"):
        admit(models, request(1), limiter)
    limiter = Limiter(RateLimits(per_key_rps=1.0), clock=Clock())
    scalar = InferRequest([InferInput("x", "FP32", (), np.zeros((), np.float32))])
    with pytest.raises(BadRequest, match="has no shape"):
        admit(models, scalar, limiter)  # a 0-d input counts as one row
    with pytest.raises(Overloaded, match=r"^rate limit: retry in 1\.000 s$"):
        admit(models, request(1), limiter)


def test_infer_admitted_passes_every_option_and_checked() -> None:
    models = FakeModels()
    a = Admitted({"x": np.zeros((1, 2))}, "3", 4, 1, 2.5, "user-1")
    assert infer_admitted(cast(ModelServer, models), "m", a) == "the coroutine"  # type: ignore[comparison-overlap]
    [(name, arrays, options)] = models.calls
    assert name == "m" and arrays is a.arrays
    assert options == {
        "version": "3",
        "priority": 4,
        "tier": 1,
        "timeout_s": 2.5,
        "checked": True,
        "key": "user-1",
    }


# -- PipelineAdmission: fakes ----------------------------------------------------------------------------
class FakeControl:
    """An anomaly control whose ``take`` answers the waits given, then 0.0."""

    def __init__(self, waits: list[float], rate: float = 1234.4, retry: float = 0.75) -> None:
        self.waits, self.rate, self.retry = list(waits), rate, retry
        self.offered_rows: list[int] = []
        self.taken: list[int] = []

    def offered(self, rows: int) -> None:
        self.offered_rows.append(rows)

    def take(self, rows: int) -> float:
        self.taken.append(rows)
        return self.waits.pop(0) if self.waits else 0.0

    def retry_after_s(self) -> float:
        return self.retry


class FakeStage:
    """An LLM step that admits, or refuses with (retry, why)."""

    def __init__(self, refusal: tuple[float, str] | None = None) -> None:
        self.refusal_, self.asked, self.released = refusal, list[tuple[int, int | None]](), list[int]()

    def refusal(self, rows: int, *, first_id: int | None = None) -> tuple[float, str] | None:
        self.asked.append((rows, first_id))
        return self.refusal_

    def release(self, first_id: int) -> None:
        self.released.append(first_id)


class FakeService:
    """A served pipeline's inbox: ``offer`` answers the results given (the last one again after)."""

    name = "p"

    def __init__(
        self,
        offers: list[bool] | None = None,
        control: FakeControl | None = None,
        stages: dict[str, FakeStage] | None = None,
    ) -> None:
        self.results = list(offers or [True])
        self.control = control
        self.executor = SimpleNamespace(llm_stages=stages or {})
        self.offers: list[tuple[Batch | None, Chunk | None]] = []
        self.refusals: list[tuple[int, bool]] = []

    def offer(self, batch: Batch | None, chunk: Chunk | None) -> bool:
        self.offers.append((batch, chunk))
        return self.results.pop(0) if len(self.results) > 1 else self.results[0]

    def refused(self, events: int, *, rate_limited: bool = False) -> None:
        self.refusals.append((events, rate_limited))


class FakeStop:
    """``threading.Event`` as ``admit`` uses it: each wait is recorded and moves the clock; the
    wait numbered ``set_at`` (from 0) finds it set."""

    def __init__(self, clock: Clock, set_at: int | None = None) -> None:
        self.clock, self.set_at, self.waits = clock, set_at, list[float]()

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.clock.now += timeout
        return self.set_at is not None and len(self.waits) > self.set_at


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The fake clock, as ``time.monotonic`` inside the admission module."""
    c = Clock()
    monkeypatch.setattr(admission, "time", SimpleNamespace(monotonic=c))
    return c


def rows(n: int, first_id: int = 40) -> Batch:
    return Batch.from_columns({"v": np.arange(n)}, ids=np.arange(first_id, first_id + n), ingest_ns=0)


def pipeline(service: FakeService, limiter: Limiter | None = None, wait_s: float = 1.0) -> PipelineAdmission:
    return PipelineAdmission(cast(PipelineService, service), limiter=limiter, wait_s=wait_s)


def run_admit(
    adm: PipelineAdmission,
    batch: Batch | None,
    chunk: Chunk | None,
    stop: FakeStop,
    *,
    first: bool,
    tier: int | None = None,
) -> bool:
    return adm.admit(batch, chunk, key="k", tier=tier, first=first, stop=stop)  # type: ignore[arg-type]


# -- PipelineAdmission: decisions ------------------------------------------------------------------------
def test_a_chunk_with_room_is_offered_once(clock: Clock) -> None:
    service = FakeService()
    batch, chunk = rows(3), Chunk(0, 3)
    stop = FakeStop(clock)
    assert run_admit(pipeline(service), batch, chunk, stop, first=True) is True
    assert service.offers == [(batch, chunk)]
    assert service.refusals == [] and stop.waits == []


def test_a_first_chunk_over_the_rate_limit_is_refused_with_its_wait(clock: Clock) -> None:
    limiter = Limiter(RateLimits(per_key_rps=2.0), clock=clock)  # burst: 2 rows
    service = FakeService()
    with pytest.raises(Overloaded, match=r"^rate limit: retry in 0\.500 s$") as refused:
        run_admit(pipeline(service, limiter), rows(3), Chunk(0, 3), FakeStop(clock), first=True)
    assert refused.value.retry_after_s == pytest.approx(0.5)
    assert service.refusals == [(3, True)]
    assert service.offers == []


def test_a_later_chunk_over_the_rate_limit_waits_then_is_offered(clock: Clock) -> None:
    limiter = Limiter(RateLimits(per_tier_rps={0: 2.0}), clock=clock)  # no tier: tier 0
    service = FakeService()
    stop = FakeStop(clock)
    assert run_admit(pipeline(service, limiter), rows(3), Chunk(0, 3), stop, first=False) is True
    assert stop.waits == [pytest.approx(0.5)]
    assert len(service.offers) == 1 and service.refusals == []


def test_a_later_chunk_waiting_for_the_rate_is_released_by_stop(clock: Clock) -> None:
    limiter = Limiter(RateLimits(per_key_rps=2.0), clock=clock)
    service = FakeService()
    stop = FakeStop(clock, set_at=0)
    assert run_admit(pipeline(service, limiter), rows(3), Chunk(0, 3), stop, first=False) is False
    assert service.offers == [] and service.refusals == []


def test_a_first_chunk_over_the_controlled_rate_is_refused_with_the_controls_retry(clock: Clock) -> None:
    control = FakeControl([0.25])
    service = FakeService(control=control)
    with pytest.raises(Overloaded) as refused:
        run_admit(pipeline(service), rows(3), Chunk(0, 3), FakeStop(clock), first=True)
    assert str(refused.value) == (
        "pipeline 'p' admits 1,234 events/s while its anomaly condition holds; retry in 0.750 s"
    )
    assert refused.value.retry_after_s == 0.75
    assert control.offered_rows == [3] and control.taken == [3]
    assert service.refusals == [(3, True)] and service.offers == []


def test_a_later_chunk_over_the_controlled_rate_waits_and_is_counted_once(clock: Clock) -> None:
    control = FakeControl([0.25, 0.125])
    service = FakeService(control=control)
    stop = FakeStop(clock)
    assert run_admit(pipeline(service), rows(3), Chunk(0, 3), stop, first=False) is True
    assert stop.waits == [0.25, 0.125]
    assert control.offered_rows == [3]  # offered once, taken until there is room
    assert control.taken == [3, 3, 3]
    assert len(service.offers) == 1


def test_a_later_chunk_waiting_for_the_controlled_rate_is_released_by_stop(clock: Clock) -> None:
    service = FakeService(control=FakeControl([0.25, 0.125]))
    stop = FakeStop(clock, set_at=1)
    assert run_admit(pipeline(service), rows(3), Chunk(0, 3), stop, first=False) is False
    assert stop.waits == [0.25, 0.125] and service.offers == []


def test_a_chunk_of_no_events_passes_no_limit(clock: Clock) -> None:
    limiter = Limiter(RateLimits(per_key_rps=1.0), clock=clock)
    limiter.admit("k", 0, 1)  # the key's bucket is empty
    control = FakeControl([9.0])
    service = FakeService(control=control, stages={"llm": FakeStage((1.0, "never"))})
    chunk = Chunk(0, 0)
    assert run_admit(pipeline(service, limiter), None, chunk, FakeStop(clock), first=True) is True
    assert service.offers == [(None, chunk)]
    assert control.taken == [] and service.executor.llm_stages["llm"].asked == []


def test_a_first_chunk_an_llm_step_refuses_gives_back_the_places_taken(clock: Clock) -> None:
    first, second = FakeStage(), FakeStage((1.5, "TTFT 900 ms over its 500 ms target"))
    service = FakeService(stages={"a": first, "b": second})
    with pytest.raises(Overloaded) as refused:
        run_admit(pipeline(service), rows(3, first_id=40), Chunk(0, 3), FakeStop(clock), first=True)
    assert str(refused.value) == (
        "pipeline 'p': LLM step 'b': TTFT 900 ms over its 500 ms target; retry in 1.50 s"
    )
    assert refused.value.retry_after_s == 1.5
    assert first.asked == second.asked == [(3, 40)]
    assert first.released == [40] and second.released == []
    assert service.refusals == [(3, False)] and service.offers == []


def test_llm_places_are_released_when_the_chunk_is_done(clock: Clock) -> None:
    stage = FakeStage()
    service = FakeService(stages={"llm": stage})
    notified: list[int] = []
    chunk = Chunk(0, 2, notify=lambda: notified.append(chunk.prefix))
    assert run_admit(pipeline(service), rows(2, first_id=7), chunk, FakeStop(clock), first=True) is True
    assert stage.asked == [(2, 7)] and stage.released == []
    notify = cast(Callable[[], None], chunk.notify)
    chunk.prefix = 1
    notify()
    assert stage.released == [] and notified == [1]
    chunk.prefix = 2
    notify()
    assert stage.released == [7] and notified == [1, 2]


def test_later_chunks_are_not_checked_by_llm_steps(clock: Clock) -> None:
    stage = FakeStage((1.0, "full"))
    service = FakeService(stages={"llm": stage})
    assert run_admit(pipeline(service), rows(2), Chunk(0, 2), FakeStop(clock), first=False) is True
    assert stage.asked == []


def test_a_first_chunk_is_refused_once_the_inbox_stays_full_for_wait_s(clock: Clock) -> None:
    stage = FakeStage()
    service = FakeService(offers=[False], stages={"llm": stage})
    stop = FakeStop(clock)
    with pytest.raises(Overloaded) as refused:
        run_admit(pipeline(service, wait_s=0.001), rows(3, first_id=5), Chunk(0, 3), stop, first=True)
    assert str(refused.value) == "pipeline 'p' is overloaded: its admission queue is full; retry later"
    assert refused.value.retry_after_s == 1.0
    assert stop.waits == pytest.approx([0.0002, 0.0004, 0.0008])  # 1.4 ms: past the 1 ms wait
    assert len(service.offers) == 4
    assert service.refusals == [(3, False)]
    assert stage.released == [5]


def test_a_first_chunk_with_no_wait_is_refused_at_the_first_full_offer(clock: Clock) -> None:
    service = FakeService(offers=[False])
    stop = FakeStop(clock)
    with pytest.raises(Overloaded, match="admission queue is full"):
        run_admit(pipeline(service, wait_s=0.0), rows(1), Chunk(0, 1), stop, first=True)
    assert len(service.offers) == 1 and stop.waits == []


def test_a_later_chunk_waits_for_room_with_doubling_pauses(clock: Clock) -> None:
    service = FakeService(offers=[False] * 8 + [True])
    stop = FakeStop(clock)
    assert run_admit(pipeline(service, wait_s=0.0), rows(2), Chunk(0, 2), stop, first=False) is True
    assert stop.waits == pytest.approx([0.0002, 0.0004, 0.0008, 0.0016, 0.0032, 0.005, 0.005, 0.005])
    assert len(service.offers) == 9 and service.refusals == []


def test_stop_while_waiting_for_room_gives_back_the_llm_places(clock: Clock) -> None:
    stage = FakeStage()
    service = FakeService(offers=[False], stages={"llm": stage})
    stop = FakeStop(clock, set_at=2)
    assert (
        run_admit(pipeline(service, wait_s=10.0), rows(2, first_id=3), Chunk(0, 2), stop, first=True) is False
    )
    assert len(stop.waits) == 3 and len(service.offers) == 3
    assert stage.released == [3] and service.refusals == []


# -- PipelineAdmission.admit_async ---------------------------------------------------------------------------
@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch, clock: Clock) -> list[float]:
    """``asyncio.sleep`` inside the admission module: recorded, moving the fake clock, not waiting."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(admission, "asyncio", SimpleNamespace(sleep=sleep))
    return slept


def admit_async(adm: PipelineAdmission, batch: Batch | None, chunk: Chunk | None, *, first: bool) -> None:
    asyncio.run(adm.admit_async(batch, chunk, key="k", tier=None, first=first))


def test_async_first_chunk_over_the_rate_limit_is_refused(clock: Clock, sleeps: list[float]) -> None:
    limiter = Limiter(RateLimits(per_key_rps=2.0), clock=clock)
    service = FakeService()
    with pytest.raises(Overloaded, match=r"^rate limit: retry in 0\.500 s$"):
        admit_async(pipeline(service, limiter), rows(3), Chunk(0, 3), first=True)
    assert sleeps == [] and service.offers == [] and service.refusals == [(3, True)]


def test_async_later_chunk_sleeps_for_the_rates_then_for_room(clock: Clock, sleeps: list[float]) -> None:
    limiter = Limiter(RateLimits(per_key_rps=2.0), clock=clock)
    control = FakeControl([0.25])
    service = FakeService(offers=[False, False, True], control=control)
    admit_async(pipeline(service, limiter, wait_s=0.0), rows(3), Chunk(0, 3), first=False)
    assert sleeps == pytest.approx([0.5, 0.25, 0.0002, 0.0004])
    assert control.offered_rows == [3] and control.taken == [3, 3]
    assert len(service.offers) == 3 and service.refusals == []


def test_async_first_chunk_is_refused_once_the_inbox_stays_full(clock: Clock, sleeps: list[float]) -> None:
    stage = FakeStage()
    service = FakeService(offers=[False], stages={"llm": stage})
    with pytest.raises(Overloaded, match="admission queue is full"):
        admit_async(pipeline(service, wait_s=0.0005), rows(1, first_id=9), Chunk(0, 1), first=True)
    assert sleeps == pytest.approx([0.0002, 0.0004])
    assert len(service.offers) == 3
    assert stage.released == [9] and service.refusals == [(1, False)]
